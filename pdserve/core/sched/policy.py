"""Queue policies: which waiting request goes first, and which running request is preempted first.

`tiered` (the default) orders by service tier (`pdserve.core.service_tiers`); `fcfs` ignores tiers;
`priority` orders by the request's integer `priority` (vLLM's `--scheduling-policy priority`).

A policy is one method returning a sort key; smaller keys are served first and preempted last.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Protocol

from pdserve.core.request import Request
from pdserve.core.service_tiers import ServiceTiers


class QueuePolicy(Protocol):
    def sort_key(self, request: Request) -> tuple: ...


class FCFSPolicy:
    """First come, first served; ties broken by submission order."""

    def sort_key(self, request: Request) -> tuple:
        return (request.arrival_s, request.arrival_seq)


class PriorityPolicy:
    """Lower `priority` value first (as in vLLM), then first come, first served."""

    def sort_key(self, request: Request) -> tuple:
        return (request.priority, request.arrival_s, request.arrival_seq)


def insert_in_order(queue: list, item, request_of: Callable[[object], Request], policy: QueuePolicy) -> None:
    """Insert `item` (which stands for the request `request_of(item)`) into `queue`, kept in `policy`'s
    order: the one rule for every queue outside the scheduler that a policy orders (the decode worker's
    reservations, real and simulated), so they never undo the order the waiting queue keeps."""
    bisect.insort(queue, item, key=lambda it: policy.sort_key(request_of(it)))


class TieredPolicy:
    """Service tiers (`pdserve.core.service_tiers`): priority first, then default and flex by earliest virtual
    deadline (arrival + the tier's TTFT horizon / weight, the weight scaled by the elastic tiers' dynamic factor:
    `pdserve.core.sched.tier_weights`). With every request in one tier it is FCFS."""

    def __init__(self, tiers: ServiceTiers | None = None) -> None:
        self.tiers = tiers or ServiceTiers()
        self._keys = {name: (t.rank, t.horizon_s) for name, t in self.tiers.tiers.items()}
        self.factors: dict[str, float] = {}  # tier -> its weight's dynamic factor (absent: 1)

    def sort_key(self, request: Request) -> tuple:
        rank, horizon_s = self._keys[request.service_tier]
        return (rank, request.arrival_s + horizon_s / self.factors.get(request.service_tier, 1.0),
                request.arrival_seq)


QUEUE_POLICIES: dict[str, type] = {"fcfs": FCFSPolicy, "priority": PriorityPolicy, "tiered": TieredPolicy}


def make_queue_policy(name: str, tiers: ServiceTiers | None = None) -> QueuePolicy:
    if name not in QUEUE_POLICIES:
        raise ValueError(f"unknown queue policy {name!r}; choose from {sorted(QUEUE_POLICIES)}")
    return TieredPolicy(tiers) if name == "tiered" else QUEUE_POLICIES[name]()
