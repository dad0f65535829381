"""The torch reference attention backend: runs on any device and dtype; the compiled kernels are tested
against it and hand it the calls they cannot serve (`attention_cpu`).

Heads lead so that a gathered context is `[Hkv, B, L, D]`, already the layout the batched matmuls need;
contexts are gathered a whole block at a time (one `index_select` over the `[Hkv * num_blocks, block_size * D]`
view), which copies kilobyte runs instead of single rows. Prefill chunks run through SDPA.

A coded pool (`--kv-cache-dtype` other than auto, `meta.codec`) holds token records (`pdserve.kv.codec`)
instead of values: new keys and values are encoded as they are written and come back decoded, so even a
chunk attending over its own fresh tokens sees what the cache holds; gathered contexts are decoded after the
gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.model import kernels, residual_attention
from pdserve.model.attention_backend import AttentionMetadata, CacheCodec, PrefillChunk
from pdserve.model.rope import RotaryEmbedding


class TorchAttention:
    """The reference `AttentionBackend`."""

    name = "torch"

    def cannot_run(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return None  # any device, any dtype

    def write_kv(self, qkv, cos, sin, k_cache, v_cache, slot_rows, num_heads: int, num_kv: int,
                 codec: CacheCodec | None):
        kernels.used("rope_write_kv", "torch")
        t = qkv.shape[0]
        d = k_cache.shape[-1] if codec is None else codec.head_dim
        # q and k heads side by side: one rotary application for both
        qk = RotaryEmbedding.apply(qkv[:, :(num_heads + num_kv) * d].view(t, -1, d), cos, sin)
        q, k = qk.split([num_heads, num_kv], dim=1)
        if codec is None:
            v = qkv[:, (num_heads + num_kv) * d:].view(t, num_kv, d)
            write_kv(k_cache, v_cache, k, v, slot_rows)
            return q, k, v, None
        return write_coded(q, k, qkv[:, (num_heads + num_kv) * d:], k_cache, v_cache, slot_rows, num_kv, codec)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, layer: int, out) -> None:
        kernels.used("decode_attention", "torch")
        b = meta.num_decodes
        out[:b] = decode_attention(q[:b], k_cache, v_cache, meta, scale, layer).reshape(b, -1)

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, chunk: PrefillChunk, scale: float,
                layer: int, exact) -> torch.Tensor:
        kernels.used("prefill_attention", "torch_sdpa")
        cold = None if chunk.cold_slots is None else \
            cold_kv(meta.host_kv, chunk.cold_slots, layer, q.device, meta.host_codec or meta.codec)
        own = None if exact is None else (*exact, meta.residual, layer)
        return prefill_attention(q, k, v, k_cache, v_cache, chunk, scale, cold, meta.codec, own)

    def prefills(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, layer: int, exact,
                 out, chunks: tuple[PrefillChunk, ...] | None = None) -> None:
        """`prefill`, one chunk at a time, for `chunks` (default: all of the step's)."""
        for chunk in meta.prefills if chunks is None else chunks:
            rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
            own = None if exact is None else (exact[0][rows], exact[1][rows])
            out[rows] = self.prefill(q[rows], k[rows], v[rows], k_cache, v_cache, meta, chunk, scale, layer, own)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_rows: torch.Tensor) -> None:
    # k_cache: [Hkv, num_blocks, block_size, D]; k: [T, Hkv, D]
    d = k.shape[-1]
    k_cache.view(-1, d).index_copy_(0, slot_rows, k.transpose(0, 1).reshape(-1, d))
    v_cache.view(-1, d).index_copy_(0, slot_rows, v.transpose(0, 1).reshape(-1, d))


def write_coded(q, k, v, k_cache, v_cache, slot_rows, num_kv: int, codec: CacheCodec):
    """Rotated q, k [T, H(kv), D] and v [T, Hkv * D] into a coded pool: k and v encoded into their token
    records -> q, k, v as the records decode to, and (rows_k, rows_v) before encoding [Hkv * T, D]."""
    kernels.used("kv_encode", "torch")
    t, d = q.shape[0], codec.head_dim
    rows_k = k.transpose(0, 1).reshape(-1, d).contiguous()  # [Hkv * T, D]: slot_rows' order
    rows_v = v.reshape(t, num_kv, d).transpose(0, 1).reshape(-1, d).contiguous()
    outs = []
    for rows, cache in ((rows_k, k_cache), (rows_v, v_cache)):
        records = codec.encode(rows)
        cache.view(-1, codec.width).index_copy_(0, slot_rows, records)
        outs.append(codec.decode(records).to(q.dtype).view(num_kv, t, d).transpose(0, 1))
    return q.contiguous(), outs[0], outs[1], (rows_k, rows_v)


