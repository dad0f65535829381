"""Bookkeeping of one lower KV tier (host memory or disk): which block hashes it holds, where, and their
metadata. Pure Python: the bytes live in `pdserve.kv` (a host tensor, files) and move on an I/O thread.

Two-phase stores: `reserve` books a slot for a hash (the entry exists but is not `ready`, so no lookup
hits it), the bytes are written, then `commit` makes it visible or `discard` drops it. Eviction happens in
two places: when usage passes `high_watermark`, `reclaim(now)` marks the lowest-scoring blocks RECLAIM
down to `low_watermark` (still servable: a hit takes one back); `reserve` takes its slot from a marked block
first, then from the policy's pick. Blocks being read (`busy`), being written, or pinned are never taken.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Iterator

from pdserve.core.kv_meta import BlockMeta, EvictionPolicy, LifecycleConfig, LRUPolicy, Tier, pick_victim, stage_of


RECLAIM_INTERVAL_S = 1.0  # watermark marking runs at most this often (it walks the LRU order)


class TierIndex:
    def __init__(self, tier: Tier, capacity_blocks: int, policy: EvictionPolicy,
                 config: LifecycleConfig | None = None, high_watermark: float = 0.95,
                 low_watermark: float = 0.90) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"{tier.value} tier needs a positive capacity, got {capacity_blocks} blocks")
        self.tier = tier
        self.capacity = capacity_blocks
        self.policy = policy
        self.config = config or LifecycleConfig()
        self.high = max(1, int(capacity_blocks * high_watermark))
        self.low = max(0, int(capacity_blocks * low_watermark))
        self.entries: OrderedDict[int, BlockMeta] = OrderedDict()  # least recently used first
        self._free_slots = list(range(capacity_blocks - 1, -1, -1))
        self._reclaiming: OrderedDict[int, None] = OrderedDict()
        self._next_reclaim_s = float("-inf")
        self.evicted: list[BlockMeta] = []  # dropped entries whose bytes the owner may delete (disk files)
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[BlockMeta]:
        return iter(self.entries.values())

    def get(self, block_hash: int) -> BlockMeta | None:
        return self.entries.get(block_hash)

    def ready(self, block_hash: int) -> BlockMeta | None:
        meta = self.entries.get(block_hash)
        return meta if meta is not None and meta.ready else None

    def touch(self, block_hash: int, now: float) -> None:
        meta = self.entries[block_hash]
        meta.touch(now, self.config.heat_half_life_s)
        self.entries.move_to_end(block_hash)
        if meta.reclaiming:  # wanted again: no longer on its way out
            meta.reclaiming = False
            self._reclaiming.pop(block_hash, None)

    def reserve(self, block_hash: int, now: float, template: BlockMeta | None = None) -> BlockMeta | None:
        """Book a slot for `block_hash` (not ready until `commit`); None when it is already here (ready or
        being written) or every block is pinned or busy. `template` carries metadata from the tier above."""
        if block_hash in self.entries:
            return None
        if not self._free_slots and not self._evict_one(now):
            return None
        slot = self._free_slots.pop()
        if template is None:
            meta = BlockMeta(block_hash, self.tier, slot, now, now, heat_at_s=now, ready=False)
        else:
            t = template
            meta = BlockMeta(block_hash, self.tier, slot, t.produced_at_s, max(t.last_use_s, 0.0), t.use_count,
                             t.heat, t.heat_at_s, t.expected_use_at_s, t.pinned_until_s, codec=t.codec,
                             sla_class=t.sla_class, ready=False)
        self.entries[block_hash] = meta
        return meta

    def commit(self, block_hash: int) -> None:
        meta = self.entries.get(block_hash)
        if meta is not None:
            meta.ready = True

    def discard(self, block_hash: int) -> BlockMeta | None:
        """Drop an entry (a failed write, corrupt bytes, a deleted file); its slot is free again."""
        meta = self.entries.pop(block_hash, None)
        if meta is not None:
            self._reclaiming.pop(block_hash, None)
            self._free_slots.append(meta.slot)
        return meta

    def restore(self, meta: BlockMeta) -> bool:
        """Re-index a block found at start (disk files of an earlier run); False when the tier is full."""
        if meta.block_hash in self.entries or not self._free_slots:
            return False
        meta.slot, meta.tier, meta.ready = self._free_slots.pop(), self.tier, True
        self.entries[meta.block_hash] = meta
        self.entries.move_to_end(meta.block_hash)
        return True

    def reclaim(self, now: float) -> int:
        """Above the high watermark, mark the lowest-scoring blocks RECLAIM until only `low` would remain.
        Returns how many are marked now."""
        if len(self.entries) < self.high or now < self._next_reclaim_s:
            return len(self._reclaiming)
        self._next_reclaim_s = now + RECLAIM_INTERVAL_S
        want = len(self.entries) - self.low
        if len(self._reclaiming) >= want:
            return len(self._reclaiming)
        # Each mark is the lowest-scoring of the first `eviction_sample` evictable unmarked candidates (least
        # recently used first): a window over the LRU order that moves on by one after each mark.
        candidates = (m for m in self.entries.values()
                      if not (m.reclaiming or m.busy or not m.ready or m.pinned(now)))
        if isinstance(self.policy, LRUPolicy):  # the order is the policy (`_first_evictable`): mark the first ones
            for victim in itertools.islice(candidates, want - len(self._reclaiming)):
                victim.reclaiming = True
                self._reclaiming[victim.block_hash] = None
            return len(self._reclaiming)
        window = list(itertools.islice(candidates, self.config.eviction_sample))
        while window and len(self._reclaiming) < want:
            victim = pick_victim(window, self.policy, now, len(window))
            window.remove(victim)
            window.extend(itertools.islice(candidates, 1))
            victim.reclaiming = True
            self._reclaiming[victim.block_hash] = None
        return len(self._reclaiming)

    def _evict_one(self, now: float) -> bool:
        for block_hash in self._reclaiming:  # (returns before the drop changes the dict)
            meta = self.entries[block_hash]
            if not meta.busy and not meta.pinned(now):
                return self._drop(meta)
        victim = self._first_evictable(now) if isinstance(self.policy, LRUPolicy) else pick_victim(
            self.entries.values(), self.policy, now, self.config.eviction_sample)
        return victim is not None and self._drop(victim)

    def _first_evictable(self, now: float) -> BlockMeta | None:
        """Under LRU the index's order is the policy (a use moves an entry to the end): the first entry that
        is not busy, being written or pinned leaves first, without scoring a sample."""
        return next((m for m in self.entries.values() if not (m.busy or not m.ready or m.pinned(now))), None)

    def _drop(self, meta: BlockMeta) -> bool:
        meta.reclaiming = True
        self.discard(meta.block_hash)
        self.evicted.append(meta)
        self.num_evicted += 1
        return True

    def stage_counts(self, now: float) -> Counter:
        counts: Counter = Counter()
        for meta in self.entries.values():
            counts[stage_of(meta, now, meta.busy > 0, self.config)] += 1
        return counts

    def num_free(self) -> int:
        return len(self._free_slots)
