"""KV tiers without torch: lifecycle stages, eviction policies, the host/disk tier index, and `TieredKV`
end to end through `LLMEngine` with FakeExecutor.

The I/O runner here (`LoopbackIO`) keeps the `kv_io` contract of `pdserve.kv.tier_io.TierIO` (operations
run in submission order, each reported once by `poll`; loads run on the engine's thread before the
forward) but moves FakeExecutor's per-slot (position, token) records instead of tensors and files. Every
copy is checked against the bookkeeping: an offload must read a device block that still holds its hash,
a flush or a load must read a host slot whose bytes belong to the hash asked for. FakeExecutor raises on a
missing or misplaced position and samples a hash of the context it reads back, so KV served from the
wrong place shows up as a raise or as tokens that differ from the reference.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pdserve.core.kvstore.block_manager import KVBlockManager
from pdserve.core.kvstore.kv_meta import (BlockMeta, HeatPolicy, LifecycleConfig, LRUPolicy, Stage, Tier,
                                  make_eviction_policy, pick_victim, stage_of)
from pdserve.core.kvstore.kv_tier_index import TierIndex
from pdserve.core.kvstore.kv_ops import TierCapacity
from pdserve.core.kvstore.kv_tiers import KVLoad, KVOp, TieredKV, TierHit, build_tiered_kv
from pdserve.core.request import RequestStatus
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.sched.kv_reservations import LOOKING
from pdserve.core.sched.schedule import SchedulerConfig
from pdserve.engine.executor import FakeExecutor
from pdserve.engine.llm_engine import LLMEngine

VOCAB = 50
BS = 4
CFG = LifecycleConfig(active_s=30.0, heat_half_life_s=120.0, eviction_sample=16)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def meta(h: int, last_use: float = 0.0, tier: Tier = Tier.HOST, slot: int = 0, **kw) -> BlockMeta:
    kw.setdefault("heat_at_s", last_use)
    return BlockMeta(h, tier, slot, produced_at_s=0.0, last_use_s=last_use, **kw)


# ---- lifecycle stages ----------------------------------------------------------------------------------
def test_stage_prewarm_until_first_use_by_a_request():
    m = meta(1, last_use=0.0, pinned_until_s=100.0, prewarmed=True)
    assert stage_of(m, 50.0, in_use=False, config=CFG) is Stage.PREWARM
    m.touch(50.0, CFG.heat_half_life_s, by_request=False)  # not a request: still prewarmed
    assert stage_of(m, 51.0, in_use=False, config=CFG) is Stage.PREWARM
    m.touch(52.0, CFG.heat_half_life_s)  # a request used it
    assert not m.prewarmed
    assert stage_of(m, 53.0, in_use=True, config=CFG) is Stage.ACTIVE
    # the pin still holds it on its tier, but it is a plain block now: idle long enough, it decays
    assert stage_of(m, 52.0 + CFG.active_s + 1, in_use=False, config=CFG) is Stage.DECAY


def test_stage_prewarm_ends_with_its_pin():
    m = meta(1, last_use=0.0, pinned_until_s=10.0, prewarmed=True)
    assert stage_of(m, 9.0, False, CFG) is Stage.PREWARM
    assert stage_of(m, 10.0, False, CFG) is Stage.ACTIVE  # pin over, recently produced
    assert stage_of(m, 10.0 + CFG.active_s, False, CFG) is Stage.DECAY


def test_stage_active_then_decay_then_active_again():
    m = meta(1, last_use=100.0)
    assert stage_of(m, 100.0 + CFG.active_s - 0.001, False, CFG) is Stage.ACTIVE
    assert stage_of(m, 100.0 + CFG.active_s, False, CFG) is Stage.DECAY
    assert stage_of(m, 1000.0, True, CFG) is Stage.ACTIVE  # held by a live request
    m.touch(1000.0, CFG.heat_half_life_s)  # a hit
    assert stage_of(m, 1001.0, False, CFG) is Stage.ACTIVE


def test_stage_reclaim_when_marked_wins_over_everything():
    m = meta(1, last_use=100.0, pinned_until_s=1e9, prewarmed=True)
    m.reclaiming = True
    assert stage_of(m, 100.0, True, CFG) is Stage.RECLAIM


def test_heat_decays_with_half_life():
    m = meta(1, last_use=0.0)
    for t in range(4):
        m.touch(0.0, 120.0)
    assert m.heat_now(0.0, 120.0) == pytest.approx(4.0)
    assert m.heat_now(120.0, 120.0) == pytest.approx(2.0)
    assert m.heat_now(240.0, 120.0) == pytest.approx(1.0)
    m.touch(240.0, 120.0)
    assert m.heat == pytest.approx(2.0) and m.use_count == 5 and m.last_use_s == 240.0


def test_block_manager_pin_gives_prewarm_then_a_hit_makes_it_active():
    t = [0.0]
    bm = KVBlockManager(8, BS, clock=lambda: t[0])
    tokens = list(range(9))
    hit = bm.find_prefix(tokens, "a")
    bm.allocate("a", len(tokens), hit)
    bm.cache_full_blocks("a", tokens, 8)
    assert bm.pin("prewarm:p", "a", until_s=100.0) == 2
    bm.free("a")
    bm.forget("a")
    t[0] = 50.0
    assert bm.stage_counts(t[0])[Stage.PREWARM] == 2
    hit = bm.find_prefix(tokens, "b")
    assert len(hit.block_ids) == 2
    bm.allocate("b", len(tokens), hit)
    assert bm.stage_counts(t[0])[Stage.PREWARM] == 0
    assert bm.stage_counts(t[0])[Stage.ACTIVE] == 3  # two hit blocks and b's unregistered last block


# ---- eviction policies --------------------------------------------------------------------------------
def test_lru_takes_least_recent_heat_keeps_the_block_used_many_times():
    hot = meta(1, last_use=0.0)
    for t in range(10):
        hot.touch(float(t), 120.0)  # used 10 times, last at t=9
    once = meta(2, last_use=50.0)
    once.touch(50.0, 120.0)  # used once, more recently
    now = 60.0
    assert pick_victim([hot, once], LRUPolicy(), now, 16) is hot
    assert pick_victim([hot, once], HeatPolicy(120.0), now, 16) is once
    # heat decays: long after, the many-times block is still warmer than the once block, as both decay alike
    assert pick_victim([hot, once], HeatPolicy(120.0), 600.0, 16) is once


def test_heat_ties_go_to_least_recently_used():
    a, b = meta(1, last_use=10.0), meta(2, last_use=20.0)
    assert pick_victim([b, a], HeatPolicy(), 30.0, 16) is a


def test_expected_use_protects_within_the_horizon_only():
    cold = meta(1, last_use=0.0)
    warm = meta(2, last_use=0.0)
    warm.touch(0.0, 120.0)
    policy = HeatPolicy(120.0, horizon_s=60.0)
    now = 100.0
    assert pick_victim([cold, warm], policy, now, 16) is cold
    cold.expected_use_at_s = now + 30.0  # coming back soon: keep it
    assert pick_victim([cold, warm], policy, now, 16) is warm
    cold.expected_use_at_s = now + 61.0  # beyond the horizon
    assert pick_victim([cold, warm], policy, now, 16) is cold
    cold.expected_use_at_s = now - 1.0  # expected in the past: no protection
    assert pick_victim([cold, warm], policy, now, 16) is cold


def test_pick_victim_skips_busy_unready_pinned_and_looks_at_sample_only():
    now = 10.0
    busy, unready, pinned = meta(1, busy=1), meta(2, ready=False), meta(3, pinned_until_s=now + 1)
    assert pick_victim([busy, unready, pinned], LRUPolicy(), now, 16) is None
    free = meta(4, last_use=5.0)
    assert pick_victim([busy, unready, pinned, free], LRUPolicy(), now, 1) is free  # skipped ones not counted
    oldest = meta(5, last_use=-100.0)
    assert pick_victim([free, meta(6, last_use=6.0), oldest], LRUPolicy(), now, 2) is free  # beyond sample
    assert pick_victim([free, meta(6, last_use=6.0), oldest], LRUPolicy(), now, 3) is oldest
    pinned.pinned_until_s = now  # the pin ran out
    assert pick_victim([pinned, free], LRUPolicy(), now, 16) is pinned


def test_make_eviction_policy():
    assert isinstance(make_eviction_policy("lru"), LRUPolicy)
    heat = make_eviction_policy("heat", LifecycleConfig(heat_half_life_s=7.0))
    assert isinstance(heat, HeatPolicy) and heat.half_life_s == 7.0
    with pytest.raises(ValueError, match="unknown KV eviction policy"):
        make_eviction_policy("mru")


# ---- TierIndex ------------------------------------------------------------------------------------------
def check_index(tier: TierIndex) -> None:
    slots = [m.slot for m in tier]
    assert len(set(slots)) == len(slots), f"{tier.tier}: a slot used twice"
    assert all(0 <= s < tier.capacity for s in slots)
    assert set(slots).isdisjoint(tier.free_slots())
    assert len(set(tier.free_slots())) == len(tier.free_slots())
    assert len(slots) + tier.num_free() == tier.capacity
    assert all(m.busy >= 0 for m in tier), f"{tier.tier}: negative busy"
    assert all(h in tier.entries and tier.entries[h].reclaiming for h in tier.marked())
    assert sum(m.reclaiming for m in tier) == len(tier.marked()) == tier._marked
    assert all(m.block_hash == h and m.tier is tier.tier for h, m in tier.entries.items())
    assert len(tier._lru) == len(tier.entries)
    assert not tier.cols.block_hash[tier.free_slots()].any(), "a free slot still holds a hash (commit_slots)"


def filled(capacity: int, n: int, policy=None, config: LifecycleConfig = CFG) -> TierIndex:
    tier = TierIndex(Tier.HOST, capacity, policy or LRUPolicy(), config)
    for h in range(n):
        assert tier.reserve(h, float(h)) is not None
        tier.commit(h)
    return tier


def test_two_phase_store_is_invisible_until_commit():
    tier = TierIndex(Tier.HOST, 4, LRUPolicy(), CFG)
    m = tier.reserve(7, 0.0)
    assert m is not None and not m.ready
    assert tier.get(7) is m and tier.ready(7) is None
    assert tier.reserve(7, 0.0) is None  # being written already
    tier.commit(7)
    assert tier.ready(7) is m
    assert tier.reserve(7, 0.0) is None  # here already
    check_index(tier)
    tier.reserve(8, 0.0)
    assert tier.discard(8).block_hash == 8  # a failed write
    assert tier.get(8) is None and tier.num_free() == 3
    assert tier.discard(8) is None
    check_index(tier)


def test_reserve_copies_metadata_from_the_tier_above():
    tier = TierIndex(Tier.DISK, 2, LRUPolicy(), CFG)
    src = meta(1, last_use=5.0, tier=Tier.HOST, expected_use_at_s=9.0, pinned_until_s=3.0, codec="int8",
               sla_class="gold", use_count=4, heat=2.5, heat_at_s=4.0)
    m = tier.reserve(1, 10.0, src)
    assert (m.tier, m.last_use_s, m.use_count, m.heat, m.heat_at_s) == (Tier.DISK, 5.0, 4, 2.5, 4.0)
    assert (m.expected_use_at_s, m.pinned_until_s, m.sla_class) == (9.0, 3.0, "gold")
    assert m.codec == tier.codec == "float32"  # its bytes are in this tier's format, not the one above's
    assert not m.ready


def test_unready_entries_are_never_hit_by_extend():
    bm = KVBlockManager(4, BS, clock=time.monotonic)
    host = TierIndex(Tier.HOST, 4, LRUPolicy(), CFG)
    tiers = TieredKV(bm, host, None, 100)
    host.reserve(11, 0.0)
    host.reserve(12, 0.0)
    host.commit(12)
    hit = tiers.extend([11, 12])
    assert hit.host == () and hit.waiting  # 11 is being written: wait for it, serve nothing unready
    host.commit(11)
    assert tiers.extend([11, 12]).host == (11, 12)
    assert tiers.extend([12, 11]).host == (12, 11)
    assert tiers.extend([13, 11]).host == ()  # a miss ends the run


def test_eviction_never_takes_busy_unready_or_pinned():
    tier = filled(3, 3)
    tier.entries[0].busy = 1
    tier.entries[1].pinned_until_s = 100.0
    tier.entries[2].ready = False
    assert tier.reserve(99, 50.0) is None  # nothing may go
    check_index(tier)
    tier.entries[1].pinned_until_s = 50.0  # pin over
    m = tier.reserve(99, 50.0)
    assert m is not None and m.slot == 1  # block 1's slot
    assert tier.get(1) is None and tier.evicted == [1]
    assert tier.num_evicted == 1
    assert {0, 2, 99} == set(tier.entries)
    check_index(tier)


def test_staged_entries_are_pinned_until_delivered_then_evictable_again():
    from pdserve.core.sched.stage_passes import STAGE_PIN_S, pin_staged, unpin_staged
    engine, io = tiered_engine(num_blocks=12, host=8)
    prompt = [k % 40 + 1 for k in range(4 * BS + 1)]  # 4 full blocks
    engine.add_request(prompt, greedy(1), "staged")
    while engine.has_unfinished():
        engine.step()
    drain(engine, io)
    host, now = engine.tiers.host, engine.block_manager.clock()
    hashes = pin_staged(engine.block_manager, engine.tiers, prompt)
    assert len(hashes) == 4 and all(host.get(h).pinned_until_s >= now + STAGE_PIN_S - 1 for h in hashes)
    for i in range(3):  # other prompts' write-through fills the host tier: the staged entries stay
        engine.add_request([(7 * i + 3 * k) % 45 + 2 for k in range(4 * BS + 1)], greedy(1), f"other{i}")
        while engine.has_unfinished():
            engine.step()
        drain(engine, io)
    assert all(host.get(h) is not None for h in hashes) and host.num_evicted > 0
    unpin_staged(engine.tiers, hashes)
    assert all(host.get(h).pinned_until_s == 0.0 for h in hashes)


def test_eviction_is_lru_and_a_touch_refreshes():
    tier = filled(3, 3)
    tier.touch(0, 10.0)  # 0 used again: 1 is now least recently used
    tier.reserve(3, 11.0)
    tier.commit(3)
    assert set(tier.entries) == {0, 2, 3}
    tier.reserve(4, 12.0)
    assert set(tier.entries) == {0, 3, 4}
    check_index(tier)


def test_lru_eviction_follows_the_index_order_without_scoring_a_sample():
    tier = filled(3, 3)
    tier.entries[2].last_use_s = -5.0  # a stale time stamp does not move an entry: uses and inserts do
    tier.entries[0].busy = 1
    tier.reserve(3, 11.0)
    assert set(tier.entries) == {0, 2, 3}  # 1: the first evictable entry in order
    check_index(tier)


def test_heat_policy_in_a_tier_keeps_the_shared_prefix():
    tier = filled(3, 3, HeatPolicy(120.0))
    for t in range(5):
        tier.touch(0, 3.0 + t)  # block 0 is a prefix many requests used
    tier.touch(1, 20.0)
    tier.touch(2, 21.0)  # 1 and 2 were used once each, after 0
    tier.reserve(3, 22.0)
    assert 0 in tier.entries and 1 not in tier.entries  # LRU would have taken 0


def test_reclaim_watermarks_mark_then_reserve_takes_marked_first():
    config = LifecycleConfig(eviction_sample=1000)
    tier = filled(100, 94, config=config)
    assert tier.reclaim(100.0) == 0  # below the high watermark (95): nothing marked
    tier.reserve(94, 94.0)
    tier.commit(94)
    assert tier.reclaim(100.0) == 5  # 95 -> marks down to the low watermark (90)
    marked = sorted(h for h, m in tier.entries.items() if m.reclaiming)
    assert marked == [0, 1, 2, 3, 4]
    assert tier.stage_counts(1000.0)[Stage.RECLAIM] == 5
    assert tier.reclaim(100.0) == 5  # marking twice changes nothing
    # a marked block that is hit again is no longer on its way out
    tier.touch(0, 101.0)
    assert not tier.entries[0].reclaiming and len(tier.marked()) == 4
    # reserve takes a marked block's slot before the policy's own pick
    tier.entries[50].last_use_s = -1.0
    for h in range(200, 205):  # 5 free slots first, then marked ones
        tier.reserve(h, 102.0)
    assert tier.get(50) is not None and tier.evicted == []
    tier.entries[1].busy = 1  # a marked block being read is skipped
    tier.reserve(300, 103.0)
    assert tier.get(1) is not None and tier.evicted == [2]
    check_index(tier)


@pytest.mark.parametrize("sample", [1, 4, 16, 1000])
def test_reclaim_marks_the_least_recently_used_whatever_the_sample(sample):
    tier = filled(100, 95, config=LifecycleConfig(eviction_sample=sample))
    assert tier.reclaim(100.0) == 5
    assert sorted(tier.marked()) == [0, 1, 2, 3, 4]


def test_reclaim_with_heat_marks_the_coldest_of_each_window():
    tier = filled(20, 20, HeatPolicy(120.0), LifecycleConfig(eviction_sample=4))
    for h in (0, 1, 2):
        for _ in range(3):
            tier.touch(h, 30.0)  # hot, and now the most recently used
    tier.high, tier.low = 19, 17  # mark 3
    assert tier.reclaim(31.0) == 3
    assert sorted(tier.marked()) == [3, 4, 5]


def test_reclaim_skips_busy_and_pinned():
    tier = filled(10, 10)
    for h in range(5):
        tier.entries[h].busy = 1
    tier.entries[5].pinned_until_s = 1e9
    tier.reclaim(20.0)
    marked = sorted(h for h, m in tier.entries.items() if m.reclaiming)
    assert marked == [6]  # high 9, low 9: one to mark, the first evictable
    check_index(tier)


def test_restore_respects_capacity():
    tier = TierIndex(Tier.DISK, 2, LRUPolicy(), CFG)
    assert tier.restore(meta(1, tier=Tier.DISK, slot=-1))
    assert not tier.restore(meta(1, tier=Tier.DISK, slot=-1))  # duplicate
    assert tier.restore(meta(2, tier=Tier.DISK, slot=-1))
    assert not tier.restore(meta(3, tier=Tier.DISK, slot=-1))  # full
    assert tier.ready(1) is not None and tier.ready(2) is not None and tier.get(3) is None
    check_index(tier)


Capacity = TierCapacity  # (host_blocks, disk_blocks, block_bytes[, tier codecs])


def test_build_tiered_kv_restores_the_most_recently_used_and_deletes_the_rest():
    bm = KVBlockManager(4, BS, clock=lambda: 1000.0)
    # (hash, produced-at, last use), oldest use first, as DiskKVStore.scan gives them
    restored = [(1, 0.0, 100.0), (2, 0.0, 200.0), (3, 0.0, 300.0), (4, 0.0, 400.0)]
    tiers = build_tiered_kv(bm, Capacity(4, 2, 64), LRUPolicy(), CFG, restored, wall_now=500.0)
    assert list(tiers.disk.entries) == [3, 4]  # least recently used first
    assert tiers.disk.entries[3].last_use_s == pytest.approx(1000.0 - 200.0)
    assert tiers.stale == [1, 2]
    ops = tiers.after_step()
    assert [(op.kind, set(op.hashes)) for op in ops] == [("delete", {1, 2})]
    check_index(tiers.disk)


def test_a_disk_tier_needs_a_host_tier():
    with pytest.raises(ValueError, match="needs a host tier"):
        TieredKV(KVBlockManager(4, BS, clock=time.monotonic), None, TierIndex(Tier.DISK, 4, LRUPolicy()), 64)
    with pytest.raises(ValueError, match="positive capacity"):
        TierIndex(Tier.HOST, 0, LRUPolicy())


# ---- the loopback I/O runner -----------------------------------------------------------------------------
class LoopbackIO:
    """`kv_io` for FakeExecutor: host slots and disk files are dicts of FakeExecutor slot records.

    `hold` queues operations until `release`; otherwise each runs when submitted. `fail[kind][hash]` makes
    that hash fail with that reason; `damage(hash)` spoils a disk file (a prefetch reports it "corrupt" and
    deletes it, as `DiskKVStore.read_into` does); `disk_full` makes every flush fail with "disk_full".
    """

    def __init__(self, executor: FakeExecutor, host_blocks: int, disk_blocks: int = 0,
                 restored: list | None = None) -> None:
        self.executor = executor
        self.capacity = Capacity(host_blocks, disk_blocks, 64)
        self._restored = restored or []
        self.engine: LLMEngine | None = None
        self.host: dict[int, tuple[int, tuple]] = {}  # host slot -> (hash, records)
        self.disk: dict[int, tuple] = {}  # hash -> records (None: a damaged file)
        self.gone: set[int] = set()  # files removed behind the tiers' back (found damaged, deleted by hand)
        self.queue: deque[KVOp] = deque()
        self.done: list[tuple[int, dict[int, str]]] = []
        self.hold = False
        self.fail: dict[str, dict[int, str]] = {"offload": {}, "flush": {}, "prefetch": {}}
        self.disk_full = False
        self.executed: list[tuple[str, tuple[int, ...], dict[int, str]]] = []
        self.loads: list[KVLoad] = []

    # -- the kv_io contract
    def restored(self) -> list:
        return list(self._restored)

    def submit(self, ops) -> None:
        self.queue.extend(ops)
        if not self.hold:
            self.release()

    def poll(self) -> list[tuple[int, dict[int, str]]]:
        out, self.done = self.done, []
        return out

    def load(self, loads) -> None:
        tiers = self.engine.tiers
        for ld in loads:
            h = tiers._loading[(ld.block_id, ld.host_slot)]
            meta = tiers.host.get(h)
            assert meta is not None and meta.ready and meta.busy > 0 and meta.slot == ld.host_slot
            stored_hash, records = self.host[ld.host_slot]
            assert stored_hash == h, "load from a host slot holding another block"
            self._write_block(ld.block_id, records)
        self.loads.extend(loads)

    # -- test controls
    def release(self, n: int | None = None) -> None:
        while self.queue and (n is None or n > 0):
            op = self.queue.popleft()
            failures = getattr(self, f"_{op.kind}")(op)
            self.executed.append((op.kind, op.hashes, failures))
            self.done.append((op.op_id, failures))
            n = None if n is None else n - 1

    def damage(self, h: int) -> None:
        self.disk[h] = None

    def remove(self, h: int) -> None:
        del self.disk[h]
        self.gone.add(h)

    # -- the operations
    def _block_records(self, block_id: int) -> tuple:
        bs = self.executor.block_size
        return tuple(self.executor._slots.get(block_id * bs + i) for i in range(bs))

    def _write_block(self, block_id: int, records: tuple) -> None:
        bs = self.executor.block_size
        for i, rec in enumerate(records):
            self.executor._slots[block_id * bs + i] = rec

    def _offload(self, op: KVOp) -> dict[int, str]:
        bm = self.engine.block_manager
        failures = {}
        for h, block_id, slot in zip(op.hashes, op.src, op.dst):
            # the device block is held for the copy: still registered under its hash, not reused
            assert bm.cached_block(h) == block_id and bm.ref_count(block_id) > 0
            meta = self.engine.tiers.host.get(h)
            assert meta is not None and not meta.ready and meta.slot == slot
            if h in self.fail["offload"]:
                failures[h] = self.fail["offload"][h]
                continue
            records = self._block_records(block_id)
            assert all(r is not None for r in records)
            first = records[0][0]
            assert first % self.executor.block_size == 0
            assert [r[0] for r in records] == list(range(first, first + len(records)))
            self.host[slot] = (h, records)
        return failures

    def _flush(self, op: KVOp) -> dict[int, str]:
        failures = {}
        for h, slot in zip(op.hashes, op.src):
            if self.disk_full:
                failures[h] = "disk_full"
                continue
            if h in self.fail["flush"]:
                failures[h] = self.fail["flush"][h]
                continue
            meta = self.engine.tiers.host.get(h)
            assert meta is not None and meta.ready and meta.busy > 0 and meta.slot == slot
            stored_hash, records = self.host[slot]
            assert stored_hash == h, "flush of a host slot holding another block"
            self.disk[h] = records
            self.gone.discard(h)
        return failures

    def _prefetch(self, op: KVOp) -> dict[int, str]:
        failures = {}
        for h, slot in zip(op.hashes, op.dst):
            if h in self.fail["prefetch"]:
                failures[h] = self.fail["prefetch"][h]
            elif h not in self.disk:
                failures[h] = "missing"
            elif self.disk[h] is None:
                del self.disk[h]
                self.gone.add(h)
                failures[h] = "corrupt"
            else:
                self.host[slot] = (h, self.disk[h])
        return failures

    def _delete(self, op: KVOp) -> dict[int, str]:
        for h in op.hashes:
            self.disk.pop(h, None)
        return {}


class TierFakeExecutor(FakeExecutor):
    """FakeExecutor that runs the step's host -> device loads before its forward, as ModelExecutor does."""

    def execute(self, scheduled):
        if scheduled.kv_loads or scheduled.kv_loads_ahead:
            self.kv_io.load(scheduled.kv_loads + scheduled.kv_loads_ahead)
        return super().execute(scheduled)


