"""`pdserve.paging`: populating a mapping leaves its contents alone, works on read-only mappings (a decode
worker's view of a prefill worker's pool) and in a background thread."""

from __future__ import annotations

import mmap
import os

import pytest

from pdserve.paging import CHUNK, Populating, populate

SIZE = 3 * CHUNK + 4096  # pieces: three whole, one partial


def _resident(buf: mmap.mmap) -> int:
    """Pages of `buf` in this process's page tables (mincore would say in memory; /proc says mapped)."""
    start = int(next(line for line in open(f"/proc/{os.getpid()}/maps")
                     if "pdserve-paging-test" in line).split("-")[0], 16)
    with open(f"/proc/{os.getpid()}/smaps") as f:
        lines = f.read().split("\n")
    at = next(i for i, line in enumerate(lines) if line.startswith(f"{start:x}-"))
    return next(int(line.split()[1]) for line in lines[at:] if line.startswith("Rss:")) * 1024 // mmap.PAGESIZE


@pytest.fixture
def memfd():
    fd = os.memfd_create("pdserve-paging-test")
    os.ftruncate(fd, SIZE)
    yield fd
    os.close(fd)


def test_populate_fills_the_page_tables_and_keeps_the_contents(memfd):
    writer = mmap.mmap(memfd, SIZE, flags=mmap.MAP_SHARED)
    writer[5:10] = b"hello"
    writer[SIZE - 3:] = b"end"
    assert populate(writer, write=True)
    assert _resident(writer) == SIZE // mmap.PAGESIZE
    assert writer[5:10] == b"hello" and writer[SIZE - 3:] == b"end"
    reader = mmap.mmap(memfd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    assert populate(reader, write=False)  # a read-only mapping: its address found without a writable export
    assert reader[5:10] == b"hello"
    reader.close()  # nothing holds an export on it afterwards
    writer.close()


def test_populating_in_the_background(memfd):
    buf = mmap.mmap(memfd, SIZE, flags=mmap.MAP_SHARED)
    job = Populating(buf, write=True, name="test-populate")
    assert job.thread.daemon  # (a worker's exit does not wait for it)
    while job.thread.is_alive():  # this thread has the GIL meanwhile, and maps memory too
        scratch = mmap.mmap(-1, 1 << 20)
        scratch.close()
    job.thread.join()
    assert not job.failed
    assert _resident(buf) == SIZE // mmap.PAGESIZE
    buf.close()

