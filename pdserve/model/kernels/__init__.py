"""Compiled CPU kernels for the fp32 decode path, with a counted fallback to torch.

What is here: a skinny GEMM for decode-sized row counts on weights packed in column panels (AVX-512 or
AVX2 + FMA register tiles, `gemm.c`; on quantized weight blocks, `qgemm.c`), paged decode attention that reads
K/V blocks in place through the block rows (online softmax, query heads grouped by KV head), rotary + KV-cache
write, residual add + RMSNorm, SiLU·up (`kernels.c`). The C sources are compiled for this CPU at first use (`build.py`, a few
seconds, cached).

Two different things are kept apart:
- A *decision*: the path that is fastest for this host and shape, e.g. MKL's packed sgemm for row counts
  outside the GEMM kernel's measured range, or for every matmul on a CPU without AVX2 + FMA. Logged once
  at INFO, never counted, never printed on a CLI user's stderr.
- A *fallback*: the torch path taken because the better one failed or cannot serve the call: no compiler,
  not x86-64, a build or load error, a CUDA or non-fp32 tensor, or `PDSERVE_KERNELS=0` (the kernels turned
  off by hand). Each call adds one to `fallback_count()`, and the first logs a warning with the reason
  (`fallback_reason()`). Nothing falls back silently.
`paths_used()` counts the calls of each part by the path they took (what `bench_engine.py` prints).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections import Counter

import torch
import torch.nn.functional as F

from pdserve import cbuild

log = logging.getLogger(__name__)

_lib: ctypes.CDLL | None = None
_load_error: str | None = None
_loaded = False
_disabled = os.environ.get("PDSERVE_KERNELS", "1") == "0"
_fallbacks = 0
_FP32 = torch.float32
_reason: str | None = None
_warned = False
_decided: set[str] = set()
_paths: Counter = Counter()  # (part, path) -> calls


def _library() -> ctypes.CDLL | None:
    global _lib, _load_error, _loaded
    if not _loaded:
        _loaded = True
        try:
            from pdserve.model.kernels.build import load
            _lib = load()
        except Exception as e:  # noqa: BLE001 - any build or load failure means the torch path, counted
            _load_error = f"{type(e).__name__}: {e}"
    return _lib


def available() -> bool:
    """Whether the compiled library is built and loaded (builds it on first call)."""
    return not _disabled and _library() is not None


def unavailable() -> str | None:
    """Why the compiled library cannot be used (turned off, or its build or load failed), or None when it can
    (builds it on first call)."""
    if _disabled:
        return "they are turned off (PDSERVE_KERNELS=0 or kernels.disabled())"
    return None if _library() is not None else f"they could not be built or loaded ({_load_error})"


def fallback_count() -> int:
    """How many kernel calls took the torch path since the process started."""
    return _fallbacks


def fallback_reason() -> str | None:
    """Why the last fallback happened, or None when none has."""
    return _reason


def usable(*tensors: torch.Tensor) -> bool:
    """True when the kernels can serve these (CPU, fp32, contiguous) tensors; otherwise counts one fallback
    and returns False. The library is built only once CPU tensors ask for it (never on a CUDA-only run)."""
    supported = True
    for t in tensors:  # a plain loop: this runs ~10 times per layer
        if not (t.is_cpu and t.dtype is _FP32 and t.is_contiguous()):
            supported = False
            break
    return _ready(supported, "unsupported tensors (need CPU, fp32, contiguous)", tensors)


def _ready(supported: bool, what: str, tensors) -> bool:
    """True when the library can serve a call the caller found `supported`; else one counted fallback."""
    if supported and not _disabled and _library() is not None:
        return True
    _count_fallback("disabled (PDSERVE_KERNELS=0 or kernels.disabled())" if _disabled else
                    f"{what}: {[(str(t.device), str(t.dtype), t.is_contiguous()) for t in tensors]}"
                    if not supported else _load_error)
    return False


def count_fallback(reason: str) -> None:
    """Counts one fallback to torch decided outside this module (an attention backend chosen for a device
    the kernels do not serve)."""
    _count_fallback(reason)


def _count_fallback(reason: str | None) -> None:
    global _fallbacks, _reason, _warned
    _fallbacks += 1
    _reason = reason
    if not _warned:
        _warned = True
        log.warning("pdserve CPU kernels not used, falling back to torch: %s", _reason)


def decide(what: str) -> None:
    """Logs a host-specific choice of path once, at INFO (a decision, not a fallback)."""
    if what not in _decided:
        _decided.add(what)
        log.info("pdserve kernels: %s", what)


def used(part: str, path: str, calls: int = 1) -> None:
    """Counts `calls` calls of `part` (gemm, attention, ...) on `path` (kernel name, mkl, torch)."""
    _paths[part, path] += calls


def paths_used() -> dict[str, dict[str, int]]:
    """Calls per part and path since the process started, e.g. {"gemm": {"avx2": 480, "mkl_packed": 4}}."""
    out: dict[str, dict[str, int]] = {}
    for (part, path), n in sorted(_paths.items()):
        out.setdefault(part, {})[path] = n
    return out


def isa() -> str:
    """The instruction set the compiled GEMM uses on this host: "avx512", "avx2" or "none" (no GEMM kernel:
    no AVX2 + FMA, or no library)."""
    lib = None if _disabled else _library()
    return {512: "avx512", 2: "avx2"}.get(lib.pd_gemm_isa(), "none") if lib is not None else "none"


def host_kind(kernel_isa: str | None = None) -> str:
    """The kind of CPU a matmul rule was measured on (`linear.KERNEL_ROWS`, `linear.ONEDNN_FROM`,
    `quant.I8_ROWS`, `quant.BF16_ROWS`): the instruction set of the path it rules (`isa()` unless given), with
    "_amd" added for AVX-512 on AMD CPUs (Zen 4/5: torch's MKL runs its AVX2 code there, VNNI pays from fewer rows
    than on Intel's, and oneDNN's AVX512-BF16 matmul beats fp32 where on Intel's it did not)."""
    kind = isa() if kernel_isa is None else kernel_isa
    return f"{kind}_amd" if kind in ("avx512", "avx512_bf16") and cbuild.cpu_vendor() == "amd" else kind


@contextlib.contextmanager
def disabled():
    """Run the torch path inside the block (for comparisons and tests); its calls count as fallbacks."""
    global _disabled
    before, _disabled = _disabled, True
    try:
        yield
    finally:
        _disabled = before


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """x += residual (in place, when given), then RMSNorm(x) * weight, in Hugging Face's order."""
    if usable(x, weight, *([] if residual is None else [residual])):
        used("add_rms_norm", "kernel")
        out = torch.empty_like(x)
        _lib.pd_add_rms_norm(x.data_ptr(), _ptr(residual), weight.data_ptr(), out.data_ptr(), x.shape[0],
                             x.shape[-1], eps)
        return out
    used("add_rms_norm", "torch")
    if residual is not None:
        x.add_(residual)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] -> silu(gate) * up: [T, I]."""
    if usable(gate_up):
        used("silu_mul", "kernel")
        t, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(t, n)
        _lib.pd_silu_mul(gate_up.data_ptr(), out.data_ptr(), t, n)
        return out
    used("silu_mul", "torch")
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_rows: torch.Tensor) -> None:
    """Kernel only (callers check `usable` first): see pd_rope_write_kv in kernels.c."""
    t, hq, d = q.shape
    _lib.pd_rope_write_kv(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
                          k.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_rows.data_ptr(), t, hq,
                          k.shape[1], d)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                     lens: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """Kernel only (callers check `usable` first). q: [B, H, D] contiguous; caches [Hkv, blocks, bs, D];
    rows: int64 [Hkv * B * max_blocks] block rows; lens: int64 [B]; out: [B, H * D] contiguous."""
    b, hq, d = q.shape
    hkv, _, bs, _ = k_cache.shape
    _lib.pd_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), rows.data_ptr(),
                             lens.data_ptr(), out.data_ptr(), b, hq, hkv, d, bs, rows.numel() // (hkv * b), scale)


_CODEC_IDS = {"fp16": 1, "bf16": 2, "fp8_e4m3": 3, "int8": 4, "int4": 5}


def usable_coded(codec, *tensors: torch.Tensor) -> bool:
    """As `usable`, for the KV codec kernels: fp32 tensors and uint8 pools (kernels/kv_codec.c)."""
    supported = codec.name in _CODEC_IDS and codec.head_dim % 4 == 0
    for t in tensors:
        if not (supported and t.is_cpu and t.dtype in (_FP32, torch.uint8) and t.is_contiguous()):
            supported = False
            break
    return _ready(supported, f"unsupported KV codec or tensors ({codec.name})", tensors)


def kv_encode(codec, rows: torch.Tensor, cache: torch.Tensor, slot_rows: torch.Tensor, decoded: torch.Tensor) -> None:
    """Kernel only (callers check `usable_coded`): rows [N, D] fp32 -> token records at `slot_rows` of a coded
    cache [Hkv, num_blocks, bs, token_bytes]; `decoded` [N, D] gets what the records decode to."""
    n, d = rows.shape
    if codec.rotation is not None:  # coded in a rotated basis (pdserve.kv.codec)
        rows = rows @ codec.rotation
    _lib.pd_kv_encode(_CODEC_IDS[codec.name], rows.data_ptr(), n, d, cache.data_ptr(), slot_rows.data_ptr(),
                      codec.token_bytes, decoded.data_ptr())
    if codec.rotation is not None:
        decoded.copy_(decoded @ codec.rotation)


def decode_attention_coded(codec, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           rows: torch.Tensor, lens: torch.Tensor, out: torch.Tensor, scale: float,
                           window: torch.Tensor | None = None, window_base: torch.Tensor | None = None,
                           window_from: torch.Tensor | None = None) -> None:
    """`decode_attention` over a coded pool (caches [Hkv, blocks, bs, token_bytes] uint8); kernel only. With a
    residual window (`window` [2, Hkv, slots, bs, D] fp16, contiguous): sequence i reads its positions from
    `window_from[i]` on from slot rows `window_base[i] + position % bs` (int64 [B] each)."""
    b, hq, d = q.shape
    hkv, _, bs, tb = k_cache.shape
    rotated = codec.rotation is not None  # keys and values coded in a rotated basis: so are q and the output
    target, q = (torch.empty_like(out), (q @ codec.rotation).contiguous()) if rotated else (out, q)
    win = (None,) * 4 if window is None else \
        (window[0].data_ptr(), window[1].data_ptr(), window_base.data_ptr(), window_from.data_ptr())
    win_rows = 0 if window is None else window.shape[2] * window.shape[3]
    _lib.pd_decode_attention_coded(_CODEC_IDS[codec.name], q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                   rows.data_ptr(), lens.data_ptr(), target.data_ptr(), b, hq, hkv, d, bs, tb,
                                   rows.numel() // (hkv * b), scale, *win, win_rows)
    if rotated:
        out.copy_((target.view(b, hq, d) @ codec.rotation).view(b, hq * d))


class PackedWeight:
    """A [N, K] weight re-laid in column panels for `gemm` (one more copy of the weight in memory), in
    `arena` when given (huge pages, in the order the model reads them) or a tensor of its own."""

    def __init__(self, weight: torch.Tensor, arena=None) -> None:
        n, k = weight.shape
        width = _lib.pd_gemm_panel_width()
        self.n, self.k = n, k
        numel = -(-n // width) * width * k
        self.panels = arena.take(numel) if arena is not None else weight.new_empty(numel)
        _lib.pd_gemm_pack(weight.contiguous().data_ptr(), self.panels.data_ptr(), n, k)


def pack_weight(weight: torch.Tensor, arena=None) -> PackedWeight | None:
    """Packs `weight` for `gemm`, or returns None when this host has no GEMM kernel (no AVX2 + FMA: a
    decision, MKL serves every matmul) or the kernels cannot serve the weight (a counted fallback)."""
    if not usable(weight):
        return None
    if _lib.pd_gemm_panel_width() == 0:
        decide("this CPU has no AVX2 + FMA: every matmul runs on MKL/torch")
        return None
    return PackedWeight(weight, arena)


def gemm(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x: [M, K] fp32 CPU, unit column stride -> x @ W^T: [M, N]. Callers check `usable(x)` first."""
    m = x.shape[0]
    y = x.new_empty(m, w.n)
    _lib.pd_gemm(x.data_ptr(), x.stride(0), w.panels.data_ptr(), y.data_ptr(), m, w.n, w.k)
    return y