def gather_blocks(cache: torch.Tensor, rows: torch.Tensor, codec: CacheCodec | None = None) -> torch.Tensor:
    """[Hkv, num_blocks, bs, D] cache, block rows [Hkv * N] -> [Hkv, N * bs, D] (N blocks per head); a coded
    cache's records are decoded (fp32)."""
    num_kv, _, block_size, width = cache.shape
    blocks = cache.view(-1, block_size * width).index_select(0, rows).view(num_kv, -1, width)
    return blocks if codec is None else codec.decode(blocks)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, layer: int = 0) -> torch.Tensor:
    """q [B, H, D] -> [B, Hkv, G, D]."""
    b, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[0]
    keys = gather_blocks(k_cache, meta.decode_rows, meta.codec).to(q.dtype).view(num_kv, b, -1, head_dim)
    values = gather_blocks(v_cache, meta.decode_rows, meta.codec).to(q.dtype).view(num_kv, b, -1, head_dim)
    if meta.residual is not None:  # each decode's own block, as the residual window holds it
        residual_attention.decode_exact(meta.residual, layer, meta.codec, keys, values)
    # Group query heads by their KV head so GQA needs no repeat: q [Hkv, B, G, D] @ k^T [Hkv, B, D, L]
    qg = q.view(b, num_kv, num_heads // num_kv, head_dim).transpose(0, 1)
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale + meta.decode_bias  # [Hkv, B, G, L]
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values).transpose(0, 1)  # [B, Hkv, G, D]


def cold_kv(host_kv: torch.Tensor, slots: torch.Tensor, layer: int, device: torch.device,
            codec: CacheCodec | None = None):
    """One layer's K and V of a long context's oldest blocks, from the host tier: [Hkv, n * bs, D] each.
    Read layer by layer, right before that layer's attention, so the device holds one layer of them at once."""
    blocks = host_kv[slots, layer].to(device, non_blocking=True)  # [n, 2, Hkv, bs, D]
    n, _, num_kv, bs, width = blocks.shape
    kv = blocks.permute(1, 2, 0, 3, 4).reshape(2, num_kv, n * bs, width)
    kernels.used("cold_kv", "host_tier")
    if codec is not None:
        kv = codec.decode(kv)
    return kv[0], kv[1]


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, chunk: PrefillChunk, scale: float, cold=None,
                      codec: CacheCodec | None = None, own=None) -> torch.Tensor:
    """`own`: (exact k, exact v, ResidualMeta, layer) of a codec with a residual window."""
    # SDPA wants [1, H, S, D]
    qh = q.transpose(0, 1).unsqueeze(0)
    if chunk.kv_rows is not None:  # earlier context lives in the cache: read it all back
        ctx = chunk.start_pos + chunk.q_len
        kh = gather_blocks(k_cache, chunk.kv_rows, codec)
        vh = gather_blocks(v_cache, chunk.kv_rows, codec)
        if cold is not None:  # the oldest blocks come from the host tier
            kh, vh = torch.cat([cold[0], kh], dim=1), torch.cat([cold[1], vh], dim=1)
        kh, vh = kh[:, :ctx].unsqueeze(0).to(q.dtype), vh[:, :ctx].unsqueeze(0).to(q.dtype)
    else:
        kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    mask = chunk.causal_mask
    if own is not None:  # a residual window: each query reads its own block exactly
        k_exact, v_exact, residual, layer = own
        merged = residual_attention.prefill_attention(qh, kh, vh, mask, scale, residual, layer, codec,
                                                      chunk.window_rows, chunk.start_pos, k_exact, v_exact)
        if merged is not None:
            kernels.used("prefill_window", "flash_merge")
            return merged.transpose(0, 1).reshape(q.shape[0], -1)
        kernels.used("prefill_window", "concat")  # the coded context, then the exact keys; the mask picks
        kh, vh = residual_attention.prefill_keys(residual, layer, codec, chunk.window_rows, kh, vh, k_exact, v_exact)
        mask = residual_attention.concat_mask(chunk.start_pos, chunk.q_len, chunk.start_pos - chunk.window_rows.numel(),
                                              residual.layers[layer].shape[3], q.device)
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=kh.shape[1] != qh.shape[1])
    return out.squeeze(0).transpose(0, 1).reshape(q.shape[0], -1)
