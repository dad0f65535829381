"""The compiled CPU kernels as an attention backend (`pdserve.model.kernels`): on CPU in fp32, rotary + cache
write and decode attention (reading the blocks in place, with no gather; a coded pool's records decoded in
place, `kernels/kv_codec.c`). Prefill chunks run through the torch reference's SDPA (a decision: there is no
prefill kernel). A call the kernels cannot serve (not CPU fp32 contiguous, an unsupported codec, the library
missing or `PDSERVE_KERNELS=0`) goes to the torch reference and counts one fallback (`kernels.usable`).
"""

from __future__ import annotations

import torch

from pdserve.model import kernels
from pdserve.model.attention_backend import AttentionMetadata, CacheCodec, PrefillChunk
from pdserve.model.attention_torch import TorchAttention


class CpuKernelAttention:
    """The compiled-kernel `AttentionBackend`; `reference` serves what the kernels cannot."""

    name = "cpu_kernels"

    def __init__(self, reference: TorchAttention | None = None) -> None:
        self.reference = reference or TorchAttention()

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
