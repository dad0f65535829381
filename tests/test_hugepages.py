"""Huge-page buffers for the packed weights (zeroed, aligned, disjoint, alive); the CPU KV pool on lazily
mapped normal pages."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os

import torch

from pdserve.model.hugepages import HUGE_PAGE, Arena, huge_zeros


def test_huge_zeros_is_zeroed_aligned_and_writable():
    t = huge_zeros(3 * HUGE_PAGE // 4 + 5)
    assert t.numel() == 3 * HUGE_PAGE // 4 + 5 and t.dtype == torch.float32
    assert (t == 0).all()
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(1.5)
    view = t[10:20]
    del t
    gc.collect()
    assert (view == 1.5).all()  # a view keeps the mapping alive


def test_arena_pieces_are_aligned_disjoint_and_outlive_the_arena():
    arena = Arena(chunk_bytes=4 * HUGE_PAGE)
    sizes = [100, 1, 17, HUGE_PAGE // 4, 3 * HUGE_PAGE // 4, 5 * HUGE_PAGE // 4]  # the last: its own chunk
    pieces = [arena.take(n) for n in sizes]
    for i, (p, n) in enumerate(zip(pieces, sizes)):
        assert p.numel() == n and (p == 0).all() and p.data_ptr() % 64 == 0
        p.fill_(i)
    del arena
    gc.collect()
    for i, p in enumerate(pieces):
        assert (p == i).all()  # no piece overwrote another, and the chunks live on with their pieces


def _resident_kib(ptr: int, nbytes: int) -> int:
    """Resident KiB of the pages holding [ptr, ptr + nbytes), by mincore: this range alone (a mapping's Rss in
    /proc/self/smaps also counts whatever anonymous memory the kernel merged into the same mapping)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = ptr - ptr % page
    pages = -(-(ptr + nbytes - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) * page // 1024


def test_cpu_kv_pool_is_lazily_mapped_on_normal_pages():
    """The KV pool is touched block by block while serving: its pages are mapped as first written (nothing
    resident up front), and on normal pages, whose first touch is cheap (see `pdserve.model.hugepages`)."""
    from pdserve.kv.codec import KVCodec
    from pdserve.kv.device_pool import DeviceKVPool
    from pdserve.model.config import ModelConfig
    cfg = ModelConfig(family="llama", vocab_size=10, hidden_size=64, intermediate_size=8, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                      tie_word_embeddings=True)
    pool = DeviceKVPool(cfg, num_blocks=4096, block_size=16,
                        codec=KVCodec("auto", 16, torch.float32), device=torch.device("cpu"))
    layer = pool.layers[0]
    assert layer.nbytes == 2 * 2 * 4096 * 16 * 16 * 4 and _resident_kib(layer.data_ptr(), layer.nbytes) == 0
    layer[0, 0, 7].fill_(1.0)  # one block of one head: 1 KiB
    assert _resident_kib(layer.data_ptr(), layer.nbytes) <= 8  # a 4 KiB page (a huge page would make it 2,048 KiB)
    assert (pool.layers[1] == 0).all()
