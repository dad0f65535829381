"""Chained block hashes: the compiled chain (`hash_chain.h`, the xxhash package's own xxh3) gives exactly the
hashes of the Python loop and of `hash_block` one block at a time, for any tokens, block size (short blocks and
ones past xxh3's 240-byte mid-size path), parent and salt; and without the compiled module the loop is used and
counted."""

from __future__ import annotations

from array import array

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.core.kvstore import block_hash, native
from pdserve.core.kvstore.block_hash import hash_block, hash_blocks


def _one_by_one(tokens, bs, parent, start, salt):
    """Blocks `start` on, the first chained from `parent` (the hash of the block before it)."""
    out, h = [], parent
    for k in range(start, len(tokens) // bs):
        h = hash_block(h, tokens[k * bs:(k + 1) * bs], salt)
        out.append(h)
    return out


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**62), max_size=400), bs=st.sampled_from([1, 3, 16, 17, 31, 64]),
       parent=st.none() | st.integers(0, 2**64 - 1), start=st.integers(0, 6), salt=st.sampled_from([b"", b"m1"]))
def test_the_compiled_chain_equals_hashing_block_by_block(tokens, bs, parent, start, salt):
    assert block_hash._compiled_chain() is not None, "the compiled chain did not load here"
    want = _one_by_one(tokens, bs, parent, start, salt)
    for form in (tokens, array("q", tokens), np.array(tokens, np.int64)):
        assert hash_blocks(form, bs, parent, start, salt) == want


def test_without_the_compiled_module_the_python_loop_is_used_and_counted(monkeypatch):
    tokens = list(range(16 * 20))
    want = hash_blocks(tokens, 16)
    monkeypatch.setenv("PDSERVE_NATIVE", "0")
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_reason", None)
    monkeypatch.setattr(block_hash, "_chain", None)
    before = native.fallback_count()
    assert hash_blocks(tokens, 16) == want
    assert block_hash._chain is False and native.fallback_count() == before + 1
