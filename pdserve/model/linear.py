"""y = x @ W^T with the fastest kernel this machine has for the row count at hand.

Decode steps multiply few rows (one per running request) by large weights, so they stream every weight
once per step. In fp32 on x86-64 the compiled skinny GEMM (`pdserve.model.kernels`, weights packed in
16-column panels) does this fastest for the row counts in `KERNEL_ROWS[isa]`, a rule measured on each
kind of CPU (docs/benchmarks.md, "Engine throughput"; `benchmarks/bench_gemm.py`):
- AVX-512 (Intel Xeon, 2 threads, the default model's 120 per-layer products, cold): 28 vs 35 ms for
  MKL's packed sgemm at 16 rows, equal at 32, 21 vs 20 at 1 row, slower from ~48 rows.
- AVX2 + FMA (AMD EPYC Zen 3, 2 threads, same products): faster than MKL's packed sgemm and `F.linear`
  at every row count from 1 to 512 (16 rows: 36-54 vs 100-173 ms; 256: 523 vs 644 ms; even at 512),
  slower at 2048 (95 vs 109 GFLOP/s for `F.linear`), so it serves 1-256 rows and MKL's packed copy of
  the weights is not kept.
- AVX-512 on AMD (EPYC Zen 4, 2 threads, same products, quiet, medians of 5, 2026-12-07): MKL runs its AVX2
  code on AMD CPUs, and the kernel beats its packed sgemm at every row count (1 row 13.4 vs 29.6 ms, 48 rows
  56.7 vs 101.6); oneDNN's fp32 matmul (what vLLM-CPU runs) beats MKL at every count too (2048 rows 2,221 vs
  2,537 ms: 196 vs 171 GFLOP/s), ties the kernel at 256 rows (310 vs 311) and wins from 512 (574 vs 635):
  so the kernel for 1-256 rows, oneDNN beyond (`ONEDNN_FROM`).
Outside the kernel's range, up to `PACKED_MAX_ROWS` rows, torch's MKL build with the weight pre-packed for its
packed sgemm runs these products ~1.4x faster than `F.linear`; for many rows (prefill) plain `F.linear`
is faster, or oneDNN where `ONEDNN_FROM` says so. Elsewhere (CUDA, no MKL) this is plain `F.linear`. Which
path each call took is counted in `kernels.paths_used()["gemm"]`. The rules are keyed by `kernels.host_kind()`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.model import kernels

# Row counts the compiled GEMM serves, per instruction set (inclusive); other counts go to MKL.
KERNEL_ROWS = {"avx512": (2, 32), "avx2": (1, 256), "avx512_amd": (1, 256)}
# Row counts from which fp32 products past the kernel's range run oneDNN's fp32 matmul on the plain weight
# (`torch.ops.mkldnn._linear_pointwise`; no packed copy: 2-6% slower than oneDNN's reordered weight, 538 MB less)
# instead of `F.linear` (MKL), per host kind; measured in the module docstring (`bench_gemm.py`).
ONEDNN_FROM = {"avx512_amd": 257}
PACKED_MAX_ROWS = 256
# MKL packs differently for different batch hints (the buffer size does not change, the speed does).
# Measured with the default model's weights on 2 Zen-3 cores, hint 64 is as fast as or faster than
# hint 1 or 16 for every row count from 1 to 256 (1.6x F.linear at 16 rows, 1.5x at 64).
PACK_HINT_ROWS = 64


def mkl_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = False,
                 arena=None, panels: torch.Tensor | None = None) -> None:
        """pack: prepare the CPU fp32 paths (MKL's packed weight, the GEMM kernel's panels, in `arena`
        when given: a `hugepages.Arena`). `panels`: the kernel's panels of `weight` already packed (read from the
        prepared-weights cache, `pdserve.model.weight_cache`): copied into `arena` instead of packed."""
        self.weight = weight.contiguous()  # [out, in]
        self.bias = bias
        if not pack:
            self.panels = None
        else:
            self.panels = kernels.pack_weight(self.weight, arena) if panels is None else \
                _packed(panels, self.weight.shape, arena)
        self.isa = kernels.isa() if self.panels is not None else "none"
        kind = kernels.host_kind() if self.panels is not None else "none"
        self.kernel_rows = KERNEL_ROWS.get(kind, (1, 0))
        if self.panels is not None:
            kernels.decide(f"GEMM: the {self.isa} kernel for {self.kernel_rows[0]}-{self.kernel_rows[1]} rows, "
                           f"{'oneDNN' if kind in ONEDNN_FROM else 'MKL'} beyond (the rule measured for {kind})")
        # MKL's packed copy only where the kernel leaves row counts to it
        mkl_rows = pack and not (self.kernel_rows[0] <= 1 and self.kernel_rows[1] >= PACKED_MAX_ROWS)
        self.packed = (torch.ops.mkl._mkl_reorder_linear_weight(self.weight, PACK_HINT_ROWS) if mkl_rows
                       else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        lo, hi = self.kernel_rows
        if self.panels is not None and lo <= rows <= hi and kernels.usable(x):
            kernels.used("gemm", self.isa)
            y = kernels.gemm(x, self.panels)
            return y if self.bias is None else y.add_(self.bias)
        if self.packed is not None and 0 < rows <= PACKED_MAX_ROWS:
            kernels.used("gemm", "mkl_packed")
            # The last argument must equal the row count, or MKL falls back to the unpacked weight.
            return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, rows)
        return large(x, self.weight, self.bias)


def large(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, path: str = "") -> torch.Tensor:
    """x @ weight^T (+ bias) in fp32 for row counts past the kernels' (prefill): oneDNN where `ONEDNN_FROM` says
    it is faster on this kind of CPU, else `F.linear`. Counted as "onednn" / "torch_linear", or as `path` when
    given (quantized weights' fp32 path, `quant.QuantLinear`, counts its own name)."""
    onednn = x.shape[0] >= ONEDNN_FROM.get(_host_kind(x), 1 << 62) and x.dim() == 2 and weight.dtype == x.dtype
    kernels.used("gemm", path or ("onednn" if onednn else "torch_linear"))
    if onednn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _host_kind(x: torch.Tensor) -> str:
    return kernels.host_kind() if x.is_cpu and x.dtype == torch.float32 and torch.backends.mkldnn.is_available() \
        else "none"


def _packed(panels: torch.Tensor, shape: torch.Size, arena) -> kernels.PackedWeight:
    """The `kernels.PackedWeight` of a [N, K] weight whose panels were packed before (its fields, without
    packing again), in `arena` where given, as packing places them."""
    packed = kernels.PackedWeight.__new__(kernels.PackedWeight)
    packed.n, packed.k = shape
    held = arena.take(panels.numel()) if arena is not None else torch.empty(panels.numel())
    packed.panels = held.copy_(panels)
    return packed
