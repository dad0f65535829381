"""Turn a `SchedulerOutput` into the tensors of one forward: ids, positions, slots, attention metadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.core.schedule import ScheduledChunk
from pdserve.model.attention import AttentionMetadata, PrefillChunk


@dataclass(frozen=True)
class InputBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S] rows of the hidden states whose next token is sampled
    sample_chunks: tuple[ScheduledChunk, ...]  # the chunks behind those rows, same order


def order_chunks(chunks: tuple[ScheduledChunk, ...]) -> list[ScheduledChunk]:
    """Single-token chunks first (they share one batched attention call), then prefill chunks."""
    return [c for c in chunks if c.num_tokens == 1] + [c for c in chunks if c.num_tokens > 1]


@dataclass(frozen=True)
class CacheLayout:
    block_size: int
    num_slots: int  # per layer and head
    num_kv_heads: int

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows of the `[Hkv * num_slots, D]` view holding `slots` ([N]) for every head: [Hkv * N]."""
        heads = torch.arange(self.num_kv_heads).unsqueeze(1) * self.num_slots
        return (heads + slots.reshape(1, -1)).reshape(-1)


def build_input_batch(chunks: list[ScheduledChunk], layout: CacheLayout, device: torch.device,
                      dtype: torch.dtype = torch.float32) -> InputBatch:
    block_size = layout.block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    for c in chunks:
        ids.extend(c.token_ids)
        pos = range(c.start_pos, c.start_pos + c.num_tokens)
        positions.extend(pos)
        slots.extend(c.block_ids[p // block_size] * block_size + p % block_size for p in pos)
        if c.sample:
            sample_rows.append(len(ids) - 1)
    decodes = [c for c in chunks if c.num_tokens == 1]
    decode_rows, decode_bias = _decode_tensors(decodes, layout, device, dtype)
    prefills, row = [], len(decodes)
    for c in chunks[len(decodes):]:
        prefills.append(_prefill_chunk(c, row, layout, device))
        row += c.num_tokens
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    meta = AttentionMetadata(as_long(slots), len(decodes), decode_rows, decode_bias, tuple(prefills))
    return InputBatch(as_long(ids), as_long(positions), meta, as_long(sample_rows),
                      tuple(c for c in chunks if c.sample))


def _decode_tensors(decodes: list[ScheduledChunk], layout: CacheLayout, device: torch.device,
                    dtype: torch.dtype):
    block_size = layout.block_size
    if not decodes:
        return None, None
    lengths = torch.tensor([c.start_pos + 1 for c in decodes])
    max_blocks = max(len(c.block_ids) for c in decodes)
    tables = torch.zeros(len(decodes), max_blocks, dtype=torch.long)
    for i, c in enumerate(decodes):
        tables[i, :len(c.block_ids)] = torch.tensor(c.block_ids, dtype=torch.long)
    length = int(lengths.max())
    offsets = torch.arange(length)
    slots = tables[:, offsets // block_size] * block_size + offsets % block_size  # [B, L]
    valid = offsets.unsqueeze(0) < lengths.unsqueeze(1)
    slots = torch.where(valid, slots, 0)  # padding reads slot 0 and is masked out below
    bias = torch.zeros(valid.shape, dtype=dtype).masked_fill_(~valid, float("-inf"))
    return layout.rows(slots).to(device), bias.view(len(decodes), 1, length).to(device)


def _prefill_chunk(c: ScheduledChunk, row: int, layout: CacheLayout, device: torch.device) -> PrefillChunk:
    block_size = layout.block_size
    if c.start_pos == 0:
        return PrefillChunk(row, c.num_tokens, 0, None, None)
    ctx = c.start_pos + c.num_tokens
    pos = torch.arange(ctx)
    table = torch.tensor(c.block_ids, dtype=torch.long)
    kv_slots = table[pos // block_size] * block_size + pos % block_size
    q_pos = torch.arange(c.start_pos, ctx)
    mask = pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [q_len, ctx]: a query sees keys at or before it
    return PrefillChunk(row, c.num_tokens, c.start_pos, layout.rows(kv_slots).to(device), mask.to(device))
