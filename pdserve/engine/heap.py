"""Keep freed activation memory in the process's heap instead of handing it back to the OS (glibc malloc).

A CPU prefill step allocates and frees megabytes per layer (a 2048-token step's gate|up output is 25 MB, its
SiLU x up 12.6 MB). glibc serves such sizes with mmap (from 128 KiB; raised after frees, up to 32 MiB) and
returns them with munmap, and trims the heap's top past twice that threshold: the next layer's tensors then
fault every page in again, each zeroed by the kernel. Fixing the mmap threshold at its 64-bit maximum and the
trim threshold at `TRIM_THRESHOLD` lets freed blocks be reused as they are; the process keeps up to its peak
working set of activations (what a caching allocator, or vLLM-CPU's recommended tcmalloc, does too).
Measured (`benchmarks/bench_heap.py --processes 3 --bursts 5`: AMD EPYC Zen 4 VM, 2 threads, fp32, bursts of
16 x 128-token prompts in one prefill step, processes alternating, quiet, 2026-12-07 21:13): minor page faults per
5 bursts 423-466 k without, 245-247 k with; the burst itself 2,544 vs 2,521 ms, within the noise (an earlier
scratch run of the same A/B: 2,571 vs 2,503). The faults left are mostly the KV pool's first touch
(`hugepages.lazy_zeros`: once per block, until the pool has been used once).
Applied once per process by the CPU model executor; a C library without `mallopt` (not glibc) leaves malloc as
it is: a decision, logged.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit: bigger blocks (KV pools) keep their own mmap
TRIM_THRESHOLD = 1 << 30  # free memory above this at the heap's top goes back to the OS

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Sets malloc's thresholds (once per process); True where they are set."""
    global _applied
    if _applied is None:
        try:  # the C library the process already runs on (its own symbols): glibc's mallopt, where it has one
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            mallopt = None
        _applied = mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
            bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        log.info("pdserve: malloc %s", f"keeps freed blocks (mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim "
                 f"threshold {TRIM_THRESHOLD >> 20} MiB)" if _applied else "left as it is (no glibc mallopt)")
    return _applied
