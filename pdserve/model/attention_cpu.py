"""The compiled CPU kernels as an attention backend (`pdserve.model.kernels`): on CPU in fp32, rotary + cache
write and decode attention (reading the blocks in place, with no gather; a coded pool's records decoded in
place, `kernels/kv_codec.c`). A call the kernels cannot serve (not CPU fp32 contiguous, an unsupported codec,
the library missing or `PDSERVE_KERNELS=0`) goes to the torch reference and counts one fallback
(`kernels.usable`).

Prefill chunks: causal attention over the paged cache is decode attention with one query per prompt token,
each over its own context (`start_pos + i + 1` keys, read in place, online softmax): all the step's eligible
chunks go to the decode kernel in one call, their block rows repeated per token (`_PrefillPlan`, built once per
step and reused by every layer). Before, each chunk was one SDPA call over its gathered context: a burst of 16
128-token prompts made 16 calls per layer, each too small to keep two threads busy (measured, Intel Xeon, 2
threads: 16 x 128-token chunks per layer, SDPA chunk by chunk 5x the time of the one kernel call; docs/
benchmarks.md "Prefill"). A chunk of more than `KERNEL_MAX_PAIRS` (query, key) pairs stays with SDPA (a
decision, not a fallback: each query of the kernel reads its whole context again, where SDPA tiles it; measured
on the Xeon: the kernel faster up to 4 x 512 fresh tokens or 4 x 256 after 768 cached, SDPA from one 1024-token
prompt on), and so do a coded pool's chunks, a residual window's and long contexts' host-tier blocks
(`cold_slots`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.model import kernels
from pdserve.model.attention_backend import AttentionMetadata, CacheCodec, PrefillChunk
from pdserve.model.attention_torch import TorchAttention


# The most (query, key) pairs of a prefill chunk the kernel serves (`causal_pairs`); larger chunks go to SDPA.
KERNEL_MAX_PAIRS = 1 << 18


def causal_pairs(start_pos: int, q_len: int) -> int:
    """How many (query, key) pairs a chunk of `q_len` tokens after `start_pos` cached ones attends."""
    return q_len * start_pos + q_len * (q_len + 1) // 2


@dataclass(frozen=True)
class _PrefillPlan:
    """The step's prefill chunks the kernel serves, as decode queries: one per token."""

    q_rows: torch.Tensor | slice  # their rows in the step's layout (a slice when contiguous)
    rows: torch.Tensor | None  # [Hkv, P, max_blocks] block rows of each query's context (None: no chunk)
    lens: torch.Tensor | None  # [P] each query's context length
    num_chunks: int
    others: tuple[PrefillChunk, ...]  # left to the torch reference


