"""Fast-forward: advance a pure decode batch several steps at once, exactly as stepping one by one would.

While every running request is decoding (one token per step), nothing waits to be admitted and no message
reaches the engine, the next steps are fully determined: the same requests, one token each, blocks allocated
whenever a request crosses a block boundary, full blocks registered in the prefix cache, and step times that
depend only on the batch size and total context. `plan` checks those conditions and returns a `Window` of at
most K steps that ends before the first completion and before the pool could run out of blocks (so no
preemption can happen inside). `apply` then performs the first j steps' effects on the real scheduler state
in the order the real `schedule()`/`update()` calls would: allocations of step i in running order, then
registrations of step i, then step i+1. Nothing in the window touches the scheduler until it is applied, so
a message arriving mid-window cuts it at the next step boundary and the result is the same as stepping.
With KV tiers, `apply` calls `work.before(i)` and `work.after(i)` around step i so the engine can replay what
each real step does with them at that step's time (take in finished tier operations; copy new blocks down).
Steps where nothing happens (no block allocated or filled, no tier work due by `work.next_step`) are skipped:
a window costs its events, not its steps.
A step with host -> device loads pending (a reservation's host hits) is never fast-forwarded.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from collections.abc import Callable
from typing import Protocol

import numpy as np

from pdserve.core.request import Request, RequestStatus
from pdserve.core.sched.scheduler import Scheduler
from pdserve.sim.timemodel import StepShape, TimeModel

MIN_STEPS = 2  # windows shorter than this are not worth planning


@dataclass
class Window:
    requests: list[Request]  # the running batch, in running order
    start_s: float
    ends: list[float]  # end time of each step in the window
    # (step index 1.., request index) of each block allocation, in the order the real scheduler makes them
    allocs: list[tuple[int, int]]


def _steps_left(sched: Scheduler, req: Request) -> int:
    """Steps until `req` finishes by length (the only way it can finish: ignore_eos, no stop tokens)."""
    return min(req.sampling_params.max_tokens - req.num_output_tokens, sched.max_model_len - req.num_tokens)


def eligible(sched: Scheduler, token_id: int) -> bool:
    running = sched.running
    if not running or sched.num_waiting or len(running) > sched.config.max_num_batched_tokens:
        return False
    if sched.has_pending_loads:  # the next step loads a reservation's host hits: it is no plain decode
        return False
    for req in running:
        p = req.sampling_params
        if (req.status is not RequestStatus.DECODING or req.num_computed_tokens != req.num_tokens - 1
                or req.num_output_tokens < 1 or token_id in p.stop_token_ids
                or (not p.ignore_eos and token_id in req.eos_token_ids)):
            return False
    return True


def plan(sched: Scheduler, time_model: TimeModel, now: float, token_id: int, max_steps: int = 1 << 30,
         pace: Callable[[float, float], float] | None = None, boundary_s: float | None = None) -> Window | None:
    """`pace(start, end)`: a step's end as the decode cadence holds it (`pdserve.core.sched.decode_cadence`), the
    window's steps starting at `boundary_s` (before any wake-up; default `now`)."""
    if not eligible(sched, token_id):
        return None
    running = list(sched.running)
    k = min(min(_steps_left(sched, r) for r in running) - 1, max_steps)
    if k < MIN_STEPS:
        return None
    bs, free = sched.blocks.block_size, sched.blocks.num_free_blocks
    allocs: list[tuple[int, int]] = []
    for idx, req in enumerate(running):
        # Step i computes token c + i - 1 and needs c + i tokens of room: a new block when c + i > table * bs.
        first = len(sched.blocks.block_ids(req.request_id)) * bs - req.num_computed_tokens + 1
        allocs.extend((i, idx) for i in range(max(first, 1), k + 1, bs))
    allocs.sort()
    if len(allocs) > free:
        k = allocs[free][0] - 1  # stop before the step whose allocation could fail
        allocs = allocs[:free]
        allocs = [a for a in allocs if a[0] <= k]
        if k < MIN_STEPS:
            return None
    n, ctx = len(running), sum(r.num_computed_tokens for r in running)
    if pace is not None:  # each step ends where the cadence holds it; the next starts there
        ends, t, start = [], now, now if boundary_s is None else boundary_s
        durations = (time_model.decode_times(n, ctx, k).tolist() if hasattr(time_model, "decode_times") else
                     [time_model.step_time(StepShape.decode(n, ctx + n * i)) for i in range(1, k + 1)])
        for d in durations:
            t = start = pace(start, t + d)
            ends.append(t)
        return Window(running, now, ends, allocs)
    if hasattr(time_model, "decode_times"):  # same floats, one numpy pass; accumulate adds left to right
        ends = np.add.accumulate(np.concatenate(([now], time_model.decode_times(n, ctx, k))))[1:].tolist()
        return Window(running, now, ends, allocs)
    ends, t = [], now
    for i in range(1, k + 1):
        t = t + time_model.step_time(StepShape.decode(n, ctx + n * i))
        ends.append(t)
    return Window(running, now, ends, allocs)


