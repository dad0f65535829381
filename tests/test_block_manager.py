"""KVBlockManager: allocation accounting, the prefix cache, LRU eviction, and a stateful model check."""

from __future__ import annotations

import time

import pytest
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from pdserve.core.kvstore.block_hash import hash_blocks
from pdserve.core.kvstore.block_manager import KVBlockManager

BS = 4


def _fill(bm: KVBlockManager, request_id: str, tokens: list[int]) -> list[int]:
    """Admit `tokens` as a new request (with prefix lookup), 'compute' it all and register its full blocks."""
    hit = bm.find_prefix(tokens)
    ids = bm.allocate(request_id, len(tokens), hit)
    assert ids is not None
    bm.cache_full_blocks(request_id, tokens, len(tokens))
    return ids


# ---- unit tests ----------------------------------------------------------------------------------------
def test_constructor_rejects_empty_pool():
    with pytest.raises(ValueError):
        KVBlockManager(0, BS, clock=time.monotonic)
    with pytest.raises(ValueError):
        KVBlockManager(4, 0, clock=time.monotonic)


def test_allocate_and_free_counts():
    bm = KVBlockManager(10, BS, clock=time.monotonic)
    assert (bm.num_free_blocks, bm.num_used_blocks) == (10, 0)
    ids = bm.allocate("a", 9)  # 3 blocks
    assert ids is not None and len(ids) == 3 and len(set(ids)) == 3
    assert bm.block_ids("a") == tuple(ids)
    assert (bm.num_free_blocks, bm.num_used_blocks) == (7, 3)
    assert all(bm.ref_count(b) == 1 for b in ids)
    # Growing within the last block allocates nothing; crossing a block boundary allocates one.
    assert bm.allocate("a", 12) == []
    more = bm.allocate("a", 13)
    assert more is not None and len(more) == 1 and more[0] not in ids
    assert bm.block_ids("a") == tuple(ids + more)
    assert bm.num_used_blocks == 4
    b_ids = bm.allocate("b", 1)
    assert b_ids is not None and len(b_ids) == 1 and not set(b_ids) & set(ids + more)
    bm.free("a")
    assert bm.block_ids("a") == ()
    assert (bm.num_free_blocks, bm.num_used_blocks) == (9, 1)
    assert all(bm.ref_count(b) == 0 for b in ids + more)
    bm.free("b")
    bm.free("never-allocated")  # ignored
    assert (bm.num_free_blocks, bm.num_used_blocks) == (10, 0)


def test_allocate_returns_none_and_changes_nothing_when_short():
    bm = KVBlockManager(4, BS, clock=time.monotonic)
    a = bm.allocate("a", 8)
    assert a is not None and len(a) == 2
    assert bm.allocate("b", 12) is None  # needs 3, 2 free
    assert bm.block_ids("b") == ()
    assert bm.num_free_blocks == 2
    assert bm.allocate("a", 17) is None  # needs 3 more, 2 free
    assert bm.block_ids("a") == tuple(a)
    assert bm.num_free_blocks == 2
    assert [bm.ref_count(i) for i in range(4)].count(1) == 2
    # Exactly fitting still works afterwards.
    assert bm.allocate("b", 8) is not None
    assert bm.num_free_blocks == 0


def test_allocate_with_prefix_returns_none_and_changes_nothing_when_short():
    bm = KVBlockManager(4, BS, clock=time.monotonic)
    prompt = list(range(9))
    _fill(bm, "a", prompt)  # 3 blocks, two full ones cached
    bm.free("a")
    hold = bm.allocate("x", 4)  # takes the never-used block, which heads the free queue
    assert hold is not None
    hit = bm.find_prefix(prompt + [100] * 8)  # would need 2 hit + 3 new, only 3 free and 2 of them are hits
    assert hit.num_tokens == 8
    free_before = bm.num_free_blocks
    assert bm.allocate("b", 17, hit) is None
    assert bm.num_free_blocks == free_before
    assert bm.block_ids("b") == ()
    assert all(bm.ref_count(b) == 0 for b in hit.block_ids)
    assert bm.find_prefix(prompt + [100] * 8) == hit  # cache untouched


