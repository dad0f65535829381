"""Turn a `SchedulerOutput` into the tensors of one forward: ids, positions, slots, attention metadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.core.sched.schedule import ScheduledChunk
from pdserve.model import residual_attention
from pdserve.model.attention_backend import AttentionMetadata, PrefillChunk


@dataclass(frozen=True)
class InputBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S] rows of the hidden states whose next token is sampled
    sample_chunks: tuple[ScheduledChunk, ...]  # the chunks behind those rows, same order


def _batched_decode(c: ScheduledChunk) -> bool:
    return c.num_tokens == 1 and not c.cold_slots


def order_chunks(chunks: tuple[ScheduledChunk, ...]) -> list[ScheduledChunk]:
    """Single-token chunks first (they share one batched attention call), then prefill chunks and the
    decode tokens of long contexts (their oldest KV is read from the host tier)."""
    return [c for c in chunks if _batched_decode(c)] + [c for c in chunks if not _batched_decode(c)]


@dataclass(frozen=True)
class CacheLayout:
    """Shape of one layer's K (or V) cache: `[Hkv, num_blocks, block_size, D]`."""

    block_size: int
    num_blocks: int
    num_kv_heads: int

    def slot_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows of the `[Hkv * num_blocks * block_size, D]` view for `slots` [N], every head: [Hkv * N]."""
        return self._per_head(slots, self.num_blocks * self.block_size)

    def block_rows(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the `[Hkv * num_blocks, block_size * D]` view for `block_ids` [N], every head: [Hkv * N]."""
        return self._per_head(block_ids, self.num_blocks)

    def _per_head(self, index: torch.Tensor, per_head: int) -> torch.Tensor:
        heads = torch.arange(self.num_kv_heads).unsqueeze(1) * per_head
        return (heads + index.reshape(1, -1)).reshape(-1)


def build_input_batch(chunks: list[ScheduledChunk], layout: CacheLayout, device: torch.device,
                      dtype: torch.dtype = torch.float32, host_kv: torch.Tensor | None = None,
                      codec=None, window=None, windows=None, host_codec=None) -> InputBatch:
    """`host_kv`: the host tier's tensor, which long-context chunks (`cold_slots`) read their oldest KV from;
    `codec`: the pool's KVCodec when it is coded (None for `auto`); `window`: its `ResidualWindow`, when it
    keeps one, and `windows` the chunks' places in it (`ResidualWindow.plan`, same order as `chunks`);
    `host_codec`: the host tier's KVCodec when it is not the pool's (`--kv-host-cache-dtype`)."""
    block_size = layout.block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    for c in chunks:
        ids.extend(c.token_ids)
        pos = range(c.start_pos, c.start_pos + c.num_tokens)
        positions.extend(pos)
        cold = len(c.cold_slots)
        slots.extend(c.block_ids[p // block_size - cold] * block_size + p % block_size for p in pos)
        if c.sample:
            sample_rows.append(len(ids) - 1)
    decodes = [c for c in chunks if _batched_decode(c)]
    decode_rows, decode_bias, decode_lens = _decode_tensors(decodes, layout, device, dtype)
    residual, held = None, [None] * (len(chunks) - len(decodes))
    if window is not None:
        decode_len = 0 if decode_bias is None else decode_bias.shape[-1]
        residual, held = residual_attention.build(chunks, windows, window.layers, block_size, layout.num_kv_heads,
                                                  window.slots, len(decodes), decode_len, device)
    prefills, row = [], len(decodes)
    for c, rows in zip(chunks[len(decodes):], held):
        prefills.append(_prefill_chunk(c, row, layout, device, rows, dtype))
        row += c.num_tokens
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    meta = AttentionMetadata(layout.slot_rows(as_long(slots)).to(device), len(decodes), decode_rows,
                             decode_bias, tuple(prefills), decode_lens, host_kv,
                             codec if codec is not None and codec.coded else None, residual, host_codec)
    return InputBatch(as_long(ids).to(device), as_long(positions).to(device), meta,
                      as_long(sample_rows).to(device), tuple(c for c in chunks if c.sample))


def _decode_tensors(decodes: list[ScheduledChunk], layout: CacheLayout, device: torch.device,
                    dtype: torch.dtype):
    if not decodes:
        return None, None, None
    max_blocks = max(len(c.block_ids) for c in decodes)
    tables = torch.zeros(len(decodes), max_blocks, dtype=torch.long)  # padding reads block 0, masked
    for i, c in enumerate(decodes):
        tables[i, :len(c.block_ids)] = torch.tensor(c.block_ids, dtype=torch.long)
    lengths = torch.tensor([c.start_pos + 1 for c in decodes])
    offsets = torch.arange(max_blocks * layout.block_size)
    valid = offsets.unsqueeze(0) < lengths.unsqueeze(1)  # [B, L]
    bias = torch.zeros(valid.shape, dtype=dtype).masked_fill_(~valid, float("-inf"))
    return layout.block_rows(tables).to(device), bias.unsqueeze(1).to(device), lengths.to(device)


def _prefill_chunk(c: ScheduledChunk, row: int, layout: CacheLayout, device: torch.device,
                   window_rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> PrefillChunk:
    """`window_rows`: with a residual window, whose flash kernel takes the causal mask additive (in `dtype`,
    made once here rather than in every layer)."""
    if c.start_pos == 0:
        return PrefillChunk(row, c.num_tokens, 0, None, None, None, window_rows)
    ctx = c.start_pos + c.num_tokens
    cold = len(c.cold_slots)
    num_blocks = -(-ctx // layout.block_size) - cold
    rows = layout.block_rows(torch.tensor(c.block_ids[:num_blocks], dtype=torch.long))
    q_pos = torch.arange(c.start_pos, ctx)
    mask = torch.arange(ctx).unsqueeze(0) <= q_pos.unsqueeze(1)  # [q_len, ctx]: keys at or before the query
    if window_rows is not None:
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
    cold_slots = torch.tensor(c.cold_slots, dtype=torch.long) if cold else None
    return PrefillChunk(row, c.num_tokens, c.start_pos, rows.to(device), mask.to(device), cold_slots, window_rows)