def tiered_engine(num_blocks: int = 12, host: int = 64, disk: int = 0, policy: str = "lru",
                  max_num_seqs: int = 8, budget: int = 10_000, restored=None) -> tuple[LLMEngine, LoopbackIO]:
    executor = TierFakeExecutor(block_size=BS, vocab_size=VOCAB)
    io = LoopbackIO(executor, host, disk, restored)
    executor.kv_io = io
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=4096)
    engine = LLMEngine(executor, cfg, num_kv_blocks=num_blocks, kv_eviction_policy=policy)
    io.engine = engine
    assert engine.tiers is not None
    return engine, io


def expected(prompt: list[int], max_tokens: int) -> list[int]:
    """What FakeExecutor samples for `prompt` served alone with correct KV."""
    oracle = FakeExecutor(block_size=BS, vocab_size=VOCAB)
    context, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(oracle.next_token(context))
        context.append(out[-1])
    return out


def check_invariants(engine: LLMEngine, io: LoopbackIO) -> None:
    bm, tiers = engine.block_manager, engine.tiers
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    assert all(bm.ref_count(b) >= 0 for b in range(bm.num_blocks))
    assert all((bm.ref_count(b) == 0) == bm.is_free(b) for b in range(bm.num_blocks))
    for tier in tiers.tiers():
        check_index(tier)
    for h, m in tiers.host.entries.items():
        if m.ready:  # a ready host entry's slot holds its bytes
            assert io.host.get(m.slot, (None,))[0] == h
    if tiers.disk is not None:
        for h, m in tiers.disk.entries.items():
            if m.ready:  # a ready disk entry has its file (maybe damaged, never deleted)
                assert h in io.disk or h in io.gone, f"disk entry {h:x} is indexed but its file was deleted"