def test_prefix_hit_after_cached_and_freed():
    bm = KVBlockManager(8, BS, clock=time.monotonic)
    prompt = list(range(10))  # blocks [0..3], [4..7], partial [8, 9]
    a = _fill(bm, "a", prompt)
    assert bm.num_cached_blocks == 2
    bm.free("a")
    hit = bm.find_prefix(prompt + [77, 78])
    assert hit.block_ids == tuple(a[:2])
    assert hit.num_tokens == 8
    assert hit.block_hashes[:2] == tuple(hash_blocks(prompt[:8], BS))
    b = bm.allocate("b", 12, hit)
    assert b is not None and b[:2] == a[:2] and len(b) == 3
    assert bm.num_used_blocks == 3
    # A diverging prefix only hits the blocks before the divergence.
    other = prompt[:4] + [99] + prompt[5:]
    assert bm.find_prefix(other).block_ids == (a[0],)
    # Block content matters, not just the last block: same second block after a different first block misses.
    assert bm.find_prefix([99, 1, 2, 3] + prompt[4:]).block_ids == ()


def test_cache_full_blocks_only_registers_computed_full_blocks():
    bm = KVBlockManager(8, BS, clock=time.monotonic)
    prompt = list(range(12))
    bm.allocate("a", 12)
    bm.cache_full_blocks("a", prompt, 7)  # only block 0 is full and computed
    assert bm.num_cached_blocks == 1
    assert bm.find_prefix(prompt + [0]).num_tokens == 4
    bm.cache_full_blocks("a", prompt, 12)
    assert bm.num_cached_blocks == 3
    assert bm.find_prefix(prompt + [0]).num_tokens == 12


def test_prefix_caching_disabled():
    bm = KVBlockManager(8, BS, enable_prefix_caching=False, clock=time.monotonic)
    prompt = list(range(9))
    _fill(bm, "a", prompt)
    bm.free("a")
    assert bm.num_cached_blocks == 0
    assert bm.find_prefix(prompt).block_ids == ()


def test_cache_salt_separates_caches():
    a = KVBlockManager(8, BS, cache_salt=b"model-a", clock=time.monotonic)
    b = KVBlockManager(8, BS, cache_salt=b"model-b", clock=time.monotonic)
    prompt = list(range(9))
    _fill(a, "r", prompt)
    _fill(b, "r", prompt)
    assert a.find_prefix(prompt).block_hashes != b.find_prefix(prompt).block_hashes


@pytest.mark.parametrize("n_blocks", [1, 2, 3])
def test_find_prefix_leaves_one_token_uncomputed(n_blocks):
    bm = KVBlockManager(8, BS, clock=time.monotonic)
    prompt = list(range(n_blocks * BS))
    _fill(bm, "a", prompt)
    assert bm.num_cached_blocks == n_blocks
    bm.free("a")
    hit = bm.find_prefix(prompt)  # exact multiple of the block size: the last block must not be hit
    assert hit.num_tokens == (n_blocks - 1) * BS
    assert hit.num_tokens < len(prompt)
    assert bm.find_prefix(prompt + [5]).num_tokens == n_blocks * BS
    assert bm.find_prefix([]).block_ids == ()
    assert bm.find_prefix(prompt[:1]).block_ids == ()


def test_find_prefix_changes_nothing():
    bm = KVBlockManager(4, BS, clock=time.monotonic)
    prompt = list(range(9))
    _fill(bm, "a", prompt)
    bm.free("a")
    before = (bm.num_free_blocks, bm.num_cached_blocks, [bm.ref_count(i) for i in range(4)])
    bm.find_prefix(prompt)
    assert (bm.num_free_blocks, bm.num_cached_blocks, [bm.ref_count(i) for i in range(4)]) == before


