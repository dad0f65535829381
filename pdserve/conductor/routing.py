"""Routing policies: which worker of a role gets a request. Small injected objects, no torch, no sockets.

The conductor keeps, per worker, the chained block hashes of the prompts it sent there (bounded LRU): a
worker that saw a prefix recently probably still has its KV blocks cached.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import numpy as np

from pdserve.core.kvstore.u64map import new_map


AFFINITY_BLOCKS = 256  # prefix affinity looks at a prompt's first blocks only (4,096 tokens at block 16)
MAX_RECENT_BLOCKS = 65536  # block hashes remembered per worker, at most (fewer: its KV capacity, once known)
MAX_POOL_BLOCKS = 1 << 20  # block hashes remembered as written to the shared pool, at most (latest kept)
POOL_CREDIT = 0.75  # a block any worker can read from the shared pool counts this much of one it holds


class HashRun(tuple):
    """A prompt's leading block hashes (a tuple), with them as a uint64 array too (`keys`), made once: every
    worker's `prefix_blocks` asks the compiled map with it."""

    @cached_property
    def keys(self) -> np.ndarray:
        return np.array(self, np.uint64)


def _keys(hashes: Sequence) -> np.ndarray:
    keys = hashes.keys if isinstance(hashes, HashRun) else np.array(hashes[:AFFINITY_BLOCKS], np.uint64)
    return keys[:AFFINITY_BLOCKS]


class RecentBlocks:
    """Block hashes recently sent to one worker, least recently sent first, at most `limit` (dropped oldest
    first). A compiled map hash -> stamp (its last sending) answers membership and prefix lengths; the sending
    order is kept as (hashes, stamps) runs, whose entries go stale once their hash is sent again."""

    def __init__(self) -> None:
        self._stamp = new_map()
        self._runs: deque[tuple[np.ndarray, np.ndarray]] = deque()
        self._entries = 0  # in the runs, live or stale
        self._next = 0

    def __len__(self) -> int:
        return len(self._stamp)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._stamp

    def __iter__(self) -> Iterator[int]:
        for keys, stamps in list(self._runs):
            yield from keys[self._stamp.get_many(keys) == stamps].tolist()

    def clear(self) -> None:
        self._stamp.clear()
        self._runs.clear()
        self._entries = 0

    def prefix_len(self, keys: np.ndarray) -> int:
        return self._stamp.prefix_len(keys)

    def add(self, keys: np.ndarray, limit: int) -> None:
        """`keys` (uint64, distinct) sent now, in order; then the oldest dropped down to `limit`."""
        stamps = np.arange(self._next, self._next + len(keys), dtype=np.int64)
        self._next += len(keys)
        self._stamp.put_many(keys, stamps)
        self._runs.append((keys, stamps))
        self._entries += len(keys)
        if self._entries > 2 * len(self._stamp) + AFFINITY_BLOCKS:  # mostly stale: the same prefixes again
            self._compact()
        excess = len(self._stamp) - limit
        while excess > 0 and self._runs:
            keys, stamps = self._runs.popleft()
            live = np.flatnonzero(self._stamp.get_many(keys) == stamps)
            drop = live[:excess]
            self._stamp.del_many(keys[drop])
            excess -= len(drop)
            self._entries -= len(keys)
            if len(drop) < len(live):  # the rest of this run stays the oldest
                self._runs.appendleft((keys[drop[-1] + 1:], stamps[drop[-1] + 1:]))
                self._entries += len(keys) - drop[-1] - 1

    def _compact(self) -> None:
        """One run of the live entries, in order (memory stays O(entries) however often a prefix is resent)."""
        live = [(k, s, self._stamp.get_many(k) == s) for k, s in self._runs]
        keys = np.concatenate([k[m] for k, _, m in live]) if live else np.zeros(0, np.uint64)
        self._runs = deque([(keys, np.concatenate([s[m] for _, s, m in live]))] if len(keys) else [])
        self._entries = len(keys)


