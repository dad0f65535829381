"""The KV lifecycle of one worker: the metadata its blocks carry, set from what the worker sees, and the
stage-driven placement that reads it. One copy for both clocks: the real engine and the simulator's build it
the same way (`LLMEngine`), and the scheduler calls it.

Set here (every placement):
* `expected_use_at_s` and `pattern`: when a request's use of its blocks ends (`ended`), `PrefixPatterns` says
  when its prefix is expected back (its conversation's think time); that and its pattern are written on its
  blocks in every tier (`expect`). After `late_s` with no reuse, its blocks not used since become ONE_OFF and
  lose their expected use (`_lapse`). A decode worker may also be told a delivered request's predicted
  consumption (`Scheduler.expect_kv`).
* `sla_class`: the scheduler registers blocks with the request's service tier (`KVBlockManager`).

Placement (`--kv-placement`, `PLACEMENTS`):
* `write-through`: copies down as each block is produced (`pdserve.core.kvstore.kv_tiers`), eviction by
  `--kv-eviction-policy`, nothing moves up before a request asks for it.
* `staged`: copies down the same way (so eviction never waits for a copy), and the stages drive the rest:
  - prefetch ahead of an expected use, for a prefix whose pattern comes back at least PREFETCH_MIN_P of the
    time: its disk-only blocks are read into host, then its host blocks are loaded into free device blocks (at
    most `num_blocks // PROMOTE_SHARE` per prefix) beside a step's forward (`take_loads`). A move into a tier
    is made only when the block should still be there when the use comes: the spread of the expected use
    (`spread_s`, its think times' interquartile range) is within the tier's residency (how long the blocks it
    evicts lately went unused, `residency_s`; a tier that evicted nothing yet keeps what it has anyway). It
    is made ahead of the earliest likely use: PREFETCH_LEAD_S for a disk read, PROMOTE_LEAD_S for a load;
  - decay demotes and eviction orders by class and expected use: `kv_meta.StagedPolicy` in every tier, its
    per-pattern reuse chances kept current from `PrefixPatterns.reuse_p`;
  - reclaim as with write-through (watermarks mark the lowest-scoring).
Counted (`PlacementStats`): promotions and demotions per stage and tier pair, blocks dropped with no copy
below, prefetched blocks used (a request read them) and wasted (evicted or lapsed unread).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

import numpy as np

from pdserve.core.kvstore.block_manager import KVBlockManager
from pdserve.core.kvstore.kv_meta import PATTERNS, Pattern, StagedPolicy, Tier
from pdserve.core.kvstore.kv_ops import KVLoad, PlacementStats
from pdserve.core.kvstore.prefix_patterns import Expectation, PrefixPatterns
from pdserve.core.request import STAGE

PLACEMENTS = ("write-through", "staged")
PREFETCH_LEAD_S = 5.0  # disk -> host may start this long before the earliest likely use
PROMOTE_LEAD_S = 1.0  # host -> device this long before it (at a step boundary: an idle worker steps for it)
PREFETCH_MIN_P = 0.4  # a prefix is moved up ahead of its use only if its pattern comes back this often
PROMOTE_SHARE = 8  # one prefix takes at most 1/PROMOTE_SHARE of the device pool ahead of its use
RESIDENCY_ALPHA = 0.05  # weight of each eviction in a tier's residency (an exponential average)


class KVLifecycle:
    def __init__(self, blocks: KVBlockManager, tiers=None, placement: str = "write-through") -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"unknown KV placement {placement!r}; choose from {PLACEMENTS}")
        self.blocks, self.tiers = blocks, tiers  # tiers: a `TieredKV` or None
        self.staged = placement == "staged"
        self.patterns = PrefixPatterns()
        self.stats = tiers.moves if tiers is not None else PlacementStats()
        self._lapses: list = []  # heap of (at_s, seq, "lapse", expectation)
        self._moves: list = []  # heap of (at_s, seq, "prefetch" | "promote", expectation): wake an idle engine
        self._seq = itertools.count()
        self._promotions: list[Expectation] = []  # host -> device, allocated by the next step (`take_loads`)
        self._loading: dict[str, tuple[list[KVLoad], np.ndarray, np.ndarray]] = {}  # emitted, not done
        self._holders = itertools.count()
        self.policy = blocks.eviction if isinstance(blocks.eviction, StagedPolicy) else None
        self.residency_s: dict[Tier, float] = {}  # per tier: how long the blocks it evicted lately went unused
        blocks.on_evict = self._device_evicted
        if tiers is not None:
            tiers.host.on_evict = self._host_evicted
            tiers.lifecycle = self  # its after_step runs what is due (also inside a simulated fast-forward)

    # ---- the scheduler's events --------------------------------------------------------------------------
    def arrived(self, request_id: str, prompt_hashes: Sequence[int], now: float) -> None:
        if not request_id.endswith(STAGE) and prompt_hashes:
            if self.patterns.arrived(request_id, prompt_hashes, now) is not None:
                self._learnt()

    def ended(self, request_id: str, hashes: Sequence[int], num_prompt_blocks: int, now: float) -> None:
        """`request_id` finished its use of its blocks (`hashes`: its registered full blocks)."""
        if request_id.endswith(STAGE):
            return
        e = self.patterns.ended(request_id, hashes, num_prompt_blocks, now)
        if e is None:
            return
        self.expect(e.hashes, e.expected_s, e.pattern)
        if e.late_s is not None:
            self._at(e.late_s, "lapse", e)
        if self.staged and e.expected_s is not None and self.tiers is not None and e.reuse_p >= PREFETCH_MIN_P:
            if self.tiers.disk is not None and e.spread_s <= self.residency_s.get(Tier.HOST, math.inf):
                self._at(max(e.early_s - PREFETCH_LEAD_S, now), "prefetch", e)
            if e.spread_s <= self.residency_s.get(Tier.DEVICE, math.inf):
                self._at(max(e.early_s - PROMOTE_LEAD_S, now), "promote", e)

    def forget(self, request_id: str) -> None:
        self.patterns.forget(request_id)

    def expect(self, hashes, at_s: float | None, pattern: Pattern | None = None) -> None:
        """The blocks of `hashes` (in any tier) are expected back at `at_s` (None: no longer expected)."""
        keys = np.asarray(hashes, np.uint64)
        value = math.nan if at_s is None else at_s
        code = None if pattern is None else PATTERNS.index(pattern.value)
        for cols, slots in self._where(keys):
            cols.expected_use_at_s[slots] = value
            if code is not None:
                cols.pattern[slots] = code
        if at_s is not None and self.staged and self.tiers is not None:  # wanted again: not on its way out
            for tier in self.tiers.tiers():
                tier.unmark(tier.present(keys))

    # ---- due work -------------------------------------------------------------------------------------------
    def next_due_s(self) -> float:
        return min(self._lapses[0][0] if self._lapses else math.inf, self.next_wake_s())

    def next_wake_s(self) -> float:
        """When moves are due (an idle engine wakes for them; a lapse can wait for its next boundary)."""
        return self._moves[0][0] if self._moves else math.inf

    def run_due(self, now: float) -> None:
        for heap in (self._lapses, self._moves):
            while heap and heap[0][0] <= now:
                _, _, kind, e = heapq.heappop(heap)
                getattr(self, f"_{kind}")(e, now)

    def _at(self, t: float, kind: str, e: Expectation) -> None:
        heapq.heappush(self._lapses if kind == "lapse" else self._moves, (t, next(self._seq), kind, e))

    def _current(self, e: Expectation) -> bool:
        """The prefix still waits for the use `e` predicted (not moved on, not back already)."""
        rec = self.patterns.record(e.key)
        return rec is not None and rec.ended_s == e.ended_s and (rec.reused_s or -math.inf) < e.ended_s

    def _lapse(self, e: Expectation, now: float) -> None:
        if self.patterns.lapsed(e.key, e.ended_s) is None:
            return
        self._learnt()
        code = PATTERNS.index(Pattern.ONE_OFF.value)
        for cols, slots in self._where(np.asarray(e.hashes, np.uint64)):
            idle = slots[cols.last_use_s[slots] <= e.ended_s]  # (not the blocks another prefix used since)
            cols.pattern[idle] = code
            cols.expected_use_at_s[idle] = math.nan
            self._wasted(cols, idle)

    def _prefetch(self, e: Expectation, now: float) -> None:
        """Disk -> host for the prefix's blocks only on disk (the host -> device move is due on its own)."""
        if not self._current(e):
            return
        tiers = self.tiers
        keys = np.asarray(e.hashes, np.uint64)
        todo = keys[(self.blocks.cached_ids(keys) < 0) & (tiers.host.present_mask(keys) == 0)
                    & (tiers.disk.present_mask(keys) == 1)]
        if len(todo):  # (the prefix's blocks already in host stay while room is made for the rest)
            keep = [tiers.host.cols.view(s) for s in tiers.host.present(keys).tolist()]
            self.stats.prefetch["issued"] += tiers.prefetch_ahead(todo.tolist(), keep)

    def _learnt(self) -> None:
        """An expectation was met or lapsed: the policy's per-pattern reuse chances follow."""
        if self.policy is not None:
            self.policy.reuse_p[:] = [self.patterns.reuse_p(Pattern(name)) for name in PATTERNS]

    def _promote(self, e: Expectation, now: float) -> None:
        if self._current(e):
            self._promotions.append(e)  # allocated by the next step: never inside a fast-forwarded window

    # ---- promotions' loads (beside a step's forward) ------------------------------------------------------
    @property
    def has_loads(self) -> bool:
        return bool(self._promotions)

    def take_loads(self, budget: int | None) -> list[KVLoad]:
        """Host -> device loads of the due promotions (the prefix's host blocks not on the device, into free
        device blocks held until the step ran), whole prefixes while they fit in `budget` blocks (None: all;
        at least one prefix per call)."""
        out: list[KVLoad] = []
        host = self.tiers.host
        while self._promotions:
            keys = np.asarray(self._promotions[0].hashes, np.uint64)
            keys = keys[(self.blocks.cached_ids(keys) < 0) & (host.present_mask(keys) == 1)]
            keys = keys[:self.blocks.num_blocks // PROMOTE_SHARE]
            if out and budget is not None and len(out) + len(keys) > budget:
                break
            self._promotions.pop(0)
            holder = f"promote:{next(self._holders)}"
            ids = self.blocks.allocate(holder, len(keys) * self.blocks.block_size) if len(keys) else None
            if ids is None:
                continue
            loads = self.tiers.promote(keys, ids)
            self._loading[holder] = (loads, keys, np.array([ld.host_slot for ld in loads], np.int64))
            self.stats.prefetch["issued"] += len(keys)
            out += loads
        return out

    def loads_done(self) -> None:
        """The step that carried the emitted promotions ran: their blocks join the prefix cache."""
        host = self.tiers.host if self.tiers is not None else None
        for holder, (loads, keys, slots) in self._loading.items():
            ids = np.array([ld.block_id for ld in loads], np.int64)
            live = host.cols.block_hash[slots] == keys  # (still the entry that was read)
            host.cols.prefetched[slots[live]] = False  # (moved on up: the device copy carries the flag)
            adopted = self.blocks.adopt(ids[live], keys[live], host.cols, slots[live])
            self.blocks.free(holder)
            self.stats.moves[("promotion", "decay", Tier.HOST.value, Tier.DEVICE.value)] += adopted
            self.stats.prefetch["wasted"] += len(keys) - adopted  # (found cached meanwhile, or gone)
        self._loading.clear()

    # ---- counted moves --------------------------------------------------------------------------------------
    def _device_evicted(self, ids: np.ndarray, stages: np.ndarray) -> None:
        """Registered device blocks leave the prefix cache (reused for other KV); `stages` their stage names."""
        self._resided(Tier.DEVICE, self.blocks.cols, ids)
        below = self.tiers.host.present_mask(self.blocks.cols.block_hash[ids]) == 1 if self.tiers else None
        self._count_out(self.blocks.cols, ids, stages, Tier.DEVICE, Tier.HOST, below)

    def _host_evicted(self, slots: np.ndarray, stages: np.ndarray) -> None:
        tiers = self.tiers
        self._resided(Tier.HOST, tiers.host.cols, slots)
        below = tiers.disk.present_mask(tiers.host.cols.block_hash[slots]) == 1 if tiers.disk is not None else None
        self._count_out(tiers.host.cols, slots, stages, Tier.HOST, Tier.DISK, below)

    def _resided(self, tier: Tier, cols, slots: np.ndarray) -> None:
        """Blocks evicted from `tier` had gone unused this long: the tier's residency follows."""
        idle = float(np.mean(self.blocks.clock() - cols.last_use_s[slots]))
        old = self.residency_s.get(tier)
        weight = 1.0 - (1.0 - RESIDENCY_ALPHA) ** len(slots)
        self.residency_s[tier] = idle if old is None else old + weight * (idle - old)

    def _count_out(self, cols, slots, stages, src: Tier, dst: Tier, below) -> None:
        for stage in np.unique(stages).tolist():
            mine = stages == stage
            kept = int(np.count_nonzero(mine & below)) if below is not None else 0
            if kept:
                self.stats.moves[("demotion", stage, src.value, dst.value)] += kept
            if int(np.count_nonzero(mine)) - kept:
                self.stats.moves[("drop", stage, src.value, "none")] += int(np.count_nonzero(mine)) - kept
        self._wasted(cols, slots)

    def _wasted(self, cols, slots: np.ndarray) -> None:
        flagged = slots[cols.prefetched[slots]]
        if len(flagged):
            self.stats.prefetch["wasted"] += len(flagged)
            cols.prefetched[flagged] = False

    def _where(self, keys: np.ndarray):
        """(columns, slots) of the blocks of `keys` in each tier that holds some."""
        ids = self.blocks.cached_ids(keys)
        out = [(self.blocks.cols, ids[ids >= 0])]
        if self.tiers is not None:
            out += [(t.cols, t.present(keys)) for t in self.tiers.tiers()]
        return [(cols, slots) for cols, slots in out if len(slots)]

    def report(self) -> dict:
        self.stats.prefetch["used"] += self.blocks.take_prefetch_used()
        return {**self.stats.report(), "patterns": dict(self.patterns.counts),
                "reuse_p": {name: round(self.patterns.reuse_p(Pattern(name)), 4) for name in PATTERNS},
                "residency_s": {t.value: round(r, 3) for t, r in self.residency_s.items()}}