def test_lru_least_recently_freed_reused_first():
    bm = KVBlockManager(4, BS, clock=time.monotonic)
    a = _fill(bm, "a", [1] * 4 + [0])  # a[0] cached
    b = _fill(bm, "b", [2] * 4 + [0])  # b[0] cached
    bm.free("a")  # freed first -> evicted first
    bm.free("b")
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    # Two fresh blocks: both are a's (a's tail first, then a's head).
    got = bm.allocate("c", 8)
    assert got == [a[1], a[0]]
    assert bm.find_prefix([1] * 4 + [0]).block_ids == ()  # evicted from the cache on reuse
    assert bm.find_prefix([2] * 4 + [0]).block_ids == (b[0],)  # still cached
    assert bm.num_cached_blocks == 1


def test_lru_tail_blocks_evicted_before_head():
    bm = KVBlockManager(4, BS, clock=time.monotonic)
    prompt = list(range(16))
    a = _fill(bm, "a", prompt)  # 4 full blocks, all cached
    bm.free("a")
    got = bm.allocate("x", 4)
    assert got == [a[3]]  # the tail goes first
    assert bm.find_prefix(prompt + [0]).block_ids == tuple(a[:3])
    got = bm.allocate("x", 8)
    assert got == [a[2]]
    assert bm.find_prefix(prompt + [0]).block_ids == tuple(a[:2])


def test_hit_refreshes_lru_position():
    bm = KVBlockManager(4, BS, clock=time.monotonic)
    a = _fill(bm, "a", [1] * 4 + [0])
    b = _fill(bm, "b", [2] * 4 + [0])
    bm.free("a")
    bm.free("b")
    # Reuse a's cached head, then free it again: it becomes the most recently freed.
    c = bm.allocate("c", 5, bm.find_prefix([1] * 4 + [9]))
    assert c is not None and c[0] == a[0]
    bm.free("c")
    order = [bm.allocate(f"n{i}", 1)[0] for i in range(4)]
    assert order.index(b[0]) < order.index(a[0])


def test_hit_on_block_in_use_is_shared():
    bm = KVBlockManager(6, BS, clock=time.monotonic)
    prompt = list(range(9))
    a = _fill(bm, "a", prompt)  # still running
    free_before = bm.num_free_blocks
    hit = bm.find_prefix(prompt[:8] + [50, 51])
    assert hit.block_ids == tuple(a[:2])
    b = bm.allocate("b", 10, hit)
    assert b is not None and b[:2] == a[:2] and b[2] != a[2]
    assert bm.ref_count(a[0]) == bm.ref_count(a[1]) == 2
    assert bm.num_free_blocks == free_before - 1  # only the new tail block was taken
    bm.free("a")
    assert bm.ref_count(a[0]) == bm.ref_count(a[1]) == 1
    assert bm.num_free_blocks == free_before - 1 + 1
    bm.free("b")
    assert bm.num_free_blocks == 6


def test_shared_in_use_hit_needs_no_free_block():
    bm = KVBlockManager(3, BS, clock=time.monotonic)
    prompt = list(range(9))
    a = _fill(bm, "a", prompt)  # all three blocks in use
    assert bm.num_free_blocks == 0
    hit = bm.find_prefix(prompt[:8] + [1])
    b = bm.allocate("b", 8, hit)  # two hit blocks already held by "a": nothing to take from the pool
    assert b == a[:2]
    assert bm.allocate("c", 9, bm.find_prefix(prompt[:8] + [1])) is None  # a third block is needed: none free


def test_prefix_given_to_request_holding_blocks_is_rejected():
    bm = KVBlockManager(6, BS, clock=time.monotonic)
    prompt = list(range(9))
    _fill(bm, "a", prompt)
    bm.allocate("b", 1)
    with pytest.raises(ValueError):
        bm.allocate("b", 12, bm.find_prefix(prompt))


