"""The worker's KV block pool on its compute device: the tensors the block manager's ids index."""

from __future__ import annotations

import math
import mmap
import os

import torch

from pdserve.kv.codec import KVCodec
from pdserve.model.config import ModelConfig
from pdserve.model.hugepages import lazy_zeros
from pdserve.paging import Populating


def blocks_for_budget(config: ModelConfig, block_size: int, budget_bytes: int, codec: KVCodec) -> int:
    """How many blocks of `block_size` tokens fit in `budget_bytes` for this model in `codec`."""
    per_block = codec.kv_bytes_per_token(config) * block_size
    return max(budget_bytes // per_block, 1)


class DeviceKVPool:
    """One tensor per layer, `[2 (k|v), num_kv_heads, num_blocks, block_size, head_dim]` in the model dtype, or
    `[..., block_size, token_bytes]` uint8 token records of a coded KV (`pdserve.kv.codec`).

    Slot s = block_id * block_size + offset. Memory is allocated with `torch.zeros` so on CPU
    untouched pages cost nothing until used.

    `shared=True` (CPU only) puts every layer in one anonymous shared-memory file (memfd; zero pages until
    touched, like `torch.zeros`), so a decode worker on the same host can read delivered blocks straight
    from it: `handle` is the path another process of the same user opens. The memory goes when the last
    process mapping it does; nothing is left in /dev/shm by a crash.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, codec: KVCodec,
                 device: torch.device, shared: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        dtype = codec.storage
        shape = (2, config.num_kv_heads, num_blocks, block_size, codec.width)
        self.handle: str | None = None
        self.prefault: Populating | None = None
        self.shared_buffer: mmap.mmap | None = None
        if shared and torch.device(device).type == "cpu":
            self.layers = self._shared_layers(shape, dtype, config.num_layers)
        elif torch.device(device).type == "cpu":  # mapped as blocks are first written (normal pages: see
            numel = math.prod(shape)               # `pdserve.model.hugepages`)
            self.layers = [lazy_zeros(numel, dtype).view(shape) for _ in range(config.num_layers)]
        else:
            self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]

    def _shared_layers(self, shape: tuple, dtype: torch.dtype, num_layers: int) -> list[torch.Tensor]:
        count = 1
        for n in shape:
            count *= n
        per_layer = -(-count * torch.empty((), dtype=dtype).element_size() // mmap.PAGESIZE) * mmap.PAGESIZE
        fd = os.memfd_create("pdserve-kv")
        os.ftruncate(fd, per_layer * num_layers)
        # Populated (the pool resident, as GPU pools are: pages first touched while serving would fault in this
        # process and in every reader mapping them, on the hot path), but in the background: populating
        # 2 GB takes seconds, and the worker is ready to serve meanwhile.
        self.shared_buffer = mmap.mmap(fd, per_layer * num_layers, flags=mmap.MAP_SHARED)
        self.prefault = Populating(self.shared_buffer, write=True, name="kv-pool-populate")
        self.handle = f"/proc/{os.getpid()}/fd/{fd}"  # the fd stays open: it is how readers find the pool
        return [torch.frombuffer(self.shared_buffer, dtype=dtype, count=count, offset=i * per_layer).view(shape)
                for i in range(num_layers)]

    @property
    def prefault_failed(self) -> bool:
        """The pool's pages could not be populated ahead (before Linux 5.14): they fault in on first use."""
        return self.prefault is not None and self.prefault.failed

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)
