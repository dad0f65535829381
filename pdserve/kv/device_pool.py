"""The worker's KV block pool on its compute device: the tensors the block manager's ids index."""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading

import torch

from pdserve.model.config import ModelConfig
from pdserve.model.hugepages import huge_zeros

MADV_POPULATE_WRITE = 23  # Linux 5.14+


def blocks_for_budget(config: ModelConfig, block_size: int, budget_bytes: int, dtype: torch.dtype) -> int:
    """How many blocks of `block_size` tokens fit in `budget_bytes` for this model."""
    per_block = config.kv_bytes_per_token(torch.finfo(dtype).bits // 8) * block_size
    return max(budget_bytes // per_block, 1)


class DeviceKVPool:
    """One tensor per layer, `[2 (k|v), num_kv_heads, num_blocks, block_size, head_dim]`.

    Slot s = block_id * block_size + offset. Memory is allocated with `torch.zeros` so on CPU
    untouched pages cost nothing until used.

    `shared=True` (CPU only) puts every layer in one anonymous shared-memory file (memfd; zero pages until
    touched, like `torch.zeros`), so a decode worker on the same host can read delivered blocks straight
    from it: `handle` is the path another process of the same user opens. The memory goes when the last
    process mapping it does; nothing is left in /dev/shm by a crash.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, shared: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (2, config.num_kv_heads, num_blocks, block_size, config.head_dim)
        self.handle: str | None = None
        self.prefault_failed = False
        self.shared_buffer: mmap.mmap | None = None
        if shared and torch.device(device).type == "cpu":
            self.layers = self._shared_layers(shape, dtype, config.num_layers)
        elif torch.device(device).type == "cpu":  # decode attention reads blocks scattered: huge pages
            numel = math.prod(shape)
            self.layers = [huge_zeros(numel, dtype).view(shape) for _ in range(config.num_layers)]
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
        self.prefault = threading.Thread(target=self._populate, name="kv-pool-populate", daemon=True)
        self.prefault.start()
        self.handle = f"/proc/{os.getpid()}/fd/{fd}"  # the fd stays open: it is how readers find the pool
        return [torch.frombuffer(self.shared_buffer, dtype=dtype, count=count, offset=i * per_layer).view(shape)
                for i in range(num_layers)]

    def _populate(self) -> None:
        """madvise(MADV_POPULATE_WRITE): page tables filled, contents untouched (blocks may already be in use);
        ctypes lets go of the GIL meanwhile. Before Linux 5.14 pages fault in on first use (`prefault_failed`,
        counted as a fallback)."""
        buf = self.shared_buffer
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        self.prefault_failed = libc.madvise(addr, len(buf), MADV_POPULATE_WRITE) != 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)
