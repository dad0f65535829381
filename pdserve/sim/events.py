"""The discrete-event loop: a heap of (time, priority, sequence) -> callback.

At equal times, lower priority runs first: messages into an engine (`MESSAGE`) land before that engine's
step boundary (`STEP`), so an engine always sees everything that reached it by the boundary. The sequence
number makes the order total and the run deterministic. Callers cancel by versioning (a stale callback
checks its version and returns).

While it runs, Python's cycle collector is kept quiet (`quiet_gc`): a replay allocates millions of short-lived
containers, and with the default threshold the collector ran every 700 of them and rescanned the set-up (the
workload's prompts, every engine's tables) at each full collection.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
from collections.abc import Callable, Iterator

MESSAGE, STEP, SAMPLE = 0, 1, 2
GC_YOUNG = 20_000  # allocations between two young-generation collections while a loop runs (Python's: 700)


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """Objects alive now are left out of collections (`gc.freeze`), and young ones are collected less often;
    both undone on exit (cycles made meanwhile are still collected, just in larger batches). Garbage is
    collected before the freeze: frozen, an earlier run's dead cycles would be kept through this run and land
    in the oldest generation after it (a plan of 35 runs grew by ~300 MB a run, to an out-of-memory kill)."""
    threshold = gc.get_threshold()
    freeze = gc.get_freeze_count() == 0  # (a caller that froze objects itself keeps them frozen)
    if freeze:
        gc.collect()
        gc.freeze()
    gc.set_threshold(max(threshold[0], GC_YOUNG), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if freeze:
            gc.unfreeze()


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple] = []
        self._seq = itertools.count()
        self.num_events = 0

    def at(self, t: float, fn: Callable, *args, prio: int = STEP) -> None:
        if t < self.now:
            raise ValueError(f"event at {t} is in the past (now {self.now})")
        heapq.heappush(self._heap, (t, prio, next(self._seq), fn, args))

    def run(self, until: float = float("inf"), on_tick: Callable[[float], None] | None = None) -> None:
        heap, pop = self._heap, heapq.heappop
        with quiet_gc():
            while heap and heap[0][0] <= until:
                t, _, _, fn, args = pop(heap)
                self.now = t
                self.num_events += 1
                fn(*args)
                if on_tick is not None and not self.num_events & 1023:
                    on_tick(t)

    def __len__(self) -> int:
        return len(self._heap)
