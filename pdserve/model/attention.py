"""Attention over a paged KV cache for a mixed batch (decode tokens and prefill chunks in one step), through an
attention backend chosen once per model (`select_backend`, from `--attention-backend`).

The backends by name (`pdserve.model.attention_registry`, in the order `auto` tries them):
- `cpu_kernels`: the compiled CPU kernels (`attention_cpu`); serves CPU. Under `auto`, a call they cannot serve
  (bf16, `PDSERVE_KERNELS=0`, no compiler) goes to the torch reference and counts one fallback, per call.
- `torch`: the torch reference (`attention_torch`); serves every device. Chosen by `auto` for a device no
  other backend serves (CUDA today), which counts one fallback (`kernels.fallback_count()`) at the choice.
A backend chosen by name must be able to run the model: when it cannot (`AttentionBackend.cannot_run`: the
kernels not built, another device or dtype), choosing it is an error, never a fallback.
A new backend (CUDA kernels, say) is a module with a class that follows `AttentionBackend`, added with
`register_backend`: `auto` prefers it on the devices it serves and no caller changes.

`rope_write` and `paged_attention` are what a model's layer calls: they split the step into the backend's
operations (cache write, decodes, prefill chunks) and keep a codec's residual window (`residual_attention`).
"""

from __future__ import annotations

import functools
import logging

import torch

from pdserve.errors import InvalidRequestError
from pdserve.model import attention_registry, kernels, residual_attention
from pdserve.model.attention_backend import AttentionBackend, AttentionMetadata
from pdserve.model.attention_registry import AUTO, register_backend

__all__ = ["AttentionMetadata", "paged_attention", "register_backend", "rope_write", "select_backend"]

log = logging.getLogger(__name__)


def select_backend(name: str = AUTO, device: torch.device = torch.device("cpu"),
                   dtype: torch.dtype = torch.float32) -> AttentionBackend:
    """The backend called `name`, for a model on `device` in `dtype`: one that cannot run it is an error
    (`InvalidRequestError`, param attention_backend). For `auto`, the first that serves `device` (the torch
    reference on a device none of the others serves, counted as a kernel fallback)."""
    attention_registry.check(name)
    if name == AUTO:
        chosen = next(n for n, e in attention_registry.BACKENDS.items() if e.serves(device))
        if chosen == "torch":
            kernels.count_fallback(f"no attention backend serves {device.type}: the torch reference runs it")
        return attention_registry.make(chosen)
    backend = attention_registry.make(name)
    reason = backend.cannot_run(device, dtype)
    if reason is not None:
        raise InvalidRequestError(f"attention backend {name} cannot run this model on this machine: {reason}",
                                  param="attention_backend")
    log.info("attention backend %s (chosen by name)", name)
    return backend


@functools.cache
def default_backend() -> AttentionBackend:
    """`auto` on CPU, made once: what `rope_write` and `paged_attention` use when given no backend."""
    return select_backend()


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
               meta: AttentionMetadata, num_heads: int, num_kv: int, layer: int,
               backend: AttentionBackend | None = None):
    """qkv: [T, (H + 2 Hkv) * D]; cos, sin: [T, 1, D]; cache: one layer's [2, Hkv, num_blocks, bs, D]. Rotates
    q and k and writes k and v into the cache -> q [T, H, D], k, v [T, Hkv, D] (as the cache holds them) and
    `exact`: None, or with a residual window (written here too) the step's k and v [T, Hkv, D] as it holds them."""
    backend = backend or default_backend()
    q, k, v, rows = backend.write_kv(qkv, cos, sin, cache[0], cache[1], meta.slot_rows, num_heads, num_kv,
                                     meta.codec)
    if meta.residual is None:
        return q, k, v, None
    return q, k, v, residual_attention.write_window(meta.residual, layer, meta.codec, *rows, qkv.shape[0])


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, layer: int = 0,
                    exact: tuple[torch.Tensor, torch.Tensor] | None = None,
                    backend: AttentionBackend | None = None) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, Hkv, D] (this step's new tokens, already written to the cache) -> [T, H*D];
    `exact`: their k and v as a residual window holds them (`rope_write`), when the codec keeps one."""
    backend = backend or default_backend()
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    if meta.num_decodes:
        backend.decode(q, k_cache, v_cache, meta, scale, layer, out)
    if meta.prefills:
        backend.prefills(q, k, v, k_cache, v_cache, meta, scale, layer, exact, out)
    return out