def run_engine(engine: LLMEngine, io: LoopbackIO, outs: dict | None = None, max_steps: int = 2000,
               check: bool = True) -> dict[str, list[int]]:
    outs = {} if outs is None else outs
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        if check:
            check_invariants(engine, io)
    else:
        raise AssertionError("engine did not finish (livelock?)")
    return outs


def drain(engine: LLMEngine, io: LoopbackIO, max_steps: int = 100) -> None:
    """Run every operation to its end (including the flushes their completions start), and the loads of
    promotions due (`kv_placement`: an idle worker steps for them)."""
    for _ in range(max_steps):
        io.release()
        if (engine.tiers.num_ops_in_flight == 0 and not io.queue and not io.done
                and not engine.scheduler.has_pending_loads):
            break
        engine.step()
    else:
        raise AssertionError("tier operations never drained")


def check_quiescent(engine: LLMEngine, io: LoopbackIO) -> None:
    tiers = engine.tiers
    assert tiers.num_ops_in_flight == 0 and not tiers._loading and not engine.scheduler.has_pending_loads
    assert engine.block_manager.num_used_blocks == 0, "a device block is still held"
    for tier in tiers.tiers():
        assert all(m.busy == 0 for m in tier), f"{tier.tier}: entry left busy"
        assert all(m.ready for m in tier), f"{tier.tier}: entry left unready with nothing in flight"
    check_invariants(engine, io)


