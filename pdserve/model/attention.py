"""Attention over a paged KV cache for a mixed batch (decode tokens and prefill chunks in one step).

Token layout of a step: the decode tokens first (one per request, `num_decodes` of them), then each prefill
chunk contiguously. KV cache of one layer: `[num_slots, num_kv_heads, head_dim]` where slot =
block_id * block_size + offset; the block tables of the step are turned into slot indices once, in
`AttentionMetadata`, and reused by every layer.
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
    kv_slots: torch.Tensor | None  # [start_pos + q_len] slots to read, None when start_pos == 0
    causal_mask: torch.Tensor | None  # [q_len, start_pos + q_len] bool, None when start_pos == 0


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decodes: int
    decode_slots: torch.Tensor | None  # [B, L] slots of each decode request's context, padded
    decode_bias: torch.Tensor | None  # [B, 1, 1, L] 0 for real slots, -inf for padding
    prefills: tuple[PrefillChunk, ...]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # k_cache: [S, Hkv, D]; k: [T, Hkv, D]
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


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
    num_kv = k_cache.shape[1]
    slots = meta.decode_slots  # [B, L]
    length = slots.shape[1]
    keys = k_cache.index_select(0, slots.reshape(-1)).view(b, length, num_kv, head_dim)
    values = v_cache.index_select(0, slots.reshape(-1)).view(b, length, num_kv, head_dim)
    # Group query heads by their KV head so GQA needs no repeat: q [B, Hkv, G, D] @ k [B, Hkv, D, L]
    qg = q.view(b, num_kv, num_heads // num_kv, head_dim)
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)) * scale + meta.decode_bias  # [B, Hkv, G, L]
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values.transpose(1, 2))  # [B, Hkv, G, D]


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, chunk: PrefillChunk, scale: float) -> torch.Tensor:
    if chunk.kv_slots is not None:  # earlier context lives in the cache: read it all back
        k = k_cache.index_select(0, chunk.kv_slots)
        v = v_cache.index_select(0, chunk.kv_slots)
    # SDPA wants [1, H, S, D]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=chunk.causal_mask, is_causal=chunk.causal_mask is None, scale=scale,
        enable_gqa=kh.shape[1] != qh.shape[1])
    return out.squeeze(0).transpose(0, 1).reshape(q.shape[0], -1)
