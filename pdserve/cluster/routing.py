"""Routing policies: which worker of a role gets a request. Small injected objects, no torch, no sockets.

The conductor keeps, per worker, the chained block hashes of the prompts it sent there (bounded LRU): a
worker that saw a prefix recently probably still has its KV blocks cached.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import takewhile
from typing import Protocol


AFFINITY_BLOCKS = 256  # prefix affinity looks at a prompt's first blocks only (4,096 tokens at block 16)
MAX_RECENT_BLOCKS = 65536  # block hashes remembered per worker, at most (fewer: its KV capacity, once known)


@dataclass
class WorkerLoad:
    name: str
    role: str
    outstanding: int = 0  # requests routed here and not finished (the gateway's own count: no lag)
    alive: bool = True
    stalled: bool = False  # alive, but a transfer's lease lapsed on it; cleared when it reports again
    leaving: bool = False  # draining to leave the deployment: it finishes what it has and takes nothing new
    recent_blocks: OrderedDict = field(default_factory=OrderedDict)  # block hash -> None, LRU
    max_recent_blocks: int = MAX_RECENT_BLOCKS

    @property
    def usable(self) -> bool:
        return self.alive and not self.stalled and not self.leaving

    def prefix_blocks(self, hashes: Sequence) -> int:
        """How many leading blocks of `hashes` (up to AFFINITY_BLOCKS) this worker was sent recently."""
        # (C-level loops: the conductor asks this of every worker for every prompt)
        return len(list(takewhile(self.recent_blocks.__contains__, hashes[:AFFINITY_BLOCKS])))

    def remember(self, hashes: Sequence) -> None:
        head = hashes[:AFFINITY_BLOCKS]
        self.recent_blocks.update(dict.fromkeys(head))
        deque(map(self.recent_blocks.move_to_end, head), maxlen=0)  # most recent last, in order
        while len(self.recent_blocks) > self.max_recent_blocks:
            self.recent_blocks.popitem(last=False)


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
        return min(live, key=lambda w: w.outstanding - self.weight * w.prefix_blocks(block_hashes) / total)


POLICIES = {"least-loaded": LeastLoaded, "prefix-affinity": PrefixAffinity}


def make_routing_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name]()