def cut_before(window: Window, t: float, first_start_s: float) -> Window | None:
    """`window` without the steps that start at or after `t` (the first starts at `first_start_s`): a tier move
    due then (`KVLifecycle.next_wake_s`) takes effect at the next boundary, as stepping would; None when fewer
    than MIN_STEPS are left."""
    k = bisect.bisect_left(window.ends, t) + 1 if first_start_s < t else 0  # steps starting before t
    if k >= len(window.ends):
        return window
    if k < MIN_STEPS:
        return None
    return Window(window.requests, window.start_s, window.ends[:k], [a for a in window.allocs if a[0] <= k])


class StepWork(Protocol):
    """What the engine does around each applied step besides the scheduler's own state (its KV tiers)."""

    def before(self, i: int) -> None: ...  # before step i's allocations
    def after(self, i: int) -> None: ...  # after step i's registrations
    def next_step(self, i: int) -> int: ...  # the first step after i where before/after could do anything


def apply(sched: Scheduler, window: Window, j: int, token_id: int, work: StepWork | None = None) -> list[int]:
    """Perform steps 1..j of the window; return the used-block count after each step (as the engine observes
    it after a real step). Only the steps where something happens are visited (an allocation, a block filling,
    or `work.next_step`): the others would change nothing."""
    blocks, bs, reqs = sched.blocks, sched.blocks.block_size, window.requests
    base = [r.num_computed_tokens for r in reqs]
    for r in reqs:
        r.all_token_ids.extend([token_id] * j)  # tokens are only read below the computed count
    crossing: dict[int, list[int]] = {}  # step -> the requests whose last block fills at it
    for idx, b in enumerate(base):
        for i in range(bs - b % bs, j + 1, bs):
            crossing.setdefault(i, []).append(idx)
    events = sorted(crossing.keys() | {i for i, _ in window.allocs if i <= j})
    used_after: list[int] = []
    a = e = 0
    i = 1
    while i <= j:
        if work is not None:
            work.before(i)
        while a < len(window.allocs) and window.allocs[a][0] == i:
            idx = window.allocs[a][1]
            if blocks.allocate(reqs[idx].request_id, base[idx] + i) is None:
                raise AssertionError("fast-forward allocation failed; the window was planned wrong")
            a += 1
        for idx in crossing.get(i, ()):
            blocks.cache_full_blocks(reqs[idx].request_id, reqs[idx].all_token_ids, base[idx] + i, True)
        if work is not None:
            work.after(i)  # may hold blocks (copies down), as the real step's end does
        while e < len(events) and events[e] <= i:
            e += 1
        nxt = events[e] if e < len(events) else j + 1
        if work is not None:
            nxt = min(nxt, work.next_step(i))
        nxt = min(nxt, j + 1)
        used_after.extend([blocks.num_used_blocks] * (nxt - i))
        i = nxt
    for idx, r in enumerate(reqs):
        r.num_computed_tokens = base[idx] + j
    return used_after
