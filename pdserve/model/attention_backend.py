"""The seam between the model's attention layer and the code that runs it: what one step's attention is given
(`AttentionMetadata`, one `PrefillChunk` per prefill chunk) and the three operations a backend supplies
(`AttentionBackend`). The backends: `attention_cpu.CpuKernelAttention` (the compiled CPU kernels) and
`attention_torch.TorchAttention` (the torch reference); `attention_registry.py` names them and `attention.py`
picks one.

Token layout of a step: the decode tokens first (one per request, `num_decodes` of them), then each prefill
chunk contiguously. KV cache of one layer: `[Hkv, num_blocks, block_size, D]`; slot = block_id * block_size +
offset. The block tables of the step become row indices once, here, and every layer reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.model.residual_attention import ResidualMeta


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
    host_codec: CacheCodec | None = None  # the host tier's codec when not the pool's (`host_kv`'s records)


class AttentionBackend(Protocol):
    """Runs one layer's attention over the paged cache. A backend that cannot serve a call (a tensor on the
    wrong device, an unsupported codec) hands it to the torch reference and counts it as a fallback
    (`kernels.fallback_count()`); none falls back silently. Every call also counts its path in
    `kernels.used(part, path)`."""

    name: str

    def cannot_run(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run a model on `device` in `dtype` on this machine (None: it can). Asked
        when the backend is chosen by name, which is then an error instead of a fallback."""
        ...

    def write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_rows: torch.Tensor, num_heads: int, num_kv: int,
                 codec: CacheCodec | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
        """qkv: [T, (H + 2 Hkv) * D]; cos, sin: [T, 1, D]. Rotates q and k, writes k and v at `slot_rows` of
        the caches (encoded through `codec` when given) -> q [T, H, D], k, v [T, Hkv, D] as the cache holds
        them, and for a coded pool (rows_k, rows_v): k and v before encoding, [Hkv * T, D] each (else None)."""
        ...

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, layer: int, out: torch.Tensor) -> None:
        """The step's decodes, q's first `meta.num_decodes` rows ([T, H, D]), each over its whole context ->
        written into out's first rows ([T, H * D])."""
        ...

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, chunk: PrefillChunk, scale: float, layer: int,
                exact: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """One prefill chunk: q [q_len, H, D], its own k, v [q_len, Hkv, D] (already in the cache), causal over
        the chunk's earlier context -> [q_len, H * D]. `exact`: its k and v as a residual window holds them."""
        ...

    def prefills(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, layer: int,
                 exact: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor) -> None:
        """Every prefill chunk of the step (`meta.prefills`), q, k, v the whole step's ([T, H(kv), D]) -> written
        into their rows of out ([T, H * D]). The torch reference runs `prefill` chunk by chunk; a backend may
        run several chunks in one call."""
        ...
