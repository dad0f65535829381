"""Both slot orders (`LinkedQueue`, compiled; `ChunkQueue`, its numpy fallback) against an OrderedDict model:
pushes (single and runs), removals and predicate pops keep exactly the least-recently-pushed order, whatever
chunks, stale entries and compactions do underneath."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.core.kvstore import lru_queue
from pdserve.core.kvstore.lru_queue import ChunkQueue, LinkedQueue, new_queue

N = 24
slot = st.integers(0, N - 1)
ops = st.lists(st.one_of(
    st.tuples(st.just("push"), slot),
    st.tuples(st.just("push_many"), st.lists(slot, max_size=8, unique=True)),
    st.tuples(st.just("remove"), slot),
    st.tuples(st.just("remove_many"), st.lists(slot, max_size=6)),
    st.tuples(st.just("pop"), st.integers(0, 6), st.integers(0, 2)),  # count, predicate: all / even / >= 12
    st.tuples(st.just("pop_evictable"), st.integers(0, 6), st.integers(0, 2**16)),  # count, a seed for columns
), max_size=80)

PREDICATES = [None, lambda s: s % 2 == 0, lambda s: s >= N // 2]


def _linked(n: int) -> LinkedQueue:
    q = new_queue(n)
    assert isinstance(q, LinkedQueue), "the compiled order did not build here"
    return q


@pytest.mark.parametrize("make", [_linked, ChunkQueue], ids=["linked", "chunks"])
@settings(max_examples=300, deadline=None)
@given(operations=ops)
def test_matches_an_ordered_dict(make, operations):
    q, model = make(N), OrderedDict()
    for op in operations:
        if op[0] == "push":
            q.push(op[1])
            model.pop(op[1], None)
            model[op[1]] = None
        elif op[0] == "push_many":
            q.push_many(np.array(op[1], np.int64))
            for s in op[1]:
                model.pop(s, None)
                model[s] = None
        elif op[0] == "remove":
            q.remove(op[1])
            model.pop(op[1], None)
        elif op[0] == "remove_many":
            q.remove_many(np.array(op[1], np.int64))
            for s in op[1]:
                model.pop(s, None)
        elif op[0] == "pop_evictable":  # MetaColumns' columns: ready, busy readers, pinned until
            rng = np.random.default_rng(op[2])
            ready, busy = rng.random(N) < 0.8, rng.integers(0, 3, N).astype(np.int32) * (rng.random(N) < 0.3)
            pinned, now = rng.choice([0.0, 2.0, 5.0], N), 2.0  # (pinned until now: evictable now)
            want = [s for s in model if ready[s] and busy[s] == 0 and pinned[s] <= now][:op[1]]
            marked = rng.random(N) < 0.2
            for after in [-1, *list(model)[:2]]:  # the watermark marking's look: nothing leaves the order
                rest = list(model) if after < 0 else list(model)[list(model).index(after) + 1:]
                look = [s for s in rest if ready[s] and busy[s] == 0 and pinned[s] <= now and not marked[s]][:op[1]]
                assert q.first_evictable(op[1], after, ready, busy, pinned, marked, now).tolist() == look
            assert q.pop_evictable(op[1], ready, busy, pinned, now).tolist() == want
            for s in want:
                del model[s]
        else:
            count, pred = op[1], PREDICATES[op[2]]
            allowed = None if pred is None else (lambda slots, p=pred: p(slots))
            want = [s for s in model if pred is None or pred(s)][:count]
            assert q.pop_first(count, allowed).tolist() == want
            for s in want:
                del model[s]
        assert len(q) == len(model)
        assert q.order().tolist() == list(model)
        assert all((s in q) == (s in model) for s in range(N))
        assert [s for run in q.runs() for s in run.tolist()] == list(model)
        order = list(model)
        for k, s in enumerate(order[:3]):  # (runs after a slot: what follows it)
            assert [x for run in q.runs(s) for x in run.tolist()] == order[k + 1:]


def test_compaction_keeps_memory_bounded_and_order(monkeypatch):
    monkeypatch.setattr(lru_queue, "CHUNK", 4)
    q = ChunkQueue(8)
    q.push_many(np.arange(8))
    for i in range(200):  # touch the same slots over and over: stale entries pile up behind the head
        q.push(i % 3)
    entries = sum(len(s) for s, _ in q._chunks) + len(q._tail_slots)
    assert entries <= 2 * 8 + 4 + 1
    assert q.order().tolist() == [3, 4, 5, 6, 7] + [(199 - 2 + k) % 3 for k in range(3)]


def test_the_linked_order_refuses_slots_out_of_range():
    q = _linked(4)
    for bad in (lambda: q.push(4), lambda: q.push_many(np.array([1, -1])), lambda: q.remove(7)):
        with pytest.raises(IndexError):
            bad()
    assert len(q) == 0  # a run with a bad slot changed nothing


ref_ops = st.lists(st.one_of(
    st.tuples(st.just("take"), st.lists(slot, max_size=8, unique=True)),
    st.tuples(st.just("release"), st.lists(slot, max_size=10)),  # repeats: a holder that held a block twice
), max_size=40)


@pytest.mark.parametrize("make", [_linked, ChunkQueue], ids=["linked", "chunks"])
@settings(max_examples=200, deadline=None)
@given(operations=ref_ops)
def test_ref_counts_move_blocks_in_and_out_of_the_free_queue(make, operations):
    """A pool's free queue: a block with no reference is in it (least recently freed first), else not."""
    q, free, ref = make(N), OrderedDict.fromkeys(range(N)), np.zeros(N, np.int32)
    q.push_many(np.arange(N))
    for kind, ids in operations:
        if kind == "take":
            q.take_refs(ref, np.array(ids, np.int64))
            for s in ids:
                free.pop(s, None)
        else:
            ids = [s for s in ids if ref[s] > ids.count(s) - 1]  # (never below zero here: see the next test)
            want = ref.copy()
            for s in ids:
                want[s] -= 1
            q.release_refs(ref, np.array(ids, np.int64))
            for s in ids:
                if want[s] == 0 and s not in free:
                    free[s] = None
            np.testing.assert_array_equal(ref, want)
        assert q.order().tolist() == list(free)
        assert all((ref[s] == 0) == (s in free) for s in range(N))


@pytest.mark.parametrize("make", [_linked, ChunkQueue], ids=["linked", "chunks"])
def test_a_reference_count_going_negative_raises_and_frees_nothing(make):
    q, ref = make(N), np.zeros(N, np.int32)
    ref[3] = 1
    with pytest.raises(AssertionError, match="block 5 ref count went negative"):
        q.release_refs(ref, np.array([3, 5], np.int64))
    assert 3 not in q and len(q) == 0
