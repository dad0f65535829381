"""`MetaColumns`: the compiled row copy and fill (`copy_rows`, `fill_rows` in native/columns.h) leave every
column exactly as the numpy path does; and they refuse what they cannot do safely."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.core.kvstore import native
from pdserve.core.kvstore.kv_columns import _FIELDS, MetaColumns
from pdserve.core.kvstore.kv_meta import Tier

N = 32


def _random(cols: MetaColumns, rng) -> None:
    for name, (dtype, _) in _FIELDS.items():
        col = getattr(cols, name)
        if dtype is np.float64:
            col[:] = rng.choice([-math.inf, -1.0, 0.0, 2.5, math.nan, 1e9], N)
        elif dtype is np.bool_:
            col[:] = rng.random(N) < 0.5
        else:
            col[:] = rng.integers(0, 100, N).astype(dtype)


def _pair(seed: int) -> tuple[MetaColumns, MetaColumns, MetaColumns]:
    rng = np.random.default_rng(seed)
    src, fast, slow = MetaColumns(N, Tier.DEVICE), MetaColumns(N, Tier.HOST), MetaColumns(N, Tier.HOST)
    _random(src, rng)
    _random(fast, np.random.default_rng(seed + 1))
    _random(slow, np.random.default_rng(seed + 1))
    slow._rows = None  # the numpy path
    return src, fast, slow


def _same(a: MetaColumns, b: MetaColumns) -> None:
    for name in _FIELDS:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**16), k=st.integers(2, N), now=st.floats(-5.0, 5.0), use_count=st.integers(0, 3),
       ready=st.booleans())
def test_compiled_rows_equal_the_numpy_path(seed, k, now, use_count, ready):
    assert native.load() is not None, "the compiled module did not build here"
    src, fast, slow = _pair(seed)
    rng = np.random.default_rng(seed + 2)
    slots, src_slots = rng.permutation(N)[:k].astype(np.int64), rng.integers(0, N, k).astype(np.int64)
    for cols in (fast, slow):
        cols.copy_from(src, src_slots, slots)
    _same(fast, slow)
    fresh = rng.permutation(N)[:k].astype(np.int64)
    hashes = rng.integers(0, 2**63, k).astype(np.uint64)
    for cols in (fast, slow):
        cols.fresh(fresh, hashes, now, use_count, ready)
    _same(fast, slow)


def test_bad_rows_are_refused_not_written():
    kv = native.load()
    a, b = np.zeros(4), np.zeros(4, np.int16)
    with pytest.raises(IndexError):
        kv.copy_rows((a,), (np.ones(4),), np.array([4], np.int64), np.array([0], np.int64))
    with pytest.raises(TypeError):
        kv.copy_rows((a,), (b,), np.array([0], np.int64), np.array([0], np.int64))  # a float from an int16
    with pytest.raises(ValueError):
        kv.fill_rows((a, b), (1.0,), np.array([0], np.int64))
    assert not a.any() and not b.any()
