"""The worker's KV block pool on its compute device: the tensors the block manager's ids index."""

from __future__ import annotations

import torch

from pdserve.model.config import ModelConfig


def blocks_for_budget(config: ModelConfig, block_size: int, budget_bytes: int, dtype: torch.dtype) -> int:
    """How many blocks of `block_size` tokens fit in `budget_bytes` for this model."""
    per_block = config.kv_bytes_per_token(torch.finfo(dtype).bits // 8) * block_size
    return max(budget_bytes // per_block, 1)


class DeviceKVPool:
    """One tensor per layer, `[2 (k|v), num_kv_heads, num_blocks, block_size, head_dim]`.

    Slot s = block_id * block_size + offset. Memory is allocated with `torch.zeros` so on CPU
    untouched pages cost nothing until used.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (2, config.num_kv_heads, num_blocks, block_size, config.head_dim)
        self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)
