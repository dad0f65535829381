"""CPU tensors on transparent huge pages, for memory that a decode step streams end to end (the weights).

A batch-16 decode step reads every packed weight panel (hundreds of MB) and, scattered by block, the KV
of every running request. With 4 KiB pages that is a TLB miss every 4 KiB, and the hardware prefetchers
stop at each page boundary; with 2 MiB pages neither happens. torch's allocator asks for huge pages only
when `THP_MEM_ALLOC_ENABLE=1` is set, so these buffers are mapped here: an anonymous private mapping,
aligned to 2 MiB, with `madvise(MADV_HUGEPAGE)` (honoured when
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`). Where the platform has no
MADV_HUGEPAGE this is a plain `torch.zeros` (a decision for the platform, logged once at INFO).

The CPU KV pool and host tier are lazily mapped on normal pages (`lazy_zeros`): they are touched block by
block while serving, and a huge page's first touch can be far dearer than 512 small ones (measured on an AMD
EPYC VM: 4.6 s of system time per GiB against 0.37 s, and a 16-request long-prompt run 30% slower with the
pool on huge pages, docs/benchmarks.md "Engine throughput"); the weights are touched once, at load.
"""

from __future__ import annotations

import logging
import mmap

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ARENA_CHUNK = 64 << 20  # bytes per arena chunk: few chunks, and little left unused at a chunk's end
_logged = False


def lazy_zeros(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zeroed 1-D CPU tensor of `numel` elements on normal pages, mapped as first touched (an anonymous
    mapping: untouched parts cost no memory, where `torch.zeros` writes every page)."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < mmap.PAGESIZE:
        return torch.zeros(numel, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype)  # (holds `buf`: unmapped with the tensor)


def huge_zeros(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zeroed 1-D CPU tensor of `numel` elements, on huge pages where the platform has them."""
    global _logged
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes < HUGE_PAGE:
        if not _logged and nbytes >= HUGE_PAGE:
            _logged = True
            log.info("no MADV_HUGEPAGE on this platform: large buffers stay on normal pages")
        return torch.zeros(numel, dtype=dtype)
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(buf, dtype=torch.uint8)  # holds a reference to `buf`: unmapped with the tensor
    offset = -base.data_ptr() % HUGE_PAGE
    return base[offset:offset + nbytes].view(dtype)


class Arena:
    """Hands out consecutive float32 pieces of huge-page chunks, so a model's packed weights lie in the
    order they are read. A piece never straddles two chunks; one larger than a chunk gets its own."""

    def __init__(self, chunk_bytes: int = ARENA_CHUNK) -> None:
        self.chunk_numel = chunk_bytes // 4
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def take(self, numel: int) -> torch.Tensor:
        """A zeroed float32 tensor of `numel` elements, 64-byte aligned, owned by the arena's chunk."""
        numel_aligned = -(-numel // 16) * 16
        if self._chunk is None or self._used + numel_aligned > self._chunk.numel():
            if numel_aligned > self.chunk_numel:
                return huge_zeros(numel)
            self._chunk, self._used = huge_zeros(self.chunk_numel), 0
        piece = self._chunk[self._used:self._used + numel]
        self._used += numel_aligned
        return piece
