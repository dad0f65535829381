"""Queue policies: which waiting request goes first, and which running request is preempted first.

A policy is one method returning a sort key; smaller keys are served first and preempted last.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Protocol

from pdserve.core.request import Request


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


QUEUE_POLICIES: dict[str, type] = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}


def make_queue_policy(name: str) -> QueuePolicy:
    try:
        return QUEUE_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown queue policy {name!r}; choose from {sorted(QUEUE_POLICIES)}") from None