def qgemm_isa() -> str:
    """The instruction set of the quantized-weight GEMM (qgemm.c) on this host: "avx512", "avx2" (AVX2 + FMA +
    F16C) or "none"."""
    lib = None if _disabled else _library()
    return {512: "avx512", 2: "avx2"}.get(lib.pd_qgemm_isa(), "none") if lib is not None else "none"


def qgemm_i8_isa() -> str:
    """The instruction set of qgemm.c's int8-row kernel for Q8_0 weights (FMT_Q8_0_I8) on this host: "avx512"
    (AVX-512 VNNI + VBMI), "avx2" (AVX-VNNI) or "none" (no VNNI: the fp32-row kernel serves every row count)."""
    lib = None if _disabled else _library()
    return {512: "avx512", 2: "avx2"}.get(lib.pd_qgemm_i8_isa(), "none") if lib is not None else "none"


FMT_Q8_0_I8 = 3  # qgemm.c: Q8_0 weights times rows quantized to int8 per block of 32


def qscratch(rows: int, k: int) -> torch.Tensor:
    """Scratch bytes for FMT_Q8_0_I8 on `rows` rows of `k` (the rows' int8 values and scales)."""
    return torch.empty(_lib.pd_qscratch_bytes(rows, k), dtype=torch.uint8)


