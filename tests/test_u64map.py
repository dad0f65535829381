"""`U64Map` (compiled) and `DictMap` (its counted fallback) hold one contract: a dict from 64-bit keys to
ints >= 0, with bulk calls over arrays. Random operation sequences are checked against a plain dict."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.core.kvstore import native
from pdserve.core.kvstore.u64map import MISSING, DictMap, new_map


def _compiled():
    m = new_map()
    assert not isinstance(m, DictMap), f"the compiled map did not build here: {native.fallback_reason()}"
    return m


MAKERS = {"compiled": _compiled, "dict": DictMap}
# few distinct keys (so operations collide), at both ends of the 64-bit range
KEYS = st.sampled_from([0, 1, 2, 3, 17, 2**63 - 1, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15, 12345678901234567])
VALS = st.integers(0, 2**40)
OPS = st.one_of(
    st.tuples(st.just("set"), KEYS, VALS), st.tuples(st.just("pop"), KEYS),
    st.tuples(st.just("put_many"), st.lists(st.tuples(KEYS, VALS), max_size=6)),
    st.tuples(st.just("put_new"), st.lists(st.tuples(KEYS, VALS), max_size=6)),
    st.tuples(st.just("del_many"), st.lists(KEYS, max_size=6)),
    st.tuples(st.just("del_if"), st.lists(st.tuples(KEYS, VALS), max_size=6)),
    st.tuples(st.just("clear")))


def _apply(m, model: dict, op) -> None:
    kind = op[0]
    if kind == "set":
        m[op[1]] = op[2]
        model[op[1]] = op[2]
    elif kind == "pop":
        assert m.pop(op[1], None) == model.pop(op[1], None)
    elif kind in ("put_many", "put_new"):
        keys = np.array([k for k, _ in op[1]], np.uint64)
        vals = np.array([v for _, v in op[1]], np.int64)
        if kind == "put_many":
            new = len({k for k, _ in op[1]} - model.keys())
            assert m.put_many(keys, vals) == new
            model.update(op[1])
        else:
            expected = []
            for k, v in op[1]:
                expected.append(k not in model)
                model.setdefault(k, v)
            assert m.put_new(keys, vals).tolist() == expected
    elif kind == "del_many":
        expected = [model.pop(k, MISSING) for k in op[1]]
        assert m.del_many(np.array(op[1], np.uint64)).tolist() == expected
    elif kind == "del_if":
        expected = []
        for k, v in op[1]:
            hit = model.get(k) == v
            expected.append(model.pop(k) if hit else MISSING)
        got = m.del_many([k for k, _ in op[1]], only_if=[v for _, v in op[1]])
        assert got.tolist() == expected
    else:
        m.clear()
        model.clear()


@pytest.mark.parametrize("kind", MAKERS)
@settings(max_examples=150, deadline=None)
@given(ops=st.lists(OPS, max_size=40), probe=st.lists(KEYS, max_size=8))
def test_random_operations_agree_with_a_dict(kind, ops, probe):
    m, model = MAKERS[kind](), {}
    for op in ops:
        _apply(m, model, op)
        assert len(m) == len(model)
    for k in probe:
        assert (k in m) == (k in model)
        assert m.get(k) == model.get(k)
        assert m.get(k, "none") == model.get(k, "none")
    assert m.get_many(np.array(probe, np.uint64)).tolist() == [model.get(k, MISSING) for k in probe]
    expected_prefix = next((i for i, k in enumerate(probe) if k not in model), len(probe))
    assert m.prefix_len(probe) == expected_prefix
    keys, vals = m.items()
    assert dict(zip(keys.tolist(), vals.tolist())) == model


@pytest.mark.parametrize("kind", MAKERS)
def test_growth_churn_and_bad_input(kind):
    m = MAKERS[kind]()
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**63, 50_000, dtype=np.int64).astype(np.uint64) * np.uint64(2)
    m.put_many(keys, np.arange(len(keys)))
    for _ in range(5):  # drop and re-add: tombstones must not fill the table
        m.del_many(keys[:40_000])
        assert len(m) == 10_000
        m.put_many(keys[:40_000], np.arange(40_000))
    assert (m.get_many(keys) == np.r_[np.arange(40_000), np.arange(40_000, 50_000)]).all()
    with pytest.raises(KeyError):
        m[1]  # odd: never inserted
    with pytest.raises(ValueError):
        m[5] = -1
    with pytest.raises(ValueError):
        m.put_many([1, 2], [3])
    with pytest.raises(ValueError):
        m.put_new([1], [-4])
    assert m.get(np.uint64(keys[3])) == 3  # numpy integers are keys too
    assert "x" not in m and -1 not in m and m.get("x") is None and m.pop(-1, "d") == "d"
    with pytest.raises(OverflowError):
        m[-3] = 1
    assert (m.get_many(keys[::2][:4]) == np.arange(0, 8, 2)).all()  # strided arrays are taken


def test_without_the_compiled_module_the_fallbacks_are_taken_and_counted():
    code = ("from pdserve.core.kvstore import native; from pdserve.core.kvstore.block_manager import KVBlockManager;"
            "bm = KVBlockManager(8, 4, clock=lambda: 0.0); print(type(bm._cached).__name__, type(bm._free).__name__,"
            " native.fallback_count(), native.fallback_reason())")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PDSERVE_NATIVE="0"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # three structures made in Python: the hash map, the free queue, the metadata columns' row copies
    assert out.stdout.split()[:3] == ["DictMap", "ChunkQueue", "3"] and "PDSERVE_NATIVE=0" in out.stdout


def test_the_compiled_types_are_usable_without_init():
    mod = native.load()
    m, o = mod.Map.__new__(mod.Map), mod.Order.__new__(mod.Order)
    assert 5 not in m and len(m) == 0 and len(o) == 0
    o.clear()
    m[5] = 1
    assert m[5] == 1
    with pytest.raises(TypeError):  # the raw buffer calls take 64-bit integers only
        m._get_many(np.zeros(3), np.empty(3, np.int64), MISSING)
    with pytest.raises(ValueError):  # -1 / -2 mark free entries in the table: never a value
        m._put(np.array([7], np.uint64), np.array([-1]), None, False)
    assert 7 not in m
