"""`pdserve.engine.heap`: prefill-sized activations come from the heap (reused when freed), not from mmap."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys, torch
from pdserve.engine import heap
applied = heap.keep_freed_memory() if sys.argv[1] == "on" else None
x = torch.empty(5 << 20)  # 20 MB, as a 2048-token step's gate|up output
heap_ranges = [tuple(int(a, 16) for a in line.split()[0].split("-"))
               for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]")]
print(applied, any(lo <= x.data_ptr() < hi for lo, hi in heap_ranges))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc and /proc/self/maps")
def test_prefill_sized_blocks_come_from_the_heap():
    """In a fresh process glibc maps a 20 MB block with mmap (and unmaps it when freed: the next one faults every
    page in again); with `keep_freed_memory` it is carved from the heap, where a freed block is reused."""
    def run(mode: str) -> str:
        return subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True,
                              timeout=120).stdout.strip()

    assert run("off") == "None False"
    assert run("on") == "True True"