def prefill_plan(meta: AttentionMetadata, num_kv: int, block_size: int) -> _PrefillPlan:
    """Which chunks of the step the kernel serves and their per-token block rows and context lengths."""
    mine, others = [], []
    for c in meta.prefills:
        ok = meta.codec is None and meta.residual is None and c.cold_slots is None
        (mine if ok and causal_pairs(c.start_pos, c.q_len) <= KERNEL_MAX_PAIRS else others).append(c)
    if not mine:
        return _PrefillPlan(slice(0, 0), None, None, 0, tuple(others))
    width = max(-(-(c.start_pos + c.q_len) // block_size) for c in mine)
    rows = torch.zeros(num_kv, sum(c.q_len for c in mine), width, dtype=torch.long)
    slot_rows, p = meta.slot_rows.view(num_kv, -1), 0
    for c in mine:
        n = -(-(c.start_pos + c.q_len) // block_size)
        blocks = c.kv_rows.view(num_kv, -1)[:, :n] if c.kv_rows is not None else \
            slot_rows[:, c.q_start:c.q_start + c.q_len:block_size] // block_size  # starts at a block's start
        rows[:, p:p + c.q_len, :n] = blocks.unsqueeze(1)
        p += c.q_len
    lens = torch.cat([torch.arange(c.start_pos + 1, c.start_pos + c.q_len + 1) for c in mine])
    first, last = mine[0].q_start, mine[-1].q_start + mine[-1].q_len
    q_rows = slice(first, last) if last - first == p else \
        torch.cat([torch.arange(c.q_start, c.q_start + c.q_len) for c in mine])
    return _PrefillPlan(q_rows, rows.to(meta.slot_rows.device), lens.to(meta.slot_rows.device), len(mine),
                        tuple(others))


class CpuKernelAttention:
    """The compiled-kernel `AttentionBackend`; `reference` serves what the kernels cannot."""

    name = "cpu_kernels"

    def __init__(self, reference: TorchAttention | None = None) -> None:
        self.reference = reference or TorchAttention()
        self._plan: tuple[AttentionMetadata, _PrefillPlan] | None = None  # the last step's, for its layers

    def cannot_run(self, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cpu":
            return f"the compiled CPU kernels run on CPU, not {device.type}"
        if dtype != torch.float32:
            return f"the compiled CPU kernels run float32 models, not {str(dtype).removeprefix('torch.')}"
        return kernels.unavailable()

    def write_kv(self, qkv, cos, sin, k_cache, v_cache, slot_rows, num_heads: int, num_kv: int,
                 codec: CacheCodec | None):
        if codec is not None:
            return self._write_coded(qkv, cos, sin, k_cache, v_cache, slot_rows, num_heads, num_kv, codec)
        if not kernels.usable(qkv, cos, sin, k_cache, v_cache):
            return self.reference.write_kv(qkv, cos, sin, k_cache, v_cache, slot_rows, num_heads, num_kv, None)
        kernels.used("rope_write_kv", "kernel")
        t, d = qkv.shape[0], k_cache.shape[-1]
        q, k = qkv.new_empty(t, num_heads, d), qkv.new_empty(t, num_kv, d)
        kernels.rope_write_kv(qkv, cos, sin, q, k, k_cache, v_cache, slot_rows)
        return q, k, qkv[:, (num_heads + num_kv) * d:].view(t, num_kv, d), None

    def _write_coded(self, qkv, cos, sin, k_cache, v_cache, slot_rows, num_heads: int, num_kv: int,
                     codec: CacheCodec):
        if not (kernels.usable(qkv, cos, sin) and kernels.usable_coded(codec, k_cache, v_cache)):
            return self.reference.write_kv(qkv, cos, sin, k_cache, v_cache, slot_rows, num_heads, num_kv, codec)
        kernels.used("rope_write_kv", "kernel")
        kernels.used("kv_encode", "kernel")
        t, d = qkv.shape[0], codec.head_dim
        rows_k, rows_v = qkv.new_empty(num_kv * t, d), qkv.new_empty(num_kv * t, d)  # [Hkv * T, D]: slot_rows' order
        q, k = qkv.new_empty(t, num_heads, d), qkv.new_empty(t, num_kv, d)
        kernels.rope_write_kv(qkv, cos, sin, q, k, rows_k, rows_v, torch.arange(num_kv * t))
        k_out, v_out = torch.empty_like(rows_k), torch.empty_like(rows_v)
        kernels.kv_encode(codec, rows_k, k_cache, slot_rows, k_out)
        kernels.kv_encode(codec, rows_v, v_cache, slot_rows, v_out)
        return (q, k_out.view(num_kv, t, d).transpose(0, 1), v_out.view(num_kv, t, d).transpose(0, 1),
                (rows_k, rows_v))

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, layer: int, out) -> None:
        b, codec = meta.num_decodes, meta.codec
        if meta.decode_lens is None:
            return self.reference.decode(q, k_cache, v_cache, meta, scale, layer, out)
        if codec is not None and kernels.usable_coded(codec, q, k_cache, v_cache, out):
            kernels.used("decode_attention", f"kernel_{codec.name}")
            res = meta.residual
            window = () if res is None else (res.layers[layer], res.decode_base, res.decode_from)
            kernels.decode_attention_coded(codec, q[:b], k_cache, v_cache, meta.decode_rows, meta.decode_lens,
                                           out[:b], scale, *window)
        elif codec is None and kernels.usable(q, k_cache, v_cache, out):
            kernels.used("decode_attention", "kernel")
            kernels.decode_attention(q[:b], k_cache, v_cache, meta.decode_rows, meta.decode_lens, out[:b], scale)
        else:
            self.reference.decode(q, k_cache, v_cache, meta, scale, layer, out)

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, chunk: PrefillChunk, scale: float,
                layer: int, exact) -> torch.Tensor:
        return self.reference.prefill(q, k, v, k_cache, v_cache, meta, chunk, scale, layer, exact)

    def prefills(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, layer: int, exact,
                 out) -> None:
        if self._plan is None or self._plan[0] is not meta:
            self._plan = meta, prefill_plan(meta, k_cache.shape[0], k_cache.shape[2])
        plan = self._plan[1]
        if plan.num_chunks and kernels.usable(q, k_cache, v_cache, out):
            for _ in range(plan.num_chunks):  # counted per chunk, as the reference counts them
                kernels.used("prefill_attention", "kernel")
            if isinstance(plan.q_rows, slice):
                kernels.decode_attention(q[plan.q_rows], k_cache, v_cache, plan.rows, plan.lens, out[plan.q_rows],
                                         scale)
            else:
                part = out.new_empty(plan.lens.numel(), out.shape[1])
                kernels.decode_attention(q.index_select(0, plan.q_rows), k_cache, v_cache, plan.rows, plan.lens,
                                         part, scale)
                out.index_copy_(0, plan.q_rows, part)
            others = plan.others
        else:
            others = meta.prefills
        self.reference.prefills(q, k, v, k_cache, v_cache, meta, scale, layer, exact, out, others)