def serve(engine: LLMEngine, io: LoopbackIO, rid: str, prompt: list[int], max_tokens: int = 3):
    engine.add_request(prompt, greedy(max_tokens), request_id=rid)
    outs = run_engine(engine, io)
    final = outs[rid][-1]
    assert final.finished
    assert final.token_ids == expected(prompt, max_tokens), f"{rid}: wrong tokens"
    return final


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(length)] for _ in range(n)]


# ---- end to end: LLMEngine + FakeExecutor + LoopbackIO ------------------------------------------------------
def test_prefix_evicted_from_the_device_is_served_from_host():
    engine, io = tiered_engine(num_blocks=8, host=64)
    a, b, c = prompts(3, 17)  # 4 full blocks each (+ 1 token)
    first = serve(engine, io, "a", a)
    assert first.num_cached_tokens == 0
    serve(engine, io, "b", b)
    serve(engine, io, "c", c)
    assert engine.block_manager.find_prefix(a).block_ids == ()  # a's blocks were reused on the device
    again = serve(engine, io, "a2", a)
    assert again.num_cached_tokens == 16
    assert engine.tiers.stats.hit_tokens[Tier.HOST] == 16
    assert io.loads and engine.kv_report()["hits"]["host"] == 16
    drain(engine, io)
    check_quiescent(engine, io)


def test_partial_device_hit_continues_in_host():
    engine, io = tiered_engine(num_blocks=8, host=64)
    a, b = prompts(2, 17, seed=3)
    serve(engine, io, "a", a)
    serve(engine, io, "b", b)  # takes 5 of 8 blocks: a's tail blocks go first, its head stays
    dev = len(engine.block_manager.find_prefix(a).block_ids)
    assert 0 < dev < 4
    again = serve(engine, io, "a2", a)
    assert again.num_cached_tokens == 16
    assert engine.tiers.stats.hit_tokens[Tier.HOST] == (4 - dev) * BS
    drain(engine, io)
    check_quiescent(engine, io)


def test_host_hit_after_preemption_is_not_counted_twice():
    engine, io = tiered_engine(num_blocks=10, host=64, max_num_seqs=4)
    ps = prompts(4, 13, seed=5)
    for i, p in enumerate(ps):
        engine.add_request(p, greedy(12), request_id=f"r{i}")
    outs = run_engine(engine, io)
    assert engine.scheduler.stats.num_preemptions > 0
    for i, p in enumerate(ps):
        assert outs[f"r{i}"][-1].token_ids == expected(p, 12)
    drain(engine, io)
    check_quiescent(engine, io)


def test_disk_hit_after_the_host_is_too_small_too():
    engine, io = tiered_engine(num_blocks=8, host=6, disk=64)
    a, *others = prompts(4, 17, seed=1)
    serve(engine, io, "a", a)
    for i, p in enumerate(others):
        serve(engine, io, f"o{i}", p)
    drain(engine, io)
    ha = engine.block_manager.find_prefix(a).block_hashes
    assert all(engine.tiers.host.get(h) is None for h in ha)  # gone from host
    assert all(engine.tiers.disk.ready(h) is not None for h in ha)  # flushed down before
    again = serve(engine, io, "a2", a)
    assert again.num_cached_tokens == 16
    assert engine.tiers.stats.hit_tokens[Tier.DISK] == 16
    assert any(kind == "prefetch" for kind, _, _ in io.executed)
    drain(engine, io)
    check_quiescent(engine, io)


