"""Attention over a paged KV cache for a mixed batch (decode tokens and prefill chunks in one step).

Token layout of a step: the decode tokens first (one per request, `num_decodes` of them), then each prefill
chunk contiguously. KV cache of one layer: `[num_kv_heads, num_slots, head_dim]` where slot =
block_id * block_size + offset; the block tables of the step are turned into slot indices once, in
`AttentionMetadata`, and reused by every layer. Heads lead so that gathering a context gives
`[Hkv, B*L, D]`, already the layout the batched matmuls need (no copy after the gather); the gather
itself is one dim-0 `index_select` on the `[Hkv * num_slots, D]` view, with per-head row indices
(`head * num_slots + slot`) computed once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillChunk:
    q_start: int  # first row of this chunk in the step's token layout
    q_len: int
    start_pos: int  # tokens already in the cache before this chunk (prefix hit or earlier chunks)
    kv_rows: torch.Tensor | None  # [Hkv * (start_pos + q_len)] rows to read, None when start_pos == 0
    causal_mask: torch.Tensor | None  # [q_len, start_pos + q_len] bool, None when start_pos == 0


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decodes: int
    decode_rows: torch.Tensor | None  # [Hkv * B * L] rows of each decode request's context, padded
    decode_bias: torch.Tensor | None  # [B, 1, L] 0 for real slots, -inf for padding
    prefills: tuple[PrefillChunk, ...]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # k_cache: [Hkv, S, D]; k: [T, Hkv, D]
    k_cache.index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.index_copy_(1, slot_mapping, v.transpose(0, 1))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, Hkv, D] (this step's new tokens, already written to the cache) -> [T, H*D]."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    if meta.num_decodes:
        b = meta.num_decodes
        out[:b] = _decode_attention(q[:b], k_cache, v_cache, meta, scale).reshape(b, -1)
    for chunk in meta.prefills:
        rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale)
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
    b, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[0]
    length = meta.decode_bias.shape[-1]
    keys = k_cache.view(-1, head_dim).index_select(0, meta.decode_rows).view(num_kv, b, length, head_dim)
    values = v_cache.view(-1, head_dim).index_select(0, meta.decode_rows).view(num_kv, b, length, head_dim)
    # Group query heads by their KV head so GQA needs no repeat: q [Hkv, B, G, D] @ k^T [Hkv, B, D, L]
    qg = q.view(b, num_kv, num_heads // num_kv, head_dim).transpose(0, 1)
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale + meta.decode_bias  # [Hkv, B, G, L]
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values).transpose(0, 1)  # [B, Hkv, G, D]


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    # SDPA wants [1, H, S, D]
    qh = q.transpose(0, 1).unsqueeze(0)
    if chunk.kv_rows is not None:  # earlier context lives in the cache: read it all back
        shape = (1, k_cache.shape[0], -1, k_cache.shape[-1])
        kh = k_cache.view(-1, k_cache.shape[-1]).index_select(0, chunk.kv_rows).view(shape)
        vh = v_cache.view(-1, v_cache.shape[-1]).index_select(0, chunk.kv_rows).view(shape)
    else:
        kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=chunk.causal_mask, is_causal=chunk.causal_mask is None, scale=scale,
        enable_gqa=kh.shape[1] != qh.shape[1])
    return out.squeeze(0).transpose(0, 1).reshape(q.shape[0], -1)