def test_reset_prefix_cache():
    bm = KVBlockManager(6, BS, clock=time.monotonic)
    prompt = list(range(9))
    a = _fill(bm, "a", prompt)
    bm.free("a")
    assert bm.find_prefix(prompt).num_tokens == 8
    running = _fill(bm, "r", [7] * 9)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    assert bm.find_prefix(prompt).block_ids == ()
    assert bm.find_prefix([7] * 9).block_ids == ()
    # Blocks in use are untouched, freed ones stay free.
    assert bm.block_ids("r") == tuple(running)
    assert all(bm.ref_count(b) == 1 for b in running)
    assert all(bm.ref_count(b) == 0 for b in a)
    assert bm.num_free_blocks == 3
    # The cache works again afterwards.
    _fill(bm, "z", prompt)
    bm.free("z")
    assert bm.find_prefix(prompt).num_tokens == 8


def test_same_content_computed_twice_keeps_one_cache_entry():
    bm = KVBlockManager(8, BS, clock=time.monotonic)
    prompt = list(range(9))
    a = bm.allocate("a", 9)
    b = bm.allocate("b", 9)  # both computed the same prompt without sharing
    bm.cache_full_blocks("a", prompt, 9)
    bm.cache_full_blocks("b", prompt, 9)
    assert bm.num_cached_blocks == 2
    assert bm.find_prefix(prompt).block_ids == tuple(a[:2])
    bm.free("a")
    bm.free("b")
    # Reusing a's blocks evicts them; b's copies were never registered, so the prefix is gone.
    for i in range(8):
        bm.allocate(f"f{i}", 4)
    assert bm.find_prefix(prompt).block_ids == ()
    assert bm.num_cached_blocks == 0


