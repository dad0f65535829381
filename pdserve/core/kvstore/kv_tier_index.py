"""Bookkeeping of one lower KV tier (host memory or disk): which block hashes it holds, where, and their
metadata. No tensors: the bytes live in `pdserve.kv` (a host tensor, files) and move on an I/O thread.

Two-phase stores: `reserve` books a slot for a hash (the entry exists but is not `ready`, so no lookup
hits it), the bytes are written, then `commit` makes it visible or `discard` drops it. Eviction happens in
two places: when usage passes `high_watermark`, `reclaim(now)` marks the lowest-scoring blocks RECLAIM
down to `low_watermark` (still servable: a hit takes one back); `reserve` frees a slot when none is free.
Blocks being read (`busy`), being written, or pinned are never taken.

Which block leaves: under LRU, the first evictable one in use order (the marks are the head of that order,
so they go first unless a block ahead of them became evictable since); under another policy, the first
evictable marked block, else the policy's pick among the `eviction_sample` least recently used.

State is columnar (`MetaColumns` by slot, a compiled slot order and hash -> slot map from `pdserve.core.kvstore.native`):
a run of blocks is reserved, committed, touched or evicted with a few array operations (`reserve_many`, `commit_slots`,
`touch_many`). `entries` is a read-only mapping hash -> `MetaView`, least recently used first.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from pdserve.core.kvstore.kv_columns import MetaColumns, MetaView
from pdserve.core.kvstore.kv_meta import BlockMeta, EvictionPolicy, LifecycleConfig, LRUPolicy, Tier, pick_victim
from pdserve.core.kvstore.lru_queue import new_queue
from pdserve.core.kvstore.u64map import new_map

RECLAIM_INTERVAL_S = 1.0  # watermark marking runs at most this often (it walks the LRU order)


class _Entries(Mapping):
    """hash -> `MetaView`, iterated least recently used first."""

    def __init__(self, index: TierIndex) -> None:
        self._index = index

    def __getitem__(self, block_hash: int) -> MetaView:
        return self._index.cols.view(self._index._slot[block_hash])

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._index._slot

    def __iter__(self) -> Iterator[int]:
        index = self._index
        return iter(index.cols.block_hash[index._lru.order()].tolist())

    def __len__(self) -> int:
        return len(self._index._slot)


class TierIndex:
    def __init__(self, tier: Tier, capacity_blocks: int, policy: EvictionPolicy,
                 config: LifecycleConfig | None = None, high_watermark: float = 0.95,
                 low_watermark: float = 0.90, keep_evicted: bool = True, codec: str = "float32") -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"{tier.value} tier needs a positive capacity, got {capacity_blocks} blocks")
        self.tier = tier
        self.capacity = capacity_blocks
        self.policy = policy
        self.config = config or LifecycleConfig()
        self.high = max(1, int(capacity_blocks * high_watermark))
        self.low = max(0, int(capacity_blocks * low_watermark))
        self.codec = codec  # the format its blocks are in (its I/O runner decodes it into the pool's on a load)
        self.cols = MetaColumns(capacity_blocks, tier, codec)
        self._slot = new_map(capacity_blocks)  # block hash -> slot
        self._lru = new_queue(capacity_blocks)  # occupied slots, least recently used first
        # free slots: a stack, its top at _num_free - 1 (slot 0 first)
        self._free_stack = np.arange(capacity_blocks - 1, -1, -1, dtype=np.int64)
        self._num_free = capacity_blocks
        self._marked = 0  # entries marked RECLAIM
        self._reclaim_after = -1  # the slot marked last (LRU): marking goes on after it
        self._next_reclaim_s = float("-inf")
        self.entries = _Entries(self)
        self.evicted: list[int] = []  # hashes of dropped entries whose bytes the owner may delete (disk files)
        self.keep_evicted = keep_evicted  # (a host tier's owner has nothing to delete: it keeps none)
        self.num_evicted = 0
        # entries evicted: (their slots, stage names), before the slots are reused (`kv_placement` counts them)
        self.on_evict = None

    def __len__(self) -> int:
        return len(self._slot)

    def __iter__(self) -> Iterator[MetaView]:
        return (self.cols.view(s) for s in self._lru.order().tolist())

    def cached_hashes(self) -> np.ndarray:
        """Each slot's block hash, 0 where the slot is free (uint64, a copy): what a worker's `kv_cache` events
        diff (`pdserve.core.kvstore.cache_events`)."""
        out = self.cols.block_hash.astype(np.uint64)
        out[self._free_stack[:self._num_free]] = 0
        return out

    def get(self, block_hash: int) -> MetaView | None:
        slot = self._slot.get(block_hash)
        return None if slot is None else self.cols.view(slot)

    def ready(self, block_hash: int) -> MetaView | None:
        slot = self._slot.get(block_hash)
        return None if slot is None or not self.cols.ready[slot] else self.cols.view(slot)

    def pin_many(self, hashes: Sequence[int], until_s: float) -> int:
        """Keep the entries of `hashes` that are here from eviction and reclaim until `until_s` (0.0: let them
        go); returns how many are here."""
        slots = self._present(hashes)
        self.cols.pinned_until_s[slots] = until_s
        return len(slots)

    def _present(self, hashes) -> np.ndarray:
        """The slots of those of `hashes` that are here, in order."""
        slots = self._slot.get_many(hashes)
        return slots[slots >= 0]

    present = _present

    def present_mask(self, hashes: np.ndarray) -> np.ndarray:
        """Per hash: 0 not here, 1 here and ready, 2 here and being written."""
        slots = self._slot.get_many(hashes)
        out = np.zeros(len(slots), np.int8)
        here = slots >= 0
        out[here] = np.where(self.cols.ready[slots[here]], 1, 2)
        return out

    def slot(self, block_hash: int) -> int:
        return self._slot[block_hash]

    def slots(self, hashes) -> np.ndarray:
        """The slot of each of `hashes` (all here), as an int64 array."""
        slots = self._slot.get_many(hashes)
        if len(slots) and slots.min() < 0:
            raise KeyError(f"{int((slots < 0).sum())} of {len(slots)} hashes are not in the {self.tier.value} tier")
        return slots

    def ready_prefix(self, hashes: Sequence[int]) -> tuple[int, bool]:
        """How many leading `hashes` are here and ready; and whether the next one is here (being written)."""
        keys = np.array(hashes, np.uint64)
        slots = self._slot.get_many(keys[:self._slot.prefix_len(keys)])
        if not len(slots):
            return 0, False
        unready = np.flatnonzero(~self.cols.ready[slots])
        return (len(slots), False) if not len(unready) else (int(unready[0]), True)

    # ---- uses -------------------------------------------------------------------------------------------
    def touch(self, block_hash: int, now: float) -> None:
        self._touch_slots(np.array([self._slot[block_hash]]), now)

    def touch_many(self, hashes: Sequence[int], now: float) -> None:
        """One use of each of `hashes` (distinct, all here), in order: the last becomes most recent."""
        if len(hashes):
            self._touch_slots(self.slots(hashes), now)

    def _touch_slots(self, slots: np.ndarray, now: float) -> None:
        self.cols.touch(slots, now, self.config.heat_half_life_s)
        self._lru.push_many(slots)
        self.unmark(slots)  # wanted again: no longer on their way out

    def unmark(self, slots: np.ndarray) -> None:
        """Entries at `slots` are wanted again (an expected use): no longer on their way out."""
        marked = slots[self.cols.reclaiming[slots]]
        if len(marked):
            self.cols.reclaiming[marked] = False
            self._marked -= len(marked)

    def unbusy_many(self, hashes: Sequence[int]) -> None:
        """One read fewer for each of `hashes` that is still here and busy (a hash may come twice: two
        loads of one entry)."""
        slots = self._present(hashes)
        if len(slots):
            busy = self.cols.busy
            np.subtract.at(busy, slots, 1)
            busy[slots] = np.maximum(busy[slots], 0)

    # ---- stores -----------------------------------------------------------------------------------------
    def reserve(self, block_hash: int, now: float, template: BlockMeta | MetaView | None = None
                ) -> MetaView | None:
        """Book a slot for `block_hash` (not ready until `commit`); None when it is already here (ready or
        being written) or every block is pinned or busy. `template` carries metadata from the tier above."""
        if block_hash in self._slot:
            return None
        if not self._num_free and not self._evict(1, now):
            return None
        slot = self._pop_free()
        self._slot[block_hash] = slot
        self.cols.fresh(slot, block_hash, now, 0, ready=False)
        if template is not None:
            self.cols.set_from(slot, template)
            self.cols.last_use_s[slot] = max(template.last_use_s, 0.0)
        self._lru.push(slot)
        return self.cols.view(slot)

    def reserve_many(self, hashes: np.ndarray, now: float, src: MetaColumns | None = None,
                     src_slots: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`reserve` for a run of distinct hashes (a uint64 array), metadata copied from `src`'s `src_slots`
        (one per hash). Returns the positions in `hashes` booked, their slots, and the positions not booked
        (here already, or no room was left), as int64 arrays."""
        new = np.flatnonzero(self._slot.get_many(hashes) < 0)
        room = self._num_free
        if len(new) > room:
            room += self._evict(len(new) - room, now)
        new = new[:room]
        k = len(new)
        if not k:
            return new, new, np.arange(len(hashes))
        self._num_free -= k
        slots = self._free_stack[self._num_free:self._num_free + k][::-1].copy()
        self._slot.put_many(hashes[new], slots)
        if src is None:
            self.cols.fresh(slots, hashes[new], now, 0, ready=False)
        else:
            self.cols.copy_from(src, np.asarray(src_slots)[new], slots)
        self._lru.push_many(slots)
        if k == len(hashes):
            return new, slots, new[:0]
        rest = np.ones(len(hashes), bool)
        rest[new] = False
        return new, slots, np.flatnonzero(rest)

    def commit(self, block_hash: int) -> None:
        slot = self._slot.get(block_hash)
        if slot is not None:
            self.cols.ready[slot] = True

    def commit_slots(self, hashes: np.ndarray, slots: np.ndarray) -> None:
        """`commit` for a run whose slots the caller knows (an offload's, from `reserve_many`): those still
        holding their hash are committed, without a hash-map probe per block."""
        slots = np.asarray(slots, np.int64)
        self.cols.ready[slots[self.cols.block_hash[slots] == hashes]] = True

    def discard(self, block_hash: int) -> BlockMeta | None:
        """Drop an entry (a failed write, corrupt bytes, a deleted file); its slot is free again. Returns
        a copy of its metadata."""
        slot = self._slot.pop(block_hash, None)
        if slot is None:
            return None
        meta = self.cols.snapshot(slot)
        self._free([slot])
        return meta

    def _free(self, slots: Sequence[int], unlinked: bool = False) -> None:
        """`slots` are free again (`unlinked`: already out of the LRU order)."""
        arr = np.asarray(slots, np.int64)
        marked = self.cols.reclaiming[arr]
        self._marked -= int(np.count_nonzero(marked))
        self.cols.reclaiming[arr] = False
        self.cols.block_hash[arr] = 0  # (a free slot holds no hash: `commit_slots` relies on it)
        if not unlinked:
            self._lru.remove_many(arr)
        self._free_stack[self._num_free:self._num_free + len(arr)] = arr
        self._num_free += len(arr)

    def _pop_free(self) -> int:
        self._num_free -= 1
        return int(self._free_stack[self._num_free])

    def free_slots(self) -> list[int]:
        """The free slots, the next to be taken last."""
        return self._free_stack[:self._num_free].tolist()

    def restore(self, meta: BlockMeta) -> bool:
        """Re-index a block found at start (disk files of an earlier run); False when the tier is full."""
        if meta.block_hash in self._slot or not self._num_free:
            return False
        slot = self._pop_free()
        self._slot[meta.block_hash] = slot
        self.cols.fresh(slot, meta.block_hash, 0.0, 0, ready=True)
        self.cols.set_from(slot, meta)
        self._lru.push(slot)
        return True

    # ---- eviction ---------------------------------------------------------------------------------------
    def reclaim(self, now: float) -> int:
        """Above the high watermark, mark the lowest-scoring blocks RECLAIM until only `low` would remain.
        Returns how many are marked now."""
        if not self.reclaim_due(now):
            return self._marked
        self._next_reclaim_s = now + RECLAIM_INTERVAL_S
        need = len(self._slot) - self.low - self._marked
        if need <= 0:
            return self._marked
        cols = self.cols
        if isinstance(self.policy, LRUPolicy):  # the order is the policy: mark the first candidates
            # ... after the last block marked, while it is still marked (so still in its place: a touch
            # unmarks and moves a block, eviction unmarks it): not a walk past every marked block each time
            after = self._reclaim_after if self._reclaim_after >= 0 and cols.reclaiming[self._reclaim_after] else -1
            pick = self._lru.first_evictable(need, after, cols.ready, cols.busy, cols.pinned_until_s,
                                             cols.reclaiming, now)
            if len(pick):
                cols.reclaiming[pick] = True
                self._reclaim_after = int(pick[-1])
                self._marked += len(pick)
            return self._marked
        if hasattr(self.policy, "scores"):  # the `need` lowest of the first need + sample - 1 unmarked ones
            pick = self._lowest_unmarked(need, now)
            cols.reclaiming[pick] = True
            self._marked += len(pick)
            return self._marked
        # Each mark is the lowest-scoring of the first `eviction_sample` evictable unmarked candidates (least
        # recently used first): a window over the LRU order that moves on by one after each mark.
        candidates = (cols.view(s) for run in list(self._lru.runs())
                      for s in run[cols.evictable(run, now) & ~cols.reclaiming[run]].tolist())
        window = [m for _, m in zip(range(self.config.eviction_sample), candidates)]
        while window and need > 0:
            victim = pick_victim(window, self.policy, now, len(window))
            window.remove(victim)
            window.extend(m for _, m in zip(range(1), candidates))
            cols.reclaiming[victim.slot] = True
            self._marked += 1
            need -= 1
        return self._marked

    def reclaim_due(self, now: float) -> bool:
        return now >= self.next_reclaim_s()

    def next_reclaim_s(self) -> float:
        """From when `reclaim` would mark blocks if nothing else changes (inf: not while below the high mark)."""
        return self._next_reclaim_s if len(self._slot) >= self.high else math.inf

    def _evict(self, count: int, now: float) -> int:
        """Free up to `count` slots by evicting; how many were freed."""
        cols = self.cols
        if isinstance(self.policy, LRUPolicy):
            victims = self._lru.pop_evictable(count, cols.ready, cols.busy, cols.pinned_until_s, now)
        elif hasattr(self.policy, "scores"):
            victims = self._lowest(count, now)
            self._lru.remove_many(victims)
        else:
            picked = []
            for _ in range(count):
                victim = self._pick(now)
                if victim is None:
                    break
                self._lru.remove(victim)
                picked.append(victim)
            victims = np.array(picked, np.int64)
        if len(victims):
            if self.on_evict is not None:
                self.on_evict(victims, self._stage_names(victims, now))
            hashes = cols.block_hash[victims]
            self._slot.del_many(hashes)
            self._free(victims, unlinked=True)
            if self.keep_evicted:
                self.evicted.extend(hashes.tolist())
            self.num_evicted += len(victims)
        return len(victims)

    def _lowest(self, count: int, now: float) -> np.ndarray:
        """A policy that scores columns: the evictable marked entries first (least recently used first), the
        rest the lowest-scoring of the first `count + eviction_sample - 1` evictable ones."""
        cols, want = self.cols, count + self.config.eviction_sample - 1
        marked, other, n = [], [], 0
        for run in self._lru.runs():
            run = run[cols.evictable(run, now)]
            mark = cols.reclaiming[run]
            marked.append(run[mark])
            other.append(run[~mark])
            n += len(run)
            if n >= want:
                break
        if not n:
            return np.zeros(0, np.int64)
        picked = np.concatenate(marked)[:count]
        rest = np.concatenate(other)[:want]
        if len(picked) < count and len(rest):
            order = np.argsort(self.policy.scores(cols, rest, now), kind="stable")
            picked = np.concatenate([picked, rest[np.sort(order[:count - len(picked)])]])
        return picked.astype(np.int64)

    def _lowest_unmarked(self, count: int, now: float) -> np.ndarray:
        cols, want, runs, n = self.cols, count + self.config.eviction_sample - 1, [], 0
        for run in self._lru.runs():
            run = run[cols.evictable(run, now) & ~cols.reclaiming[run]]
            runs.append(run)
            n += len(run)
            if n >= want:
                break
        rest = np.concatenate(runs)[:want] if runs else np.zeros(0, np.int64)
        order = np.argsort(self.policy.scores(cols, rest, now), kind="stable")
        return rest[np.sort(order[:count])]

    def _stage_names(self, slots: np.ndarray, now: float) -> np.ndarray:
        """Each entry's stage as `stage_of` names it (evictable entries: reclaim, active or decay)."""
        cols = self.cols
        active = now - cols.last_use_s[slots] < self.config.active_s
        return np.where(cols.reclaiming[slots], "reclaim", np.where(active, "active", "decay"))

    def _pick(self, now: float) -> int | None:
        """A policy other than LRU: the first evictable marked block, else its pick of a sample."""
        cols, sample = self.cols, []
        if self._marked:
            for run in self._lru.runs():
                marked = run[cols.evictable(run, now) & cols.reclaiming[run]]
                if len(marked):
                    return int(marked[0])
        for run in self._lru.runs():
            ok = cols.evictable(run, now)
            sample.extend(cols.view(s) for s in run[ok][:self.config.eviction_sample - len(sample)].tolist())
            if len(sample) >= self.config.eviction_sample:
                break
        victim = pick_victim(sample, self.policy, now, len(sample))
        return None if victim is None else victim.slot

    # ---- what the metrics show --------------------------------------------------------------------------
    def marked(self) -> list[int]:
        """Hashes of the entries marked RECLAIM, in no particular order."""
        hashes, slots = self._slot.items()
        return hashes[self.cols.reclaiming[slots]].tolist()

    def stage_counts(self, now: float) -> Counter:
        slots = self._slot.values()
        return self.cols.stages(slots, self.cols.busy[slots] > 0, now, self.config)

    def num_free(self) -> int:
        return self._num_free
