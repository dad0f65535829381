"""The scheduler's waiting requests, in its queue policy's order (`pdserve.core.sched.policy`).

A heap keyed by the policy's sort key. A request that ends while it waits (an abort) is not searched for: it
is counted out at once (`ended`) and its entry is dropped when it reaches the head.
"""

from __future__ import annotations

import heapq

from pdserve.core.sched.policy import QueuePolicy
from pdserve.core.request import Request


class WaitingQueue:
    def __init__(self, policy: QueuePolicy) -> None:
        self.policy = policy
        self._heap: list[tuple[tuple, Request]] = []
        self._count = 0  # live entries (finished ones still in the heap are not counted)

    def __len__(self) -> int:
        return self._count

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (self.policy.sort_key(req), req))
        self._count += 1

    def peek(self) -> Request | None:
        """The first live request, or None."""
        heap = self._heap
        while heap and heap[0][1].is_finished:
            heapq.heappop(heap)
        return heap[0][1] if heap else None

    def pop(self) -> Request:
        """Remove the first request (call `peek` first: it drops the finished ones ahead of it)."""
        _, req = heapq.heappop(self._heap)
        self._count -= 1
        return req

    def reorder(self) -> None:
        """The policy's keys changed (dynamic tier weights): the heap again in its order."""
        self._heap = [(self.policy.sort_key(req), req) for _, req in self._heap if not req.is_finished]
        heapq.heapify(self._heap)

    def requests(self) -> list[Request]:
        """The live waiting requests, in no particular order."""
        return [req for _, req in self._heap if not req.is_finished]

    def ended(self) -> None:
        """A waiting request ended where it was (its entry goes when it reaches the head)."""
        self._count -= 1
