"""Slots in least-recently-pushed order, for tiers of 10^5 blocks touched in runs of hundreds.

`new_queue` gives a `LinkedQueue`: the compiled `Order` (`pdserve/core/kvstore/native/kvcore.c`, a doubly linked
list over slot numbers: push, move and remove O(1), runs of slots in one call). Where the compiled module is
unavailable it gives (counted, `pdserve.core.kvstore.native`) a `ChunkQueue`, the same contract in numpy:

Each slot carries a stamp, its position in the order: pushing a slot (again) gives it the next stamp and
appends (slot, stamp) at the most recent end; removing it zeroes its stamp. Entries whose stamp no longer
matches their slot's are stale and are dropped when the head reaches them, so a push or a removal is O(1)
(or one array operation for a run) and never searches the queue. The order itself is a deque of numpy
chunks, plus a list buffer for single pushes; pops take the first live entries that a caller's predicate
allows and leave the others where they were.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

import numpy as np

from pdserve.core.kvstore import native

CHUNK = 4096  # longest chunk kept: a pop scans the head chunk a window at a time, never a whole tier


def new_queue(num_slots: int) -> ChunkQueue:  # or a LinkedQueue: the same contract
    if native.load() is not None:
        return LinkedQueue(num_slots)
    native.fallback()
    return ChunkQueue(num_slots)


class LinkedQueue:
    """The compiled order. `size`, `in`, `push`, `remove` go straight to C; runs of slots are int64 arrays."""

    __slots__ = ("_o", "push", "remove")

    def __init__(self, num_slots: int) -> None:
        self._o = native.load().Order(num_slots)
        self.push, self.remove = self._o.push, self._o.remove

    @property
    def size(self) -> int:
        return len(self._o)

    def __len__(self) -> int:
        return len(self._o)

    def __contains__(self, slot: int) -> bool:
        return slot in self._o

    def push_many(self, slots: np.ndarray) -> None:
        """`slots` (distinct) become the most recent, the last one most recent of all."""
        self._o._push_many(np.ascontiguousarray(slots, np.int64))

    def remove_many(self, slots: np.ndarray) -> None:
        self._o._remove_many(np.ascontiguousarray(slots, np.int64))

    def clear(self) -> None:
        self._o.clear()

    def runs(self, after: int = -1) -> Iterator[np.ndarray]:
        """The slots in order (those after slot `after`, which is in the queue, when given), a run at a time
        (do not push or pop while iterating)."""
        size = CHUNK
        while True:
            run = np.empty(size, np.int64)
            k = self._o._peek(after, run)
            if not k:
                return
            after = int(run[k - 1])
            yield run[:k]
            size = min(2 * size, 1 << 16)

    def order(self) -> np.ndarray:
        out = np.empty(len(self._o), np.int64)
        return out[:self._o._peek(-1, out)]

    def pop_first(self, count: int, allowed: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
        """Remove and return the first `count` slots (fewer if there are not that many) for which
        `allowed(slots)` (a boolean mask) holds; the others keep their places."""
        if allowed is None:
            out = np.empty(min(count, len(self._o)), np.int64)
            return out[:self._o._pop_first(out)]
        taken, need, after, window = [], count, -1, count + max(count // 8, 64)  # (most at the head are allowed)
        while need > 0:
            cand = np.empty(window, np.int64)
            k = self._o._peek(after, cand)
            if not k:
                break
            cand = cand[:k]
            after = int(cand[-1])
            ok = np.flatnonzero(allowed(cand))[:need]
            if len(ok):
                taken.append(cand[ok])
                need -= len(ok)
            window *= 2
        out = np.concatenate(taken) if len(taken) > 1 else taken[0] if taken else np.zeros(0, np.int64)
        self._o._remove_many(out)
        return out

    # ---- the free queue of a pool of ref-counted blocks (`ref`: an int32 count per slot) ----------------
    def take_refs(self, ref: np.ndarray, ids: np.ndarray) -> None:
        """One more reference to each of `ids` (distinct); those that had none leave the queue."""
        self._o._take_refs(ref, np.ascontiguousarray(ids, np.int64))

    def release_refs(self, ref: np.ndarray, ids: np.ndarray) -> None:
        """One reference less on each of `ids` (repeats allowed); those left with none join the queue in the
        order they first appear. A count going negative raises AssertionError."""
        self._o._release_refs(ref, np.ascontiguousarray(ids, np.int64))

    def first_evictable(self, count: int, after: int, ready: np.ndarray, busy: np.ndarray,
                        pinned_until: np.ndarray, reclaiming: np.ndarray, now: float) -> np.ndarray:
        """The first `count` slots after `after` (-1: from the head) that are evictable (as `pop_evictable`)
        and not `reclaiming`, in order; nothing is removed."""
        out = np.empty(min(count, len(self._o)), np.int64)
        return out[:self._o._peek_evictable(after, out, ready, busy, pinned_until, reclaiming, float(now))]

    def pop_evictable(self, count: int, ready: np.ndarray, busy: np.ndarray, pinned_until: np.ndarray,
                      now: float) -> np.ndarray:
        """`pop_first(count, allowed)` with `allowed` = ready & busy == 0 & pinned_until <= now (columns by
        slot: `MetaColumns.evictable`), in one compiled walk."""
        out = np.empty(min(count, len(self._o)), np.int64)
        return out[:self._o._pop_evictable(out, ready, busy, pinned_until, float(now))]


class ChunkQueue:
    """The numpy order (stamps and chunks, above): `LinkedQueue`'s counted fallback, the same contract."""

    def __init__(self, num_slots: int) -> None:
        self.stamp = np.zeros(num_slots, np.int64)  # 0: not in the queue
        self._next = 1
        self._chunks: deque[tuple[np.ndarray, np.ndarray]] = deque()  # (slots, stamps), oldest first
        self._tail_slots: list[int] = []
        self._tail_stamps: list[int] = []
        self.size = 0
        self._pushed = 0  # entries pushed since the last compaction (live or stale)

    def __len__(self) -> int:
        return self.size

    def __contains__(self, slot: int) -> bool:
        return bool(self.stamp[slot])

    def push(self, slot: int) -> None:
        """`slot` becomes the most recent (entered, or moved from wherever it was)."""
        if not self.stamp[slot]:
            self.size += 1
        self.stamp[slot] = self._next
        self._tail_slots.append(slot)
        self._tail_stamps.append(self._next)
        self._next += 1
        self._pushed += 1
        if self._pushed > 2 * len(self.stamp) + CHUNK:
            self._compact()

    def push_many(self, slots: np.ndarray) -> None:
        """`slots` (distinct) become the most recent, the last one most recent of all."""
        if len(slots) == 0:
            return
        slots = np.asarray(slots, np.int64)
        stamps = np.arange(self._next, self._next + len(slots), dtype=np.int64)
        self._next += len(slots)
        self.size += int(np.count_nonzero(self.stamp[slots] == 0))
        self.stamp[slots] = stamps
        self._seal_tail()
        for i in range(0, len(slots), CHUNK):
            self._append(slots[i:i + CHUNK].copy(), stamps[i:i + CHUNK])
        self._pushed += len(slots)
        if self._pushed > 2 * len(self.stamp) + CHUNK:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale entries a long run of pushes left behind the head (memory stays O(slots))."""
        order = self.order()
        self._chunks.clear()
        for i in range(0, len(order), CHUNK):
            part = order[i:i + CHUNK]
            self._chunks.append((part, self.stamp[part]))
        self._pushed = len(order)

    def remove(self, slot: int) -> None:
        if self.stamp[slot]:
            self.stamp[slot] = 0
            self.size -= 1

    def remove_many(self, slots: np.ndarray) -> None:
        slots = np.asarray(slots, np.int64)
        present = slots[self.stamp[slots] != 0]
        if len(present):
            self.size -= len(np.unique(present)) if len(present) > 1 else 1
            self.stamp[present] = 0

    def clear(self) -> None:
        self.stamp[:] = 0
        self._chunks.clear()
        self._tail_slots, self._tail_stamps, self.size, self._pushed = [], [], 0, 0

    def _seal_tail(self) -> None:
        if self._tail_slots:
            self._append(np.array(self._tail_slots, np.int64), np.array(self._tail_stamps, np.int64))
            self._tail_slots, self._tail_stamps = [], []

    def _append(self, slots: np.ndarray, stamps: np.ndarray) -> None:
        """At the recent end; a short last chunk absorbs it (many tiny chunks would cost a numpy call each)."""
        if self._chunks and len(self._chunks[-1][0]) + len(slots) <= CHUNK:
            last_slots, last_stamps = self._chunks.pop()
            slots, stamps = np.concatenate((last_slots, slots)), np.concatenate((last_stamps, stamps))
        self._chunks.append((slots, stamps))

    def runs(self, after: int = -1) -> Iterator[np.ndarray]:
        """The live slots in order (those after slot `after`, which is in the queue, when given), a run at a
        time (do not push or pop while iterating)."""
        self._seal_tail()
        past = int(self.stamp[after]) if after >= 0 else 0  # stamps grow along the order
        for slots, stamps in self._chunks:
            if stamps[-1] <= past:
                continue
            live = slots[(self.stamp[slots] == stamps) & (stamps > past)]
            if len(live):
                yield live

    def order(self) -> np.ndarray:
        runs = list(self.runs())
        return np.concatenate(runs) if runs else np.zeros(0, np.int64)

    def pop_first(self, count: int, allowed: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
        """Remove and return the first `count` live slots (fewer if there are not that many) for which
        `allowed(slots)` (a boolean mask) holds; the others keep their places."""
        self._seal_tail()
        out: list[np.ndarray] = []
        kept: list[tuple[np.ndarray, np.ndarray]] = []  # live entries passed over, in order
        need, window = count, max(2 * count, 64)
        while need > 0 and self._chunks:
            slots, stamps = self._chunks.popleft()
            if len(slots) > window:  # look at the head of the chunk only
                self._chunks.appendleft((slots[window:], stamps[window:]))
                slots, stamps = slots[:window], stamps[:window]
                window *= 2
            live = self.stamp[slots] == stamps
            slots, stamps = slots[live], stamps[live]
            ok = np.ones(len(slots), bool) if allowed is None else allowed(slots)
            take = np.flatnonzero(ok)[:need]
            if len(take):
                out.append(slots[take])
                need -= len(take)
                ok[:] = True
                ok[take] = False
                if ok.any():  # kept: before, between and after the taken ones
                    kept.append((slots[ok], stamps[ok]))
            elif len(slots):
                kept.append((slots, stamps))
        if kept:  # one chunk again, merged with the head when short
            slots = np.concatenate([k[0] for k in kept])
            stamps = np.concatenate([k[1] for k in kept])
            if self._chunks and len(self._chunks[0][0]) + len(slots) <= CHUNK:
                head_slots, head_stamps = self._chunks.popleft()
                slots, stamps = np.concatenate((slots, head_slots)), np.concatenate((stamps, head_stamps))
            self._chunks.appendleft((slots, stamps))
        taken = np.concatenate(out) if out else np.zeros(0, np.int64)
        self.stamp[taken] = 0
        self.size -= len(taken)
        return taken

    def pop_evictable(self, count: int, ready: np.ndarray, busy: np.ndarray, pinned_until: np.ndarray,
                      now: float) -> np.ndarray:
        return self.pop_first(count, lambda slots: _evictable(slots, ready, busy, pinned_until, now))

    def first_evictable(self, count: int, after: int, ready: np.ndarray, busy: np.ndarray,
                        pinned_until: np.ndarray, reclaiming: np.ndarray, now: float) -> np.ndarray:
        picks, need = [], count
        for run in self.runs(after):
            pick = run[_evictable(run, ready, busy, pinned_until, now) & ~reclaiming[run]][:need]
            picks.append(pick)
            need -= len(pick)
            if need <= 0:
                break
        return np.concatenate(picks) if picks else np.zeros(0, np.int64)

    def take_refs(self, ref: np.ndarray, ids: np.ndarray) -> None:
        ids = np.asarray(ids, np.int64)
        self.remove_many(ids[ref[ids] == 0])
        ref[ids] += 1  # (distinct ids: a fancy increment, not the slower ufunc.at)

    def release_refs(self, ref: np.ndarray, ids: np.ndarray) -> None:
        ids = np.asarray(ids, np.int64)
        np.subtract.at(ref, ids, 1)
        refs = ref[ids]
        if (refs < 0).any():
            raise AssertionError(f"block {ids[refs < 0][0]} ref count went negative")
        freed = ids[refs == 0]
        if len(freed) > 1:  # a block released twice (a holder holding it twice): it joins once
            _, first = np.unique(freed, return_index=True)
            freed = freed[np.sort(first)]
        self.push_many(freed)


def _evictable(slots: np.ndarray, ready: np.ndarray, busy: np.ndarray, pinned_until: np.ndarray,
               now: float) -> np.ndarray:
    """`MetaColumns.evictable` over raw columns (what the compiled walks test per slot)."""
    return ready[slots] & (busy[slots] == 0) & (pinned_until[slots] <= now)
