"""Attention through a residual window (`pdserve.kv.residual`): the keys and values of a query's own block are
read exactly (fp16, from the window or this step's own tokens), every other key through the codec.

A step writes the tokens of each chunk's last block into the chunk's window slot (`write_window`, right
after they are encoded into the pool). Decode tokens read their block's earlier tokens from the slot (the
kernel, or `decode_exact` on the torch path). A prefill chunk (`prefill_attention`) on CPU runs causal flash
attention over the coded context, then swaps, in each query's softmax, the coded keys of its own block for the
exact ones (a block of at most `block_size` keys per query, merged through the flash kernel's log-sum-exp);
elsewhere it attends over the coded context plus the exact keys of its blocks, one mask choosing which copy
each query reads (`prefill_keys`: twice the keys, so on CPU ~3x the attention time of the merge).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ResidualMeta:
    layers: list  # the window's per-layer tensors, [2, Hkv, slots, bs, D] fp16
    write_src: torch.Tensor  # [Hkv * N] rows of the step's [Hkv * T, D] new K (and V) that go to the window
    write_rows: torch.Tensor  # [Hkv * N] rows of a layer's [Hkv * slots * bs, D] window view they go to
    decode_base: torch.Tensor | None  # [B] int64: each decode's slot * block_size (the kernel)
    decode_from: torch.Tensor | None  # [B] int64: each decode's first position read from the window
    decode_keys: torch.Tensor | None  # [M] torch path: key indices into the gathered [B * L] keys ...
    decode_slots: torch.Tensor | None  # [M] ... and the window rows (of one head) that replace them


def build(chunks, windows, layers: list, block_size: int, num_kv: int, slots: int, num_decodes: int,
          decode_len: int, device: torch.device) -> tuple[ResidualMeta, list]:
    """The step's `ResidualMeta` and, per prefill chunk (those after the `num_decodes` decodes), the window rows
    [E] of the exact tokens of its first block that the window holds. `chunks` in the step's token order,
    `windows` their `ChunkWindow`s; `decode_len`: the decodes' padded context length L."""
    bs, total = block_size, sum(c.num_tokens for c in chunks)
    src, dst, row = [], [], 0
    for c, w in zip(chunks, windows):
        end = c.start_pos + c.num_tokens
        first = max(c.start_pos, (end - 1) // bs * bs)
        src.extend(row + p - c.start_pos for p in range(first, end))
        dst.extend(w.slot * bs + p % bs for p in range(first, end))
        row += c.num_tokens
    per_head = lambda xs, stride: (torch.arange(num_kv).unsqueeze(1) * stride  # noqa: E731
                                   + torch.tensor(xs, dtype=torch.long).unsqueeze(0)).reshape(-1).to(device)
    decodes = list(zip(chunks[:num_decodes], windows[:num_decodes]))
    keys = [b * decode_len + p for b, (c, w) in enumerate(decodes) for p in range(w.exact_from, c.start_pos + 1)]
    rows = [w.slot * bs + p % bs for c, w in decodes for p in range(w.exact_from, c.start_pos + 1)]
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    meta = ResidualMeta(layers, per_head(src, total), per_head(dst, slots * bs),
                        as_long([w.slot * bs for _, w in decodes]) if decodes else None,
                        as_long([w.exact_from for _, w in decodes]) if decodes else None,
                        as_long(keys) if decodes else None, as_long(rows) if decodes else None)
    prefills = [_prefill_window(c, w, bs, device) for c, w in zip(chunks[num_decodes:], windows[num_decodes:])]
    return meta, prefills


def _prefill_window(c, w, bs: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([w.slot * bs + p % bs for p in range(w.exact_from, c.start_pos)], dtype=torch.long,
                        device=device)


def concat_mask(start: int, q_len: int, exact_from: int, bs: int, device: torch.device) -> torch.Tensor:
    """For `prefill_keys`: which of the coded context [0, end), then the exact keys [exact_from, end), each
    query at start .. end - 1 reads -> [q_len, end + end - exact_from] bool."""
    end = start + q_len
    q_pos = torch.arange(start, end, device=device).unsqueeze(1)
    q_block = q_pos // bs * bs
    coded = torch.arange(end, device=device).unsqueeze(0) < torch.clamp(q_block, min=exact_from)
    exact_pos = torch.arange(exact_from, end, device=device).unsqueeze(0)
    return torch.cat([coded, (exact_pos >= q_block) & (exact_pos <= q_pos)], dim=1)


def write_window(meta: ResidualMeta, layer: int, codec, rows_k: torch.Tensor, rows_v: torch.Tensor,
                 num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes the step's new K and V (`rows_*` [Hkv * T, D], exact) of each chunk's last block into the window
    -> k, v [T, Hkv, D] as the window holds them (fp16 in the codec's basis, decoded), for the step's queries."""
    window, d = meta.layers[layer], rows_k.shape[1]
    out = []
    for i, rows in enumerate((rows_k, rows_v)):
        held = codec.window_encode(rows)
        window[i].view(-1, d).index_copy_(0, meta.write_rows, held.index_select(0, meta.write_src))
        out.append(codec.window_decode(held).to(rows.dtype).view(-1, num_tokens, d).transpose(0, 1))
    return out[0], out[1]


def decode_exact(meta: ResidualMeta, layer: int, codec, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Torch decode path: replaces, in the gathered keys and values [Hkv, B, L, D], those of each decode's own
    block that the window holds."""
    window = meta.layers[layer]
    num_kv, d = keys.shape[0], keys.shape[-1]
    for i, gathered in enumerate((keys, values)):
        held = window[i].view(num_kv, -1, d).index_select(1, meta.decode_slots)
        gathered.view(num_kv, -1, d)[:, meta.decode_keys] = codec.window_decode(held).to(gathered.dtype)


def prefill_keys(meta: ResidualMeta, layer: int, codec, window_rows: torch.Tensor, kh: torch.Tensor,
                 vh: torch.Tensor, k_exact: torch.Tensor, v_exact: torch.Tensor):
    """A prefill chunk's keys and values: the coded context `kh`, `vh` [1, Hkv, ctx, D], then the exact ones of
    its first block held in the window (`window_rows`), then its own exact k, v [q_len, Hkv, D]."""
    window = meta.layers[layer]
    num_kv, d = kh.shape[1], kh.shape[-1]
    out = []
    for i, (coded, own) in enumerate(((kh, k_exact), (vh, v_exact))):
        held = codec.window_decode(window[i].view(num_kv, -1, d).index_select(1, window_rows)).to(coded.dtype)
        out.append(torch.cat([coded, held.unsqueeze(0), own.transpose(0, 1).unsqueeze(0)], dim=2))
    return out[0], out[1]


def prefill_attention(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, meta: ResidualMeta, layer: int, codec, window_rows: torch.Tensor, start: int,
                      k_exact: torch.Tensor, v_exact: torch.Tensor) -> torch.Tensor | None:
    """A prefill chunk's attention on CPU -> [H, q_len, D], or None where the flash kernel is not there (the
    caller then takes `prefill_keys`). qh [1, H, q_len, D]; kh, vh [1, Hkv, ctx, D] the coded context, own
    tokens included; `mask` the chunk's causal mask (None: no earlier context, plain causal)."""
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if flash is None or not qh.is_cpu:
        return None
    num_heads, q_len, d = qh.shape[1:]
    num_kv = kh.shape[1]
    g = num_heads // num_kv
    kr, vr = (kh, vh) if g == 1 else (kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1))
    if mask is not None and mask.dtype == torch.bool:  # the kernel takes an additive mask of the query's dtype
        mask = torch.zeros(mask.shape, dtype=qh.dtype, device=qh.device).masked_fill_(~mask, float("-inf"))
    out, lse = flash(qh, kr, vr, 0.0, mask is None, attn_mask=mask, scale=scale)  # all coded, causal
    bs = meta.layers[layer].shape[3]
    b0, end = start // bs * bs, start + q_len
    exact_from = start - window_rows.numel()
    n = end - b0
    nb, off = -(-n // bs), start - b0
    window = meta.layers[layer]
    local = []  # [coded k, coded v, exact k, exact v] of positions b0 .. end, padded to nb blocks: [Hkv, nb, bs, D]
    for i, (coded, own) in enumerate(((kh, k_exact), (vh, v_exact))):
        held = codec.window_decode(window[i].view(num_kv, -1, d).index_select(1, window_rows)).to(coded.dtype)
        exact = torch.cat([coded[0, :, b0:exact_from], held, own.transpose(0, 1)], dim=1)
        local.append((coded[0, :, b0:end], exact))
    (kc, ke), (vc, ve) = ((F.pad(x, (0, 0, 0, nb * bs - n)).view(num_kv, 1, nb, bs, d) for x in pair)
                          for pair in local)

    def placed(x: torch.Tensor) -> torch.Tensor:  # [H, q_len, ...] -> [Hkv, g, nb, bs, ...] at positions b0 ..
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (off, nb * bs - n))
        return x.view(num_kv, g, nb, bs, *x.shape[2:])
    q_loc, out_loc, lse_loc = placed(qh[0]), placed(out[0]), placed(lse[0].unsqueeze(-1))
    u = torch.arange(bs, device=qh.device)
    valid = (u.view(1, bs) <= u.view(bs, 1)) & (torch.arange(nb * bs, device=qh.device).view(nb, 1, bs) < n)
    weights = [torch.exp(q_loc @ k.transpose(-1, -2) * scale - lse_loc).masked_fill(~valid, 0.0) for k in (kc, ke)]
    num = out_loc - weights[0] @ vc + weights[1] @ ve
    den = 1.0 - weights[0].sum(-1, keepdim=True) + weights[1].sum(-1, keepdim=True)
    res = (num / den).view(num_heads, nb * bs, d)
    return res[:, off:off + q_len]
