"""Attention over a paged KV cache for a mixed batch (decode tokens and prefill chunks in one step).

Token layout of a step: the decode tokens first (one per request, `num_decodes` of them), then each prefill
chunk contiguously. KV cache of one layer: `[Hkv, num_blocks, block_size, D]`; slot = block_id *
block_size + offset. The block tables of the step become row indices once, in `AttentionMetadata`, and
every layer reuses them. Heads lead so that a gathered context is `[Hkv, B, L, D]`, already the layout
the batched matmuls need; contexts are gathered a whole block at a time (one `index_select` over the
`[Hkv * num_blocks, block_size * D]` view), which copies kilobyte runs instead of single rows.

On CPU in fp32 the compiled kernels (`pdserve.model.kernels`) replace the decode path and the rotary +
cache write: decode attention reads the blocks in place, with no gather. The torch code below is the
reference they are tested against and the (counted) fallback.

A coded pool (`--kv-cache-dtype` other than auto, `meta.codec`) holds token records (`pdserve.kv.codec`)
instead of values: new keys and values are encoded as they are written and come back decoded, so even a
chunk attending over its own fresh tokens sees what the cache holds; gathered contexts are decoded after the
gather; the decode kernel decodes records in place (`kernels/kv_codec.c`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from pdserve.model import kernels, residual_attention
from pdserve.model.residual_attention import ResidualMeta
from pdserve.model.rope import RotaryEmbedding


class CacheCodec(Protocol):
    """What attention asks of a coded pool's codec (`pdserve.kv.codec.KVCodec` is the one): the model runtime
    sits below the KV store and takes its codec as an argument, never importing it."""

    name: str
    head_dim: int
    width: int  # the pool's last dimension (a token record's bytes)

    def encode(self, x: torch.Tensor) -> torch.Tensor: ...

    def decode(self, records: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class PrefillChunk:
    q_start: int  # first row of this chunk in the step's token layout
    q_len: int
    start_pos: int  # tokens already in the cache before this chunk (prefix hit or earlier chunks)
    kv_rows: torch.Tensor | None  # [Hkv * num_ctx_blocks] block rows to read, None when start_pos == 0
    causal_mask: torch.Tensor | None  # [q_len, start_pos + q_len] bool (additive with a residual window), None at 0
    cold_slots: torch.Tensor | None = None  # long context: host tier slots of the oldest blocks (kv_rows: the rest)
    # residual window (`residual_attention`): rows of the exact tokens the window holds of the chunk's first block
    window_rows: torch.Tensor | None = None  # [E]


@dataclass(frozen=True)
class AttentionMetadata:
    slot_rows: torch.Tensor  # [Hkv * T] rows of the [Hkv * num_slots, D] view where new K/V are written
    num_decodes: int
    decode_rows: torch.Tensor | None  # [Hkv * B * max_blocks] block rows of each decode context, padded
    decode_bias: torch.Tensor | None  # [B, 1, L] 0 for real slots, -inf for padding
    prefills: tuple[PrefillChunk, ...]
    decode_lens: torch.Tensor | None = None  # [B] int64 context length of each decode (for the kernel)
    host_kv: torch.Tensor | None = None  # the host tier [slots, layers, 2, Hkv, bs, D] (long contexts)
    codec: CacheCodec | None = None  # the pool's KV codec when it is not `auto` (caches hold token records)
    residual: ResidualMeta | None = None  # the codec's residual window, when it keeps one


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_rows: torch.Tensor) -> None:
    # k_cache: [Hkv, num_blocks, block_size, D]; k: [T, Hkv, D]
    d = k.shape[-1]
    k_cache.view(-1, d).index_copy_(0, slot_rows, k.transpose(0, 1).reshape(-1, d))
    v_cache.view(-1, d).index_copy_(0, slot_rows, v.transpose(0, 1).reshape(-1, d))


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_rows: torch.Tensor, num_heads: int, num_kv: int,
                  codec: CacheCodec | None = None):
    """qkv: [T, (H + 2 Hkv) * D]; cos, sin: [T, 1, D]. Applies the rotary embedding to q and k, writes k
    and v into the cache -> q [T, H, D], k, v [T, Hkv, D] (through `codec`: k and v as the cache holds them)."""
    if codec is not None:
        return _rope_write_coded(qkv, cos, sin, k_cache, v_cache, slot_rows, num_heads, num_kv, codec)
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    v = qkv[:, (num_heads + num_kv) * d:].view(t, num_kv, d)
    if kernels.usable(qkv, cos, sin, k_cache, v_cache):
        kernels.used("rope_write_kv", "kernel")
        q, k = qkv.new_empty(t, num_heads, d), qkv.new_empty(t, num_kv, d)
        kernels.rope_write_kv(qkv, cos, sin, q, k, k_cache, v_cache, slot_rows)
        return q, k, v
    kernels.used("rope_write_kv", "torch")
    # q and k heads side by side: one rotary application for both
    qk = RotaryEmbedding.apply(qkv[:, :(num_heads + num_kv) * d].view(t, -1, d), cos, sin)
    q, k = qk.split([num_heads, num_kv], dim=1)
    write_kv(k_cache, v_cache, k, v, slot_rows)
    return q, k, v


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
               meta: AttentionMetadata, num_heads: int, num_kv: int, layer: int):
    """`rope_write_kv` for one layer of the model's forward -> q, k, v and `exact`: None, or with a residual
    window (written here too) the step's k and v [T, Hkv, D] as the window holds them."""
    if meta.residual is None:
        return (*rope_write_kv(qkv, cos, sin, cache[0], cache[1], meta.slot_rows, num_heads, num_kv, meta.codec),
                None)
    rows: list[torch.Tensor] = []
    q, k, v = _rope_write_coded(qkv, cos, sin, cache[0], cache[1], meta.slot_rows, num_heads, num_kv, meta.codec,
                                rows)
    return q, k, v, residual_attention.write_window(meta.residual, layer, meta.codec, *rows, qkv.shape[0])


