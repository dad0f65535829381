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
Outside that range, up to `PACKED_MAX_ROWS` rows, torch's MKL build with the weight pre-packed for its
packed sgemm runs these products ~1.4x faster than `F.linear`; for many rows (prefill) plain `F.linear`
is faster. Elsewhere (CUDA, no MKL) this is plain `F.linear`. Which path each call took is counted in
`kernels.paths_used()["gemm"]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.model import kernels

# Row counts the compiled GEMM serves, per instruction set (inclusive); other counts go to MKL.
KERNEL_ROWS = {"avx512": (2, 32), "avx2": (1, 256)}
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
        self.kernel_rows = KERNEL_ROWS.get(self.isa, (1, 0))
        if self.panels is not None:
            kernels.decide(f"GEMM: the {self.isa} kernel for {self.kernel_rows[0]}-{self.kernel_rows[1]} rows, "
                           f"MKL beyond (the rule measured for this instruction set)")
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
        kernels.used("gemm", "torch_linear")
        return F.linear(x, self.weight, self.bias)


def _packed(panels: torch.Tensor, shape: torch.Size, arena) -> kernels.PackedWeight:
    """The `kernels.PackedWeight` of a [N, K] weight whose panels were packed before (its fields, without
    packing again), in `arena` where given, as packing places them."""
    packed = kernels.PackedWeight.__new__(kernels.PackedWeight)
    packed.n, packed.k = shape
    held = arena.take(panels.numel()) if arena is not None else torch.empty(panels.numel())
    packed.panels = held.copy_(panels)
    return packed
