"""Hot prompt prefixes, and which one an idle prefill worker computes ahead (idle prewarm).

Prefix-affine routing sends the requests that share a prefix (a system prompt, a shared document, a long
conversation) to the prefill worker that saw it last, so a hot prefix can keep one prefill worker busy while
another sits idle with nothing cached. In PD mode the conductor core counts, for each prompt it routes, the
requests that shared each of its leading blocks (chained block hashes: block k stands for the whole prefix up
to k), a count that halves every `HALF_LIFE_S`. A prefix is hot from `HOT_COUNT` (two requests within a
half-life) and is forgotten once its count has fallen below half that; a block hash's count is dropped once it
has decayed below `FORGET_COUNT`.

When a prefill worker is idle (nothing routed to it waiting, no stage pass), the core asks `pick` for the
hot prefix it lacks (by its remembered prefixes, `WorkerLoad.prefix_blocks`) that is worth the most (decayed
count x blocks it would add) and fits its staging room, and sends it a `warm` command: a stage pass of just
those tokens (`pdserve.core.sched.stage_passes`), ranked after every real prefill, whose KV stays in that worker's
prefix cache and host tier. Once it is done the worker remembers the prefix, so routing can spread the
prefix's requests over both workers. Counted: `Count("kv_idle_prewarms", worker, outcome)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.conductor.routing import HashRun
from pdserve.core.pd.sensitivity import DEFAULT as DEFAULT_LABEL, LABELS
from pdserve.core.kvstore.u64map import new_map

HOT_COUNT = 1.5  # decayed count of requests that makes a prefix hot: two within a half-life
HALF_LIFE_S = 60.0
MIN_BLOCKS = 2  # shorter prefixes are not worth a pass
MAX_TRACKED = 1 << 16  # block hashes counted (the least recently seen dropped first)
FORGET_COUNT = 1 / 16  # a hash whose count decayed below this is dropped (a single request: after 4 half-lives)
MAX_HOT = 64  # hot prefixes kept as candidates (the least valuable dropped first)


@dataclass
class HotPrefix:
    tokens: list
    hashes: tuple
    count: float  # requests that shared it, decayed to `at_s`
    at_s: float
    label: str = DEFAULT_LABEL  # the strictest label of the requests seen with it: its prewarm's KV carries it

    def count_at(self, now: float) -> float:
        return self.count * 0.5 ** (max(now - self.at_s, 0.0) / HALF_LIFE_S)


class DecayedCounts:
    """Decayed request counts per block hash, for at most `capacity` hashes: a compiled map (hash -> slot) over
    numpy columns, so a prompt's hundreds of blocks are counted in a few array operations. Hashes whose count
    has decayed below `FORGET_COUNT` are dropped every quarter half-life; when the table is full the least
    recently seen eighth goes."""

    def __init__(self, capacity: int = MAX_TRACKED) -> None:
        self._slot = new_map(capacity)
        self._hash = np.zeros(capacity, np.uint64)
        self._count = np.zeros(capacity)
        self._at = np.full(capacity, -np.inf)  # -inf: a free slot
        self._label = np.zeros(capacity, np.int8)  # the strictest label seen with it (its index in LABELS)
        self._free = np.arange(capacity - 1, -1, -1)  # a stack: the free slots are its first `_num_free`
        self._num_free = capacity
        self._swept_s = -np.inf

    def __len__(self) -> int:
        return len(self._slot)

    def add(self, keys: np.ndarray, now: float, label: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """One more request, whose label is LABELS[`label`], for each of `keys` (distinct uint64 hashes) at
        `now`: their decayed counts after it (a hash seen for the first time: 1.0) and the strictest labels seen
        with them."""
        if now - self._swept_s >= HALF_LIFE_S / 4:
            self._forget(now)
        slots = self._slot.get_many(keys)
        seen = slots >= 0
        counts = np.ones(len(keys))
        old = slots[seen]
        counts[seen] += self._count[old] * 0.5 ** (np.maximum(now - self._at[old], 0.0) / HALF_LIFE_S)
        self._count[old], self._at[old] = counts[seen], now  # (before new slots are found: never evicted)
        labels = np.full(len(keys), label, np.int8)
        labels[seen] = self._label[old] = np.maximum(self._label[old], label)
        new = np.flatnonzero(~seen)[:len(self._hash) // 2]  # (a longer prompt's tail is not counted)
        if len(new):
            fresh = self._take(len(new))
            self._slot.put_many(keys[new], fresh)
            self._hash[fresh], self._count[fresh], self._at[fresh], self._label[fresh] = keys[new], 1.0, now, label
        return counts, labels

    def _take(self, k: int) -> np.ndarray:
        if self._num_free < k:  # full: the least recently seen go
            used = np.flatnonzero(self._at > -np.inf)
            drop = k - self._num_free + len(self._hash) // 8
            self._release(used[np.argpartition(self._at[used], drop - 1)[:drop]])
        self._num_free -= k
        return self._free[self._num_free:self._num_free + k].copy()

    def _forget(self, now: float) -> None:
        """Drop the hashes whose count has decayed to nothing: under steady load the table holds the last few
        half-lives' prompts, not all it has seen up to its capacity."""
        self._swept_s = now
        used = np.flatnonzero(self._at > -np.inf)
        decayed = self._count[used] * 0.5 ** (np.maximum(now - self._at[used], 0.0) / HALF_LIFE_S)
        self._release(used[decayed < FORGET_COUNT])

    def _release(self, slots: np.ndarray) -> None:
        if len(slots):
            self._slot.del_many(self._hash[slots])
            self._at[slots] = -np.inf
            self._free[self._num_free:self._num_free + len(slots)] = slots
            self._num_free += len(slots)