def _rope_write_coded(qkv, cos, sin, k_cache, v_cache, slot_rows, num_heads: int, num_kv: int, codec: CacheCodec,
                      exact: list | None = None):
    """rope_write_kv into a coded pool: q and k rotated, k and v encoded into their token records (the
    kernels, else torch), and returned decoded from those records; `exact` (when given) gets the rows of k and
    v before encoding, [Hkv * T, D] each."""
    t, d = qkv.shape[0], codec.head_dim
    rows_k, rows_v = qkv.new_empty(num_kv * t, d), qkv.new_empty(num_kv * t, d)  # [Hkv * T, D]: slot_rows' order
    if kernels.usable(qkv, cos, sin) and kernels.usable_coded(codec, k_cache, v_cache):
        kernels.used("rope_write_kv", "kernel")
        q, k = qkv.new_empty(t, num_heads, d), qkv.new_empty(t, num_kv, d)
        kernels.rope_write_kv(qkv, cos, sin, q, k, rows_k, rows_v, torch.arange(num_kv * t))
        kernels.used("kv_encode", "kernel")
        k_out, v_out = torch.empty_like(rows_k), torch.empty_like(rows_v)
        kernels.kv_encode(codec, rows_k, k_cache, slot_rows, k_out)
        kernels.kv_encode(codec, rows_v, v_cache, slot_rows, v_out)
    else:
        kernels.used("rope_write_kv", "torch")
        kernels.used("kv_encode", "torch")
        qk = RotaryEmbedding.apply(qkv[:, :(num_heads + num_kv) * d].view(t, -1, d), cos, sin)
        q, k = qk.split([num_heads, num_kv], dim=1)
        rows_k.copy_(k.transpose(0, 1).reshape(-1, d))
        rows_v.copy_(qkv[:, (num_heads + num_kv) * d:].reshape(t, num_kv, d).transpose(0, 1).reshape(-1, d))
        outs = []
        for rows, cache in ((rows_k, k_cache), (rows_v, v_cache)):
            records = codec.encode(rows)
            cache.view(-1, codec.width).index_copy_(0, slot_rows, records)
            outs.append(codec.decode(records).to(qkv.dtype))
        k_out, v_out = outs
    if exact is not None:
        exact.extend((rows_k, rows_v))
    return q.contiguous(), k_out.view(num_kv, t, d).transpose(0, 1), v_out.view(num_kv, t, d).transpose(0, 1)


