"""y = x @ W^T with the fastest kernel this machine has for the row count at hand.

Decode steps multiply few rows (one per running request) by large weights. On x86 CPUs torch's MKL
build can pre-pack a weight for its packed sgemm, which runs these skinny products ~1.4x faster than
`F.linear` (benchmarks/bench_linear.py); for many rows (prefill) the packed path is slower, so
it is used only up to `PACKED_MAX_ROWS` rows. Elsewhere (CUDA, no MKL) this is plain `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACKED_MAX_ROWS = 256


def mkl_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = False) -> None:
        self.weight = weight.contiguous()  # [out, in]
        self.bias = bias
        # MKL's packed layout is the same whatever the batch hint; the hint only has to be positive.
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, 1) if pack else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.packed is not None and 0 < rows <= PACKED_MAX_ROWS:
            # The last argument must equal the row count, or MKL falls back to the unpacked weight.
            return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, rows)
        return F.linear(x, self.weight, self.bias)