def qgemm(x: torch.Tensor, panels: torch.Tensor, fmt: int, n: int, k: int) -> torch.Tensor:
    """x: [M, K] fp32 CPU, unit column stride -> x @ W^T: [M, N], W the quantized `panels` (pdserve.model.quant);
    fmt FMT_Q8_0_I8 quantizes x's rows to int8 first (callers check `qgemm_i8_isa()`). Callers check `usable(x)`
    first."""
    y = x.new_empty(x.shape[0], n)
    scratch = qscratch(x.shape[0], k) if fmt == FMT_Q8_0_I8 else None
    _lib.pd_qgemm(fmt, x.data_ptr(), x.stride(0), panels.data_ptr(), y.data_ptr(), x.shape[0], n, k,
                  _ptr(scratch))
    return y


def qdecode_forward(layers, num_layers: int, step) -> None:
    """Kernel only: pd_qdecode_forward (kernels.c) on ctypes structures built by `pdserve.model.fused_decode`."""
    _lib.pd_qdecode_forward(ctypes.byref(layers), num_layers, ctypes.byref(step))


def qdequant(panels: torch.Tensor, fmt: int, n: int, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 weight [N, K] that quantized `panels` hold (in `out`'s first N * K floats when given)."""
    w = torch.empty(n, k) if out is None else out[:n * k].view(n, k)
    _lib.pd_qdequant(fmt, panels.data_ptr(), w.data_ptr(), n, k)
    return w


def qdequant_bf16t(panels: torch.Tensor, fmt: int, n: int, k: int, out: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] that quantized `panels` hold, in bf16 (each value the fp32 weight `qdequant` gives,
    rounded to nearest even): a transposed view of `out`'s first N * K bf16 values, laid out [K, N]."""
    wt = out[:n * k].view(k, n)
    _lib.pd_qdequant_bf16t(fmt, panels.data_ptr(), wt.data_ptr(), n, k)
    return wt.t()


def bf16_isa() -> str:
    """How this CPU multiplies bf16 matrices natively (what oneDNN, under torch's bf16 `F.linear`, runs on):
    "amx" (AMX tiles; every AMX CPU so far has AMX-BF16), "avx512_bf16" (vdpbf16ps) or "none" (no native bf16).
    Read from the CPU through torch's cpuinfo; `ONEDNN_MAX_CPU_ISA` below AMX (oneDNN's own cap,
    used to time the AVX512-BF16 path on an AMX host) gives "avx512_bf16"."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "ALL")).upper()
    if torch.cpu._is_amx_tile_supported() and (cap == "ALL" or "AMX" in cap):
        return "amx"
    if torch.cpu._is_avx512_bf16_supported() and (cap == "ALL" or "BF16" in cap or "AMX" in cap):
        return "avx512_bf16"
    return "none"