def _gather_blocks(cache: torch.Tensor, rows: torch.Tensor, codec: CacheCodec | None = None) -> torch.Tensor:
    """[Hkv, num_blocks, bs, D] cache, block rows [Hkv * N] -> [Hkv, N * bs, D] (N blocks per head); a coded
    cache's records are decoded (fp32)."""
    num_kv, _, block_size, width = cache.shape
    blocks = cache.view(-1, block_size * width).index_select(0, rows).view(num_kv, -1, width)
    return blocks if codec is None else codec.decode(blocks)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, layer: int = 0,
                    exact: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, Hkv, D] (this step's new tokens, already written to the cache) -> [T, H*D];
    `exact`: their k and v as a residual window holds them (`rope_write`), when the codec keeps one."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    if meta.num_decodes:
        b = meta.num_decodes
        if meta.codec is not None and meta.decode_lens is not None and \
                kernels.usable_coded(meta.codec, q, k_cache, v_cache, out):
            kernels.used("decode_attention", f"kernel_{meta.codec.name}")
            res = meta.residual
            window = () if res is None else (res.layers[layer], res.decode_base, res.decode_from)
            kernels.decode_attention_coded(meta.codec, q[:b], k_cache, v_cache, meta.decode_rows, meta.decode_lens,
                                           out[:b], scale, *window)
        elif meta.codec is None and meta.decode_lens is not None and kernels.usable(q, k_cache, v_cache, out):
            kernels.used("decode_attention", "kernel")
            kernels.decode_attention(q[:b], k_cache, v_cache, meta.decode_rows, meta.decode_lens, out[:b], scale)
        else:
            kernels.used("decode_attention", "torch")
            out[:b] = _decode_attention(q[:b], k_cache, v_cache, meta, scale, layer).reshape(b, -1)
    for chunk in meta.prefills:
        kernels.used("prefill_attention", "torch_sdpa")
        rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        cold = None if chunk.cold_slots is None else \
            _cold_kv(meta.host_kv, chunk.cold_slots, layer, q.device, meta.codec)
        own = None if exact is None else (exact[0][rows], exact[1][rows], meta.residual, layer)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale, cold, meta.codec,
                                       own)
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, layer: int = 0) -> torch.Tensor:
    b, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[0]
    keys = _gather_blocks(k_cache, meta.decode_rows, meta.codec).to(q.dtype).view(num_kv, b, -1, head_dim)
    values = _gather_blocks(v_cache, meta.decode_rows, meta.codec).to(q.dtype).view(num_kv, b, -1, head_dim)
    if meta.residual is not None:  # each decode's own block, as the residual window holds it
        residual_attention.decode_exact(meta.residual, layer, meta.codec, keys, values)
    # Group query heads by their KV head so GQA needs no repeat: q [Hkv, B, G, D] @ k^T [Hkv, B, D, L]
    qg = q.view(b, num_kv, num_heads // num_kv, head_dim).transpose(0, 1)
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale + meta.decode_bias  # [Hkv, B, G, L]
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values).transpose(0, 1)  # [B, Hkv, G, D]


def _cold_kv(host_kv: torch.Tensor, slots: torch.Tensor, layer: int, device: torch.device,
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


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, chunk: PrefillChunk, scale: float, cold=None,
                       codec: CacheCodec | None = None, own=None) -> torch.Tensor:
    """`own`: (exact k, exact v, ResidualMeta, layer) of a codec with a residual window."""
    # SDPA wants [1, H, S, D]
    qh = q.transpose(0, 1).unsqueeze(0)
    if chunk.kv_rows is not None:  # earlier context lives in the cache: read it all back
        ctx = chunk.start_pos + chunk.q_len
        kh = _gather_blocks(k_cache, chunk.kv_rows, codec)
        vh = _gather_blocks(v_cache, chunk.kv_rows, codec)
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