class ReportedBlocks:
    """What one worker reports it holds (its `kv_cache` events: blocks stored and evicted per tier, batched),
    plus the hashes routed there since its report before last (sent, maybe not computed when it reported)."""

    def __init__(self) -> None:
        self.held = {}  # tier -> compiled map: hash -> 1
        self._sent = [new_map(), new_map()]  # (since the last report, the one before)
        self.reports = 0

    def apply(self, stored: dict, evicted: dict) -> None:
        for tier, hashes in evicted.items():
            if tier in self.held and len(hashes):
                self.held[tier].del_many(np.asarray(hashes, np.uint64))
        for tier, hashes in stored.items():
            if len(hashes):
                keys = np.asarray(hashes, np.uint64)
                self.held.setdefault(tier, new_map()).put_many(keys, np.ones(len(keys), np.int64))
        self._sent = [new_map(), self._sent[0]]
        self.reports += 1

    def sent(self, keys: np.ndarray) -> None:
        self._sent[0].put_many(keys, np.ones(len(keys), np.int64))

    def prefix_len(self, keys: np.ndarray) -> int:
        """Leading `keys` held in some tier (or sent lately): a prefix may run on from device into host."""
        held = np.zeros(len(keys), bool)
        for m in (*self.held.values(), *self._sent):
            held |= m.get_many(keys) >= 0
        return int(held.argmin()) if not held.all() else len(keys)

    def clear(self) -> None:
        self.held.clear()
        self._sent = [new_map(), new_map()]
        self.reports = 0


@dataclass
class WorkerLoad:
    name: str
    role: str
    outstanding: int = 0  # requests routed here and not finished (the gateway's own count: no lag)
    alive: bool = True
    stalled: bool = False  # alive, but a transfer's lease lapsed on it; cleared when it reports again
    heard_s: float | None = None  # when its process was last heard (any event; heartbeats every 0.5 s)
    leaving: bool = False  # draining to leave the deployment: it finishes what it has and takes nothing new
    recent_blocks: RecentBlocks = field(default_factory=RecentBlocks)
    max_recent_blocks: int = MAX_RECENT_BLOCKS
    reported: ReportedBlocks = field(default_factory=ReportedBlocks)  # its own reports of its cache contents
    pool: RecentBlocks | None = None  # what every worker wrote to the shared pool lately (`Books.pool`): shared

    @property
    def usable(self) -> bool:
        return self.alive and not self.stalled and not self.leaving

    def prefix_blocks(self, hashes: Sequence) -> int:
        """How many leading blocks of `hashes` (up to AFFINITY_BLOCKS) this worker holds: by its own reports
        once it has sent one (`ReportedBlocks`), else by what it was sent recently (`guessed_blocks`)."""
        if not len(hashes):
            return 0
        return self.reported.prefix_len(_keys(hashes)) if self.reported.reports else self.guessed_blocks(hashes)

    def reach_blocks(self, hashes: Sequence) -> float:
        """`prefix_blocks`, the shared pool counted as a tier below its own: the leading blocks it holds, plus
        `POOL_CREDIT` of each one after them that the pool was written with (a read, not a compute)."""
        held = self.prefix_blocks(hashes)
        if self.pool is None or not len(self.pool) or not len(hashes):
            return held
        return held + POOL_CREDIT * max(self.pool.prefix_len(_keys(hashes)) - held, 0)

    def guessed_blocks(self, hashes: Sequence) -> int:
        """How many leading blocks of `hashes` this worker was sent recently (the gateway's guess)."""
        return self.recent_blocks.prefix_len(_keys(hashes)) if len(hashes) else 0

    def remember(self, hashes: Sequence) -> None:
        if len(hashes):
            keys = _keys(hashes)
            self.recent_blocks.add(keys, self.max_recent_blocks)
            self.reported.sent(keys)


class RoutingPolicy(Protocol):
    def pick(self, workers: Sequence[WorkerLoad], block_hashes: Sequence) -> WorkerLoad | None: ...


class LeastLoaded:
    def pick(self, workers: Sequence[WorkerLoad], block_hashes: Sequence) -> WorkerLoad | None:
        live = [w for w in workers if w.usable]
        return min(live, key=lambda w: w.outstanding) if live else None


class PrefixAffinity:
    """Least loaded, except that a prefix match is worth `weight` outstanding requests (per whole prompt)."""

    def __init__(self, weight: float = 2.0) -> None:
        self.weight = weight

    def pick(self, workers: Sequence[WorkerLoad], block_hashes: Sequence) -> WorkerLoad | None:
        live = [w for w in workers if w.usable]
        if not live:
            return None
        total = max(min(len(block_hashes), AFFINITY_BLOCKS), 1)
        return min(live, key=lambda w: w.outstanding - self.weight * w.reach_blocks(block_hashes) / total)
