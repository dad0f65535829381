"""y = x @ W^T with the fastest kernel this machine has for the row count at hand.

Decode steps multiply few rows (one per running request) by large weights. On x86 CPUs torch's MKL
build can pre-pack a weight for its packed sgemm, which runs these skinny products ~1.4x faster than
`F.linear`; for many rows (prefill) the packed path is slower, so
it is used only up to `PACKED_MAX_ROWS` rows. Elsewhere (CUDA, no MKL) this is plain `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.packed is not None and 0 < rows <= PACKED_MAX_ROWS:
            # The last argument must equal the row count, or MKL falls back to the unpacked weight.
            return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, rows)
        return F.linear(x, self.weight, self.bias)