def test_corrupt_disk_block_is_dropped_and_recomputed():
    engine, io = tiered_engine(num_blocks=8, host=6, disk=64)
    a, *others = prompts(4, 17, seed=2)
    serve(engine, io, "a", a)
    for i, p in enumerate(others):
        serve(engine, io, f"o{i}", p)
    drain(engine, io)
    ha = engine.block_manager.find_prefix(a).block_hashes
    io.damage(ha[2])
    again = serve(engine, io, "a2", a)
    assert engine.tiers.stats.corrupt[Tier.DISK] == 1
    assert engine.kv_report()["corrupt"] == {"disk": 1}
    assert again.num_cached_tokens == 8  # the two blocks before the damaged one
    assert engine.tiers.disk.get(ha[2]) is not None  # recomputed, offloaded and flushed again
    drain(engine, io)
    assert engine.tiers.disk.ready(ha[2]) is not None and io.disk[ha[2]] is not None
    check_quiescent(engine, io)


def test_missing_disk_file_is_dropped():
    engine, io = tiered_engine(num_blocks=8, host=6, disk=64)
    a, *others = prompts(4, 17, seed=2)
    for i, p in enumerate([a] + others):
        serve(engine, io, f"r{i}", p)
    drain(engine, io)
    ha = engine.block_manager.find_prefix(a).block_hashes
    io.remove(ha[0])  # someone removed the file
    again = serve(engine, io, "a2", a)
    assert again.num_cached_tokens == 0
    assert engine.tiers.stats.failed_ops["prefetch"] >= 1 and not engine.tiers.stats.corrupt
    drain(engine, io)
    check_quiescent(engine, io)


def test_offload_in_flight_keeps_the_device_block_held():
    engine, io = tiered_engine(num_blocks=8, host=64)
    a, b, c = prompts(3, 17, seed=4)
    io.hold = True
    serve(engine, io, "a", a)
    offloads = [op for op in io.queue if op.kind == "offload"]
    assert sum(len(op.hashes) for op in offloads) == 4
    held = {b for op in offloads for b in op.src}
    bm = engine.block_manager
    assert all(bm.ref_count(b) == 1 for b in held)  # a has finished; the copy holds them
    assert bm.num_free_blocks == bm.num_blocks - 4
    ha = bm.find_prefix(a).block_hashes
    assert all(not engine.tiers.host.get(h).ready for h in ha)
    # a request needing more than the free blocks waits: the held blocks are never handed out
    engine.add_request(b + c[:8], greedy(2), request_id="big")  # 25 + 2 tokens -> 7 blocks
    for _ in range(3):
        engine.step()
        check_invariants(engine, io)
    assert engine.scheduler.num_waiting == 1 and all(bm.ref_count(b) == 1 for b in held)
    assert bm.find_prefix(a).block_ids != ()  # still a device hit too
    io.hold = False
    io.release()  # the copies run now, reading the blocks as they were
    outs = run_engine(engine, io)
    assert outs["big"][-1].token_ids == expected(b + c[:8], 2)
    dev = len(bm.find_prefix(a).block_ids)
    assert dev < 4  # big took some of a's blocks once the copies let go of them
    again = serve(engine, io, "a2", a)
    assert again.num_cached_tokens == 16 and engine.tiers.stats.hit_tokens[Tier.HOST] == (4 - dev) * BS
    drain(engine, io)
    check_quiescent(engine, io)


def test_decode_blocks_are_written_through_in_units_and_the_rest_when_the_request_ends():
    engine, io = tiered_engine(num_blocks=16, host=64)
    bm = engine.block_manager
    assert bm.offload_unit == 256 // BS  # WRITE_THROUGH_TOKENS
    bm.offload_unit = 2
    io.hold = True  # copies stay queued: each op is seen as submitted
    prompt = prompts(1, 9, seed=5)[0]  # 2 full blocks + 1 token
    engine.add_request(prompt, greedy(16), request_id="a")
    sizes = []
    while engine.has_unfinished():
        engine.step()
        sizes.append([len(op.hashes) for op in io.queue if op.kind == "offload"])
        check_invariants(engine, io)
    # the prompt's 2 blocks at once after its prefill; then decode blocks two at a time, never one alone
    # while the request runs; the 24-token sequence (9 + 15 computed) has 6 full blocks: the last 2 of
    # them form a unit too (or go when the request ends)
    assert sizes[0] == [2]
    assert sizes[-1] == [2, 2, 2] and all(s[-1] == 2 for s in sizes[1:] if s)
    bm.offload_unit = 64  # a unit longer than the decode: all of its blocks go once, when it ends
    engine.add_request(prompts(1, 9, seed=6)[0], greedy(16), request_id="b")
    counts = []
    while engine.has_unfinished():
        engine.step()
        counts.append([len(op.hashes) for op in io.queue if op.kind == "offload"][3:])
    assert counts[0] == [2] and counts[-2] == [2] and counts[-1] == [2, 4]
    io.hold = False
    drain(engine, io)
    check_quiescent(engine, io)
    again = serve(engine, io, "b2", prompts(1, 9, seed=6)[0] + [0] * 16)
    assert again.num_cached_tokens > 0


def test_prefix_being_prefetched_makes_the_request_wait_then_hit():
    engine, io = tiered_engine(num_blocks=8, host=6, disk=64)
    a, *others = prompts(4, 17, seed=1)
    for i, p in enumerate([a] + others):
        serve(engine, io, f"r{i}", p)
    drain(engine, io)
    io.hold = True
    engine.add_request(a, greedy(2), request_id="a2")
    engine.add_request(others[0][:5], greedy(2), request_id="behind")
    for _ in range(3):
        engine.step()
        check_invariants(engine, io)
    assert engine.scheduler.num_running == 0  # the head waits for its prefetch; no one overtakes it
    prefetches = [op for op in io.queue if op.kind == "prefetch"]
    assert len(prefetches) == 1  # started once, not again each step
    io.hold = False
    outs = run_engine(engine, io)
    assert outs["a2"][-1].num_cached_tokens == 16
    assert outs["a2"][-1].token_ids == expected(a, 2)
    drain(engine, io)
    check_quiescent(engine, io)


def test_disk_full_stops_flushing_and_serving_goes_on():
    engine, io = tiered_engine(num_blocks=8, host=6, disk=64)
    a, b, c, d = prompts(4, 17, seed=6)
    serve(engine, io, "a", a)
    drain(engine, io)
    assert engine.tiers.disk_writable and len(engine.tiers.disk) == 4
    io.disk_full = True
    serve(engine, io, "b", b)
    drain(engine, io)
    tiers = engine.tiers
    assert not tiers.disk_writable and tiers.stats.disk_full >= 1
    assert engine.kv_report()["disk_full"] == tiers.stats.disk_full
    assert len(tiers.disk) == 4  # the refused writes are not indexed
    flushes = sum(kind == "flush" for kind, _, _ in io.executed)
    io.disk_full = False  # even with space again, no more writes this run
    serve(engine, io, "c", c)
    serve(engine, io, "d", d)
    drain(engine, io)
    assert sum(kind == "flush" for kind, _, _ in io.executed) == flushes
    # what is on disk is still served
    again = serve(engine, io, "a2", a)
    assert again.num_cached_tokens == 16 and tiers.stats.hit_tokens[Tier.DISK] == 16
    drain(engine, io)
    check_quiescent(engine, io)