# ---- stateful model ----------------------------------------------------------------------------------
ALPHABET = st.integers(0, 2)  # tiny alphabet: prefixes repeat often


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admit / compute / grow / cache / finish / abort / preempt / readmit against a shadow model.

    The shadow model keeps, per physical block, the token each slot holds (what a real KV pool would hold),
    and per cached hash the token prefix it was computed from. A prefix hit must return blocks holding
    exactly the requested tokens.
    """

    live = Bundle("live")
    waiting = Bundle("waiting")

    @initialize(num_blocks=st.integers(8, 16), seed=st.lists(ALPHABET, min_size=BS + 1, max_size=4 * BS),
                keep_seed=st.booleans())
    def setup(self, num_blocks, seed, keep_seed):
        self.bm = KVBlockManager(num_blocks, BS, clock=time.monotonic)
        self.n = num_blocks
        self.reqs: dict[str, dict] = {}  # rid -> {"tokens", "alloc" (tokens covered), "computed"}
        self.waiting_tokens: dict[str, list[int]] = {}
        self.slots: dict[int, list[int | None]] = {b: [None] * BS for b in range(num_blocks)}
        self.hash_prefix: dict[int, tuple[int, ...]] = {}
        self.counter = 0
        self.resets = 0
        self.history: list[list[int]] = []
        self.num_hits = 0
        # Start with one computed, registered prompt (still running or already freed) so hits happen early.
        assert self._admit("seed", seed, len(seed))
        self.history.append(list(seed))
        self.compute("seed")
        self.cache("seed")
        if not keep_seed:
            self.finish("seed")

    # ---- helpers ----------------------------------------------------------------------------------
    def _snapshot(self):
        return (self.bm.num_free_blocks, self.bm.num_cached_blocks,
                [self.bm.ref_count(b) for b in range(self.n)],
                {rid: self.bm.block_ids(rid) for rid in self.reqs})

    def _check_hit(self, tokens, hit):
        assert hit.num_tokens <= max(len(tokens) - 1, 0)
        assert len(set(hit.block_ids)) == len(hit.block_ids)
        for i, block_id in enumerate(hit.block_ids):
            want = tokens[i * BS:(i + 1) * BS]
            assert self.slots[block_id] == want, f"hit block {block_id} holds wrong KV"
            h = hit.block_hashes[i]
            assert self.hash_prefix.get(h) == tuple(tokens[:(i + 1) * BS])

    def _admit(self, rid, tokens, chunk):
        hit = self.bm.find_prefix(tokens, rid)  # memoized per request, as the scheduler calls it
        self._check_hit(tokens, hit)
        want = min(len(tokens), hit.num_tokens + chunk)
        before = self._snapshot()
        revived = sum(1 for b in hit.block_ids if self.bm.ref_count(b) == 0)
        needed = self.bm.blocks_needed(want) - len(hit.block_ids) + revived
        got = self.bm.allocate(rid, want, hit)
        if got is None:
            assert needed > before[0]
            assert self._snapshot() == before
            return False
        assert needed <= before[0]
        assert tuple(got[:len(hit.block_ids)]) == hit.block_ids
        assert self.bm.block_ids(rid) == tuple(got)
        assert len(got) == self.bm.blocks_needed(want)
        assert self.bm.num_free_blocks == before[0] - needed
        self.num_hits += len(hit.block_ids)
        self.reqs[rid] = {"tokens": list(tokens), "alloc": want, "computed": hit.num_tokens, "epoch": self.resets}
        return True

    # ---- rules ----------------------------------------------------------------------------------------
    @rule(target=live, tokens=st.lists(ALPHABET, min_size=1, max_size=24), chunk=st.integers(1, 24))
    def admit_new(self, tokens, chunk):
        self.counter += 1
        rid = f"r{self.counter}"
        self.history.append(list(tokens))
        if self._admit(rid, tokens, chunk):
            return rid
        self.waiting_tokens[rid] = list(tokens)
        return None  # a None in the bundle is skipped by the rules below

    @rule(target=live, pick=st.integers(0, 10**6), cut=st.integers(0, 24),
          suffix=st.lists(ALPHABET, min_size=0, max_size=8), chunk=st.integers(1, 24))
    def admit_shared(self, pick, cut, suffix, chunk):
        """A new request sharing a prefix with an earlier one (a second turn, a common system prompt)."""
        if not self.history:
            return None
        base = self.history[pick % len(self.history)]
        tokens = base[:cut] + suffix
        if not tokens:
            return None
        return self.admit_new(tokens, chunk)

    @rule(rid=live)
    def compute(self, rid):
        """Write the allocated-but-uncomputed tokens into their blocks, as an executor would."""
        req = self.reqs.get(rid)
        if req is None:
            return
        table = self.bm.block_ids(rid)
        end = min(req["alloc"], len(req["tokens"]))
        for pos in range(req["computed"], end):
            block_id = table[pos // BS]
            assert self.bm.ref_count(block_id) == 1, "writing KV into a shared block"
            self.slots[block_id][pos % BS] = req["tokens"][pos]
        req["computed"] = max(req["computed"], end)

    @rule(register=st.booleans())
    def step_all(self, register):
        """An engine step: every live request computes what it was allocated, then (usually) registers it."""
        for rid in list(self.reqs):
            self.compute(rid)
            if register:
                self.cache(rid)

    @rule(rid=live)
    def cache(self, rid):
        req = self.reqs.get(rid)
        if req is None:
            return
        tokens, computed = req["tokens"], req["computed"]
        self.bm.cache_full_blocks(rid, tokens, computed)
        for i, h in enumerate(hash_blocks(tokens[:computed // BS * BS], BS)):
            prefix = tuple(tokens[:(i + 1) * BS])
            assert self.hash_prefix.setdefault(h, prefix) == prefix
        # Whatever is found now must be right (a duplicate of a block registered by another request stays
        # unregistered, so not every computed block is findable: that is a missed hit, not wrong KV).
        probe = tokens[:computed] + [0]
        self._check_hit(probe, self.bm.find_prefix(probe))

    @rule(rid=live, new=st.lists(ALPHABET, min_size=1, max_size=6))
    def grow(self, rid, new):
        """Append tokens (decode output or more prompt) and try to cover them with blocks."""
        req = self.reqs.get(rid)
        if req is None or req["computed"] < req["alloc"]:
            return  # compute what is allocated first, like the scheduler does
        req["tokens"].extend(new)
        self.history.append(list(req["tokens"]))
        before = self._snapshot()
        need = self.bm.blocks_needed(len(req["tokens"])) - len(self.bm.block_ids(rid))
        got = self.bm.allocate(rid, len(req["tokens"]))
        if got is None:
            assert need > before[0]
            assert self._snapshot() == before
            return
        assert len(got) == max(need, 0)
        assert self.bm.num_free_blocks == before[0] - len(got)
        req["alloc"] = len(req["tokens"])

    @rule(rid=consumes(live))
    def finish(self, rid):
        if rid in self.reqs:
            self.bm.free(rid)
            self.bm.forget(rid)
            del self.reqs[rid]
            assert self.bm.block_ids(rid) == ()

    @rule(rid=consumes(live))
    def abort(self, rid):
        self.finish(rid)

    @rule(target=waiting, rid=consumes(live))
    def preempt(self, rid):
        req = self.reqs.pop(rid, None)
        if req is None:
            return None
        self.bm.free(rid)
        self.waiting_tokens[rid] = req["tokens"]
        return rid

    @rule(target=live, rid=consumes(waiting), chunk=st.integers(1, 24))
    def readmit(self, rid, chunk):
        if rid is None or rid not in self.waiting_tokens:
            return None
        tokens = self.waiting_tokens[rid]
        if self._admit(rid, tokens, chunk):
            del self.waiting_tokens[rid]
            return rid
        return None

    @rule()
    def reset_cache(self):
        self.bm.reset_prefix_cache()
        self.resets += 1
        assert self.bm.num_cached_blocks == 0

    # ---- invariants -----------------------------------------------------------------------------------
    @invariant()
    def accounting(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        assert bm.num_free_blocks + bm.num_used_blocks == self.n
        refs = [bm.ref_count(b) for b in range(self.n)]
        assert all(r >= 0 for r in refs)
        tables = {rid: bm.block_ids(rid) for rid in self.reqs}
        assert sum(len(t) for t in tables.values()) == sum(refs)
        holders = {b: 0 for b in range(self.n)}
        for rid, table in tables.items():
            assert len(set(table)) == len(table)
            assert len(table) == bm.blocks_needed(self.reqs[rid]["alloc"])
            for b in table:
                holders[b] += 1
        assert all(refs[b] == holders[b] for b in range(self.n))
        assert refs.count(0) == bm.num_free_blocks
        assert bm.num_cached_blocks <= self.n
        # cached_as (the blocks' own columns) agrees with the hash map, for each block under its own hash
        ids = np.arange(self.n)
        hashes = bm.cols.block_hash[ids]
        for keys in (hashes, np.roll(hashes, 1)):  # (and under another block's hash)
            np.testing.assert_array_equal(bm.cached_as(ids, keys), bm._cached.get_many(keys) == ids)
        for rid in self.waiting_tokens:
            assert bm.block_ids(rid) == ()

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for rid in list(self.reqs):
            self.bm.free(rid)
        assert self.bm.num_free_blocks == self.n
        assert self.bm.num_used_blocks == 0
        assert all(self.bm.ref_count(b) == 0 for b in range(self.n))


BlockManagerMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
TestBlockManagerStateful = BlockManagerMachine.TestCase


def test_hold_keeps_blocks_past_their_request_until_the_holder_frees_them():
    bm = KVBlockManager(num_blocks=8, block_size=4, clock=time.monotonic)
    ids = bm.allocate("r", 12)
    bm.hold("xfer:r", ids[:2])  # e.g. a transfer whose receiver reads these two in place
    bm.free("r")
    assert bm.num_used_blocks == 2 and all(bm.ref_count(b) == 1 for b in ids[:2])
    assert not set(ids[:2]) & set(bm.allocate("s", 24))  # every free block, never the held ones
    bm.free("s")
    bm.hold("xfer:late", [ids[2]])  # a block already free is taken back off the free queue
    assert bm.num_used_blocks == 3
    bm.free("xfer:r")
    bm.free("xfer:late")
    assert bm.num_used_blocks == 0
    bm.find_prefix(list(range(9)), "t")  # a live request's id
    with pytest.raises(ValueError, match="is a request"):
        bm.hold("t", [0])
