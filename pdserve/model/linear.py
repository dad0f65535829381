"""y = x @ W^T with the fastest kernel this machine has for the row count at hand.

Decode steps multiply few rows (one per running request) by large weights, so they stream every weight
once per step. On AVX-512 CPUs in fp32 the compiled skinny GEMM (`pdserve.model.kernels`, weights packed
in column panels, software prefetch) does this fastest from 2 to `KERNEL_MAX_ROWS` rows (measured on the
default model's 120 per-layer products, cold, 2 threads: 28 vs 35 ms at 16 rows, 42 vs 42 at 32, 21 vs 20
at 1 row, slower from ~48 rows). Up to
`PACKED_MAX_ROWS` rows torch's MKL build, with the weight pre-packed for its packed sgemm, runs these
products ~1.4x faster than `F.linear`; for many rows (prefill) the packed path is slower. Elsewhere (CUDA,
no MKL) this is plain `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.model import kernels

KERNEL_MAX_ROWS = 32
PACKED_MAX_ROWS = 256
# MKL packs differently for different batch hints (the buffer size does not change, the speed does).
# Measured with the default model's weights on 2 Zen-3 cores, hint 64 is as fast as or faster than
# hint 1 or 16 for every row count from 1 to 256 (1.6x F.linear at 16 rows, 1.5x at 64).
PACK_HINT_ROWS = 64


def mkl_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = False) -> None:
        self.weight = weight.contiguous()  # [out, in]
        self.bias = bias
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, PACK_HINT_ROWS) if pack else None
        self.panels = kernels.pack_weight(self.weight) if pack else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.panels is not None and 1 < rows <= KERNEL_MAX_ROWS and kernels.usable(x):
            y = kernels.gemm(x, self.panels)
            return y if self.bias is None else y.add_(self.bias)
        if self.packed is not None and 0 < rows <= PACKED_MAX_ROWS:
            # The last argument must equal the row count, or MKL falls back to the unpacked weight.
            return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, rows)
        return F.linear(x, self.weight, self.bias)