def test_failed_offload_is_dropped_and_not_served():
    engine, io = tiered_engine(num_blocks=8, host=64)
    a, b, c = prompts(3, 17, seed=8)
    ha = KVBlockManager(8, BS, clock=time.monotonic).find_prefix(a).block_hashes
    io.fail["offload"][ha[1]] = "RuntimeError: copy failed"
    serve(engine, io, "a", a)
    serve(engine, io, "b", b)
    serve(engine, io, "c", c)
    assert engine.tiers.host.get(ha[1]) is None and engine.tiers.host.ready(ha[0]) is not None
    assert engine.tiers.stats.failed_ops["offload"] == 1
    again = serve(engine, io, "a2", a)
    assert again.num_cached_tokens == 4  # only the block before the failed one
    drain(engine, io)
    check_quiescent(engine, io)


def test_restored_disk_blocks_are_served():
    # First run: serve `a`, keep its "files".
    engine, io = tiered_engine(num_blocks=8, host=6, disk=64)
    a = prompts(1, 17, seed=9)[0]
    serve(engine, io, "a", a)
    drain(engine, io)
    files = dict(io.disk)
    # Second run, same folder: only disk, nothing on the device or in host (files an hour old).
    stamp = time.time() - 3600.0
    restored = [(h, stamp, stamp) for h in files]
    engine2, io2 = tiered_engine(num_blocks=8, host=6, disk=64, restored=restored)
    io2.disk.update(files)
    again = serve(engine2, io2, "a2", a)
    assert again.num_cached_tokens == 16 and engine2.tiers.stats.hit_tokens[Tier.DISK] == 16
    drain(engine2, io2)
    check_quiescent(engine2, io2)


def _a_prompt_in_host(seed: int = 10):
    """An engine whose device pool lost prompt `a` (three prompts served through 8 blocks) and whose host
    tier keeps its first 16 tokens."""
    engine, io = tiered_engine(num_blocks=8, host=64)
    a, b, c = prompts(3, 18, seed=seed)
    for rid, p in (("a", a), ("b", b), ("c", c)):
        serve(engine, io, rid, p)
    drain(engine, io)
    return engine, io, a


def _deliver_all_but_the_last_token(engine, a: list[int], hit: int) -> None:
    """The prefill worker "delivers" the rest of the prompt but its last token, which is computed here."""
    table = engine.block_manager.block_ids("pd")
    for pos in range(hit, len(a) - 1):
        engine.executor._slots[table[pos // BS] * BS + pos % BS] = (pos, a[pos])
    engine.scheduler.kv_delivered("pd", None)


def test_reserve_kv_with_host_hits_loads_on_the_next_schedule():
    engine, io, a = _a_prompt_in_host()
    sched, bm = engine.scheduler, engine.block_manager
    assert bm.find_prefix(a).block_ids == ()
    req = engine.make_request("pd", a, greedy(3))
    hit = sched.reserve_kv(req)
    assert hit == 16 and req.status is RequestStatus.WAITING_FOR_KV
    ha = bm.find_prefix(a).block_hashes
    assert all(engine.tiers.host.get(h).busy == 1 for h in ha)  # pinned for the pending loads
    engine.step()
    loads = engine.executor.steps[-1].kv_loads_ahead  # (its KV is still on the way: nothing reads them yet)
    assert len(loads) == 4 and list(loads) == io.loads[-4:] and engine.executor.steps[-1].kv_loads == ()
    assert all(engine.tiers.host.get(h).busy == 0 for h in ha)
    _deliver_all_but_the_last_token(engine, a, hit)
    outs = run_engine(engine, io)
    assert outs["pd"][-1].token_ids == expected(a, 3)
    drain(engine, io)
    check_quiescent(engine, io)


def test_a_reservations_host_hits_load_ahead_in_budgeted_steps_and_the_rest_with_its_first_step():
    """`ahead_load_blocks` = 3: a reservation's 4 host hits load 3 in the next step (ahead: nothing reads them);
    its KV lands before the fourth: that one loads in the step that first reads the request, and the
    output is the same as computing it all."""
    engine, io, a = _a_prompt_in_host()
    sched = engine.scheduler
    sched.ahead_load_blocks = 3
    req = engine.make_request("pd", a, greedy(3))
    hit = sched.reserve_kv(req)
    assert hit == 16
    engine.step()
    step = engine.executor.steps[-1]
    assert len(step.kv_loads_ahead) == 3 and step.kv_loads == () and not step.chunks
    assert sched.has_pending_loads
    _deliver_all_but_the_last_token(engine, a, hit)
    engine.step()
    step = engine.executor.steps[-1]
    assert len(step.kv_loads) == 1 and step.kv_loads_ahead == () and [c.request_id for c in step.chunks] == ["pd"]
    assert not sched.has_pending_loads
    outs = run_engine(engine, io)
    assert outs["pd"][-1].token_ids == expected(a, 3)
    drain(engine, io)
    check_quiescent(engine, io)


def test_a_delivered_request_ending_before_its_host_hits_loaded_drops_them():
    """Its KV lands with a first token that ends it while one host hit is still to load: that load is
    dropped (its host entry unpinned), never written into the freed blocks another request may take."""
    engine, io, a = _a_prompt_in_host()
    sched = engine.scheduler
    sched.ahead_load_blocks = 3
    req = engine.make_request("pd", a, greedy(1))
    assert sched.reserve_kv(req) == 16
    engine.step()
    assert sched.has_pending_loads
    loaded = len(io.loads)
    done = sched.kv_delivered("pd", 7)  # max_tokens 1: the first token ends it
    assert done.is_finished and not sched.has_pending_loads
    engine.step()
    assert len(io.loads) == loaded and engine.executor.steps[-1].kv_loads == ()
    drain(engine, io)
    check_quiescent(engine, io)


def test_aborting_a_reservation_drops_its_loads_and_unpins():
    engine, io = tiered_engine(num_blocks=8, host=64)
    a, b, c = prompts(3, 17, seed=11)
    for rid, p in (("a", a), ("b", b), ("c", c)):
        serve(engine, io, rid, p)
    drain(engine, io)
    sched, bm = engine.scheduler, engine.block_manager
    ha = bm.find_prefix(a).block_hashes
    req = engine.make_request("pd", a, greedy(3))
    assert sched.reserve_kv(req) == 16
    assert all(engine.tiers.host.get(h).busy == 1 for h in ha)
    engine.abort(["pd"])
    assert all(engine.tiers.host.get(h).busy == 0 for h in ha)
    assert not engine.tiers._loading and bm.num_used_blocks == 0
    engine.step()
    assert engine.executor.steps[-1].kv_loads == engine.executor.steps[-1].kv_loads_ahead == ()
    # and kv_failed does the same
    req = engine.make_request("pd2", a, greedy(3))
    assert sched.reserve_kv(req) == 16
    sched.kv_failed("pd2")
    assert all(engine.tiers.host.get(h).busy == 0 for h in ha) and not engine.tiers._loading
    outs = run_engine(engine, io)  # recomputed here (its prefix from host again)
    assert outs["pd2"][-1].token_ids == expected(a, 3)
    drain(engine, io)
    check_quiescent(engine, io)


def test_prefix_on_disk_longer_than_the_host_is_served_not_livelocked():
    # 2-block prefill chunks, so all 6 full blocks of a 25-token prompt pass through a 4-slot host to disk
    engine, io = tiered_engine(num_blocks=12, host=4, disk=64, budget=8)
    a, b, c = prompts(3, 25, seed=12)
    for rid, p in (("a", a), ("b", b), ("c", c)):
        serve(engine, io, rid, p)
    drain(engine, io)
    ha = engine.block_manager.find_prefix(a).block_hashes
    assert engine.block_manager.find_prefix(a).block_ids == ()
    assert all(engine.tiers.disk.ready(h) is not None for h in ha)
    again = serve(engine, io, "a2", a)  # as much as the host holds comes from disk, the rest is recomputed
    assert again.num_cached_tokens == 16 and engine.tiers.stats.hit_tokens[Tier.DISK] == 16
    assert sum(kind == "prefetch" for kind, _, _ in io.executed) == 1
    drain(engine, io)
    check_quiescent(engine, io)


def lower_tiers(host_cap: int, disk_cap: int = 16) -> TieredKV:
    bm = KVBlockManager(4, BS, clock=lambda: 100.0)
    return TieredKV(bm, TierIndex(Tier.HOST, host_cap, LRUPolicy(), CFG),
                    TierIndex(Tier.DISK, disk_cap, LRUPolicy(), CFG), 64)


def put(tier: TierIndex, h: int, last_use: float) -> BlockMeta:
    m = tier.reserve(h, last_use)
    tier.commit(h)
    return m


def test_a_prefetch_never_evicts_the_prefix_it_continues():
    tiers = lower_tiers(4)
    put(tiers.host, 1, 0.0)  # the prefix's first block, least recently used of all
    put(tiers.host, 50, 10.0)
    put(tiers.host, 51, 10.0)
    put(tiers.disk, 2, 0.0)
    put(tiers.disk, 3, 0.0)
    hit = tiers.extend([1, 2, 3])
    assert hit.waiting and hit.host == (1,)
    (op,) = tiers.after_step()
    assert op.kind == "prefetch" and op.hashes == (2, 3)
    assert tiers.host.get(1) is not None and tiers.host.get(50) is None  # 50 went, not the prefix's head
    assert tiers.host.entries[1].busy == 0
    tiers.complete(op.op_id)
    assert tiers.extend([1, 2, 3]) == TierHit((1, 2, 3), False)
    check_index(tiers.host)


def test_no_host_room_for_a_prefetch_serves_the_host_run_without_waiting():
    tiers = lower_tiers(2)
    put(tiers.host, 1, 0.0)
    put(tiers.host, 9, 0.0).busy = 1  # being flushed
    put(tiers.disk, 2, 0.0)
    hit = tiers.extend([1, 2])
    assert hit.host == (1,) and not hit.waiting  # never wait for something that was not started
    assert tiers.after_step() == [] and tiers.num_ops_in_flight == 0
    assert tiers.host.entries[1].busy == 0 and tiers.host.entries[9].busy == 1
    tiers.host.entries[9].busy = 0  # room again: now it is fetched
    hit = tiers.extend([1, 2])
    assert hit.waiting and [op.kind for op in tiers.after_step()] == ["prefetch"]


@pytest.mark.parametrize("policy", ["lru", "heat"])
def test_shared_prefixes_many_requests_match_reference(policy):
    engine, io = tiered_engine(num_blocks=16, host=10, disk=40, policy=policy, max_num_seqs=4, budget=24)
    rng = random.Random(13)
    heads = prompts(3, 12, seed=14)
    reqs, outs = {}, {}
    for i in range(24):
        p = rng.choice(heads) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 10))]
        reqs[f"r{i}"] = (p, rng.randrange(1, 6))
        engine.add_request(p, greedy(reqs[f"r{i}"][1]), request_id=f"r{i}")
        if i % 3 == 0:
            io.hold = not io.hold
            if not io.hold:
                io.release()
        for _ in range(rng.randrange(3)):
            for o in engine.step():
                outs.setdefault(o.request_id, []).append(o)
            check_invariants(engine, io)
    io.hold = False
    run_engine(engine, io, outs)
    for rid, (p, n) in reqs.items():
        assert outs[rid][-1].token_ids == expected(p, n), rid
    assert sum(engine.tiers.stats.hit_tokens.values()) > 0
    drain(engine, io)
    check_quiescent(engine, io)


