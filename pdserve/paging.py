"""Make a mapped region resident: page tables filled with madvise(MADV_POPULATE_READ / _WRITE) through ctypes,
which lets go of the GIL for the call. Mapping with MAP_POPULATE instead holds the GIL inside `mmap.mmap` for
as long as the kernel takes (seconds for GBs), and with it every other thread of the process: a worker's
heartbeat thread among them (`pdserve.server.supervisor` then takes the worker for hung). And populating takes
the process's mmap lock for reading for the whole range: any mmap in the process meanwhile (a new Python arena,
a tensor allocated) waits for it, GIL held. Hence in CHUNK pieces: such a wait lasts one piece."""

from __future__ import annotations

import ctypes
import mmap
import threading

import numpy as np

MADV_POPULATE_READ = 22  # Linux 5.14+
MADV_POPULATE_WRITE = 23
CHUNK = 32 << 20  # bytes populated per call (tens of ms)


def populate(buf: mmap.mmap, write: bool) -> bool:
    """Fill the page tables of the whole of `buf` (contents untouched). False where the kernel cannot
    (before Linux 5.14; pages then fault in on first use) or the mapping went meanwhile."""
    view = np.frombuffer(buf, dtype=np.uint8)  # (read-only mappings too)
    addr, size = view.__array_interface__["data"][0], view.nbytes
    del view  # no export held on `buf` while the kernel works: it may be closed meanwhile
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
    for start in range(0, size, CHUNK):
        if libc.madvise(addr + start, min(CHUNK, size - start), advice) != 0:
            return False
    return True


class Populating:
    """`populate` in a daemon thread; `failed` once it is done and the kernel could not."""

    def __init__(self, buf: mmap.mmap, write: bool, name: str) -> None:
        self.failed = False
        self.thread = threading.Thread(target=self._run, args=(buf, write), name=name, daemon=True)
        self.thread.start()

    def _run(self, buf: mmap.mmap, write: bool) -> None:
        self.failed = not populate(buf, write)