class HotPrefixes:
    def __init__(self) -> None:
        self._counts = DecayedCounts()
        self.hot: dict[int, HotPrefix] = {}  # its last block's hash -> prefix
        self.warming: dict[str, tuple[str, HotPrefix]] = {}  # warm pass id -> (prefill worker, prefix)
        self._version = 0  # bumped when a prefix turns hot or deepens: idle workers look again
        self._looked: dict[str, int] = {}  # prefill worker -> the version it found nothing to warm at

    def observe(self, hashes: Sequence, prompt: Sequence[int], block_size: int, now: float,
                label: str = DEFAULT_LABEL) -> None:
        """A prompt was routed: count the requests sharing each of its leading blocks (`hashes`); `label`: its
        KV's sensitivity label."""
        if not len(hashes):
            return
        keys = hashes.keys if isinstance(hashes, HashRun) else np.array(hashes, np.uint64)
        counts, labels = self._counts.add(keys, now, LABELS.index(label))
        hot = np.flatnonzero(counts >= HOT_COUNT)
        deepest = int(hot[-1]) + 1 if len(hot) else 0
        if deepest >= MIN_BLOCKS:  # labelled as the strictest request seen with any of its blocks
            self._remember(hashes[deepest - 1], HotPrefix(list(prompt[:deepest * block_size]),
                                                          HashRun(hashes[:deepest]), float(counts[deepest - 1]),
                                                          now, LABELS[int(labels[:deepest].max())]))

    def _remember(self, key, prefix: HotPrefix) -> None:
        if key not in self.hot:
            self._version += 1
        self.hot[key] = prefix
        if len(self.hot) > MAX_HOT:
            del self.hot[min(self.hot, key=lambda k: self._value(self.hot[k], prefix.at_s))]

    @staticmethod
    def _value(p: HotPrefix, now: float, have: int = 0) -> float:
        return p.count_at(now) * (len(p.hashes) - have)

    def pick(self, worker, max_blocks: int, now: float) -> HotPrefix | None:
        """The hot prefix `worker` (a `WorkerLoad`) should compute now, or None (nothing new since it last
        found nothing)."""
        if self._looked.get(worker.name) == self._version:
            return None
        fits = []  # (its value if the worker had none of it, prefix)
        for key, p in list(self.hot.items()):
            if p.count_at(now) < HOT_COUNT / 2:
                del self.hot[key]  # cooled down
            elif len(p.hashes) <= max_blocks:
                fits.append((self._value(p, now), p))
        fits.sort(key=lambda f: -f[0])
        best, best_value = None, 0.0
        for bound, p in fits:  # the most valuable first: the worker's cache is asked only while one may win
            if bound <= best_value:
                break
            value = self._value(p, now, worker.prefix_blocks(p.hashes))
            if value > best_value:
                best, best_value = p, value
        if best is None:
            self._looked[worker.name] = self._version
        return best

    def start(self, rid: str, worker: str, prefix: HotPrefix) -> None:
        self.warming[rid] = (worker, prefix)

    def end(self, rid: str) -> tuple[str, HotPrefix] | None:
        """The warm pass `rid` ended (or its worker died): (its worker, its prefix)."""
        return self.warming.pop(rid, None)

    def worker_gone(self, name: str) -> list[str]:
        """`name` died: its warm passes (ended) and what it was found to lack (it starts over empty)."""
        self._looked.pop(name, None)
        ended = [rid for rid, (w, _) in self.warming.items() if w == name]
        for rid in ended:
            del self.warming[rid]
        return ended