# ---- randomized: requests, aborts, steps, delayed and failed operations ----------------------------------
class Driver:
    """A tiered engine under random load. After every step: the invariants; every output a prefix of the
    reference tokens. At the end: everything finishes, every operation drains, nothing is left held."""

    def __init__(self, num_blocks: int, host: int, disk: int, policy: str, seed: int) -> None:
        self.engine, self.io = tiered_engine(num_blocks=num_blocks, host=host, disk=disk, policy=policy,
                                             max_num_seqs=4, budget=16)
        rng = random.Random(seed)
        root = [rng.randrange(VOCAB) for _ in range(8)]  # two blocks every head shares
        self.heads = [root + [rng.randrange(VOCAB) for _ in range(8)] for _ in range(4)]
        self.head_hashes = [KVBlockManager(1, BS, clock=time.monotonic).find_prefix(h + [0]).block_hashes for h in self.heads]
        self.reqs: dict[str, tuple[list[int], int]] = {}
        self.reserved: dict[str, int] = {}  # WAITING_FOR_KV request -> prompt tokens it had here
        self.ended: set[str] = set()
        self.n = 0

    def add(self, head: int, tail: int, max_tokens: int, suffix_seed: int, reserve: bool = False) -> None:
        """A prompt: 2, 3 or 4 blocks of head `head` then `tail` tokens; head 4 and up: fresh tokens only."""
        rng = random.Random(suffix_seed)
        start = self.heads[head][:8 + 4 * (suffix_seed % 3)] if head < len(self.heads) else []
        p = start + [rng.randrange(VOCAB) for _ in range(tail if start else 8 + tail)]
        rid = f"r{self.n}"
        self.n += 1
        if not reserve:
            self.reqs[rid] = (p, max_tokens)
            self.engine.add_request(p, greedy(max_tokens), request_id=rid)
            return
        hit = self.engine.scheduler.reserve_kv(self.engine.make_request(rid, p, greedy(max_tokens)))
        if hit is not None and hit != LOOKING:  # (LOOKING: its prefix is on its way from disk; not reserved)
            assert hit % BS == 0 and hit < len(p)
            self.reqs[rid] = (p, max_tokens)
            self.reserved[rid] = hit

    def reserve(self, head: int, tail: int, max_tokens: int, suffix_seed: int) -> None:
        """The decode side of PD: reserve blocks for a request whose KV another worker delivers."""
        self.add(head, tail, max_tokens, suffix_seed, reserve=True)

    def deliver(self, which: int, with_first_token: bool, fail: bool = False) -> None:
        """The prefill worker delivers a reserved request's KV (all but what was a hit here), or fails."""
        if not self.reserved:
            return
        rid = sorted(self.reserved)[which % len(self.reserved)]
        hit = self.reserved.pop(rid)
        if fail:
            self.engine.scheduler.kv_failed(rid)
            return
        p, n = self.reqs[rid]
        table = self.engine.block_manager.block_ids(rid)
        for pos in range(hit, len(p) - (not with_first_token)):
            self.engine.executor._slots[table[pos // BS] * BS + pos % BS] = (pos, p[pos])
        req = self.engine.scheduler.kv_delivered(rid, expected(p, 1)[0] if with_first_token else None)
        if req.is_finished:  # its one token came with the KV
            assert req.output_token_ids == expected(p, n)
            self.ended.add(rid)

    def abort(self, which: int) -> None:
        live = sorted(self.engine.scheduler.requests)
        if live:
            rid = live[which % len(live)]
            self.engine.abort([rid])
            self.ended.add(rid)
            self.reserved.pop(rid, None)

    def step(self) -> None:
        for o in self.engine.step():
            assert o.request_id not in self.ended, "output after the end"
            if o.finished:
                self.ended.add(o.request_id)
            p, n = self.reqs[o.request_id]
            assert o.token_ids == expected(p, n)[:len(o.token_ids)], f"{o.request_id}: wrong KV served"
            if o.finish_reason == "length":
                assert len(o.token_ids) == n
        check_invariants(self.engine, self.io)

    def fail(self, kind: str, head: int, block: int, reason: str) -> None:
        self.io.fail[kind][self.head_hashes[head][block]] = reason

    def heal(self) -> None:
        for fails in self.io.fail.values():
            fails.clear()

    def damage(self, which: int) -> None:
        files = sorted(h for h, rec in self.io.disk.items() if rec is not None)
        if files:
            self.io.damage(files[which % len(files)])

    def finish(self) -> None:
        self.io.hold = False
        self.heal()
        while self.reserved:
            self.deliver(0, with_first_token=len(self.reserved) % 2 == 0)
        for _ in range(3000):
            if not self.engine.has_unfinished():
                break
            self.step()
        else:
            raise AssertionError("engine did not finish (livelock?)")
        assert self.ended == set(self.reqs)
        drain(self.engine, self.io)
        check_quiescent(self.engine, self.io)


@pytest.mark.parametrize("seed", range(24))
def test_random_load_never_serves_wrong_kv_and_leaks_nothing(seed):
    rng = random.Random(seed)
    d = Driver(num_blocks=rng.randrange(8, 20), host=rng.randrange(2, 16), disk=rng.choice([0, 6, 12, 40]),
               policy=rng.choice(["lru", "heat"]), seed=seed)
    for _ in range(600):
        x = rng.random()
        if x < 0.25:
            d.add(rng.randrange(6), rng.randrange(10), rng.randrange(1, 7), rng.randrange(1000))
        elif x < 0.30:
            d.abort(rng.randrange(100))
        elif x < 0.35:
            d.io.hold = not d.io.hold
        elif x < 0.42:
            d.io.release(rng.randrange(1, 4))
        elif x < 0.45:
            d.fail(rng.choice(["offload", "flush", "prefetch"]), rng.randrange(4), rng.randrange(4),
                   rng.choice(["corrupt", "missing", "disk_full", "EIO"]))
        elif x < 0.48:
            d.heal()
        elif x < 0.50:
            d.damage(rng.randrange(100))
        elif x < 0.55:
            d.reserve(rng.randrange(6), rng.randrange(10), rng.randrange(1, 7), rng.randrange(1000))
        elif x < 0.58:
            d.deliver(rng.randrange(100), rng.random() < 0.5, fail=rng.random() < 0.2)
        else:
            d.step()
    d.finish()


class TieredEngineMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(8, 20), host=st.integers(1, 12), disk=st.sampled_from([0, 4, 10, 40]),
                policy=st.sampled_from(["lru", "heat"]), seed=st.integers(0, 2**16))
    def setup(self, num_blocks, host, disk, policy, seed):
        self.d = Driver(num_blocks, host, disk, policy, seed)

    @rule(head=st.integers(0, 5), tail=st.integers(0, 9), max_tokens=st.integers(1, 6),
          suffix_seed=st.integers(0, 1000))
    def add(self, head, tail, max_tokens, suffix_seed):
        self.d.add(head, tail, max_tokens, suffix_seed)

    @rule(head=st.integers(0, 5), tail=st.integers(0, 9), max_tokens=st.integers(1, 6),
          suffix_seed=st.integers(0, 1000))
    def reserve(self, head, tail, max_tokens, suffix_seed):
        self.d.reserve(head, tail, max_tokens, suffix_seed)

    @rule(which=st.integers(0, 100), with_first_token=st.booleans(), fail=st.booleans())
    def deliver(self, which, with_first_token, fail):
        self.d.deliver(which, with_first_token, fail)

    @rule(which=st.integers(0, 100))
    def abort(self, which):
        self.d.abort(which)

    @rule(times=st.integers(1, 4))
    def step(self, times):
        for _ in range(times):
            self.d.step()

    @rule(hold=st.booleans())
    def set_hold(self, hold):
        self.d.io.hold = hold

    @rule(n=st.integers(1, 3))
    def release(self, n):
        self.d.io.release(n)

    @rule(kind=st.sampled_from(["offload", "flush", "prefetch"]), head=st.integers(0, 3),
          block=st.integers(0, 3), reason=st.sampled_from(["corrupt", "missing", "disk_full", "EIO"]))
    def fail(self, kind, head, block, reason):
        self.d.fail(kind, head, block, reason)

    @rule()
    def heal(self):
        self.d.heal()

    @rule(which=st.integers(0, 100))
    def damage(self, which):
        self.d.damage(which)

    @invariant()
    def consistent(self):
        if hasattr(self, "d"):
            check_invariants(self.d.engine, self.d.io)

    def teardown(self):
        if hasattr(self, "d"):
            self.d.finish()


TieredEngineMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=50, deadline=None,
                                                 suppress_health_check=list(HealthCheck))
test_tiered_engine_machine = TieredEngineMachine.TestCase


def test_commit_slots_commits_only_slots_still_holding_their_hash():
    import numpy as np
    tier = TierIndex(Tier.HOST, 4, LRUPolicy())
    hashes = np.array([11, 12, 13], np.uint64)
    booked, slots, _ = tier.reserve_many(hashes, 0.0)
    assert len(booked) == 3 and tier.ready(11) is None  # written, not yet visible
    tier.discard(12)  # a failed write: its slot is free ...
    tier.reserve(99, 0.0)  # ... and maybe someone else's already
    tier.commit_slots(hashes, slots)
    assert tier.ready(11) is not None and tier.ready(13) is not None
    assert tier.get(12) is None and tier.ready(99) is None  # neither the dropped hash nor the slot's new owner
    check_index(tier)


@pytest.mark.parametrize("sealed", [False, True])
def test_a_secret_requests_blocks_never_reach_an_unsealed_disk(sealed):
    """A `secret`-labelled request's KV is copied to host like any other, but written to the disk tier only
    when its files are sealed (`--kv-disk-key-file`); otherwise kept off it, counted (issue 40)."""
    engine, io = tiered_engine(num_blocks=8, host=64, disk=64)
    engine.tiers.disk_sealed = sealed
    secret, plain = prompts(2, 17, seed=11)
    engine.scheduler.add_request(engine.make_request("s", secret, greedy(3), sensitivity="secret"))
    outs = run_engine(engine, io)
    assert outs["s"][-1].token_ids == expected(secret, 3)
    serve(engine, io, "p", plain)
    drain(engine, io)
    hashes = lambda p: KVBlockManager(8, BS, clock=time.monotonic).find_prefix(p).block_hashes  # noqa: E731
    assert all(h in io.disk for h in hashes(plain))
    on_disk = [h in io.disk for h in hashes(secret)]
    assert all(h in engine.tiers.host.entries for h in hashes(secret))  # host holds them either way
    if sealed:
        assert all(on_disk) and engine.tiers.stats.secret_off_disk == 0
    else:
        assert not any(on_disk) and engine.tiers.stats.secret_off_disk >= len(on_disk) == 4
        assert engine.kv_report()["secret_off_disk"] == engine.tiers.stats.secret_off_disk


def test_a_reservation_whose_prefix_is_read_from_disk_is_passed_over_not_reported_short_of_room():
    """A decode worker's books (`DecodeBooks`): a reservation whose prefix is on disk only waits for its prefetch
    (`kv_reservations.LOOKING`) without holding up the next one or being reported as waiting for room (which
    would have the gateway stage its prompt elsewhere); once the blocks are in host it is granted, with them."""
    from pdserve.core.pd.decode_books import DecodeBooks
    engine, io = tiered_engine(num_blocks=8, host=6, disk=64)
    a, b = prompts(2, 17, seed=21)
    serve(engine, io, "a", a)
    drain(engine, io)
    files = dict(io.disk)
    stamp = time.time() - 60.0
    engine2, io2 = tiered_engine(num_blocks=12, host=6, disk=64, restored=[(h, stamp, stamp) for h in files])
    io2.disk.update(files)  # (room for both reservations: 5 blocks each)
    books = DecodeBooks(engine2.scheduler, BS)
    books.reserve(engine2.make_request("a", a, greedy(3)), "a#0")
    books.reserve(engine2.make_request("b", b, greedy(3)), "b#0")
    granted = books.grant()
    assert [g.reservation.xfer for g in granted] == ["b#0"] and books.newly_waiting() == []
    for _ in range(50):  # the prefetch runs (the engine steps for b meanwhile)
        io2.release()
        engine2.step()
        granted = books.grant()
        if granted:
            break
    assert [g.reservation.xfer for g in granted] == ["a#0"] and granted[0].first_block == 4  # its 16 tokens read
