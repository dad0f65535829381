"""`SimEngine`: one real `LLMEngine` (real `Scheduler`, real `KVBlockManager`) driven by simulated time.

Like the real worker loop, an engine only looks at its inbox at step boundaries: messages posted while a
step runs wait for its end; an idle engine wakes when a message lands (after every message of that instant,
so simultaneous arrivals are drained together). At a boundary it drains the inbox, lets its role do its
bookkeeping (`hooks.before_step`: grant reservations, settle deliveries), then runs `LLMEngine.step()` and
asks the `SimExecutor` how long that took. Outputs take effect at the step's end. The first step after
the engine sat idle also takes the time model's `wake_time(idle seconds)`.

A pure decode batch may be fast-forwarded (`pdserve.sim.fastforward`): the window's steps are applied
lazily, when the window ends or a message cuts it at the next boundary.

KV tiers: with a `TierSpec`, the engine's executor carries a `SimTierIO` and the real `LLMEngine` builds its
real `TieredKV` (host, and disk, and the cluster's shared pool: `pdserve.sim.kv_pool`) on it; the engine's clock is the simulated time, so block lifecycle metadata
is in simulated seconds. Like the real worker loop, a boundary takes in the finished tier operations before
its bookkeeping; operations submitted then (or by the step's own poll, before its forward) start at once,
those the step produces after its forward start when it ends. An engine whose work waits on an
operation (a prompt prefix being copied into host or prefetched from disk, a reservation that cannot be
granted meanwhile) wakes when the next one ends. A fast-forwarded window replays each step's tier work at
that step's time when it is applied, so the result stays the same as stepping.

`SimRequest` stores token ids in `array('q')`: the same values (hence the same block hashes and prefix hits)
in an eighth of the memory, and hashed without converting every int.
"""

from __future__ import annotations

import bisect
import itertools
from array import array
from collections.abc import Callable

from pdserve.conductor.routing import WorkerLoad
from pdserve.core.sched.decode_cadence import DecodeCadence, plain_decode
from pdserve.core.request import Request
from pdserve.core.sched.schedule import SchedulerConfig
from pdserve.core.settings import KvTierSettings, default_of
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sim import fastforward
from pdserve.sim.events import MESSAGE, EventLoop
from pdserve.sim.executor import SimExecutor
from pdserve.sim.kv_pool import SimKVPool
from pdserve.sim.tier_io import SimTierIO, TierSpec
from pdserve.sim.tiers import DeviceTier
from pdserve.sim.timemodel import StepShape, TimeModel


class SimRequest(Request):
    def __post_init__(self) -> None:
        self.all_token_ids = array("q", self.prompt_token_ids)


class EngineHooks:
    """What the cluster does around an engine's steps (all optional)."""

    def before_step(self, engine: SimEngine) -> None: ...
    def has_pending(self, engine: SimEngine) -> bool:
        """Work for `engine` outside its scheduler that a boundary may start (a reservation to grant)."""
        return False
    def hold_production_s(self, engine: SimEngine) -> float:
        return 0.0

    def on_step_start(self, engine: SimEngine, scheduled, start_s: float, duration_s: float) -> None: ...
    def on_step_end(self, engine: SimEngine, scheduled, outputs, end_s: float) -> None: ...
    def on_decode_run(self, engine: SimEngine, requests: list[Request], ends: list[float],
                      start_s: float) -> None: ...


class SimEngine:
    def __init__(self, name: str, role: str, loop: EventLoop, time_model: TimeModel, config: SchedulerConfig,
                 num_blocks: int, block_size: int, block_bytes: int, tiers: TierSpec | None, hooks: EngineHooks,
                 fast_forward: bool = True, vocab_size: int = 32000,
                 kv_eviction_policy: str = default_of(KvTierSettings, "kv_eviction_policy"),
                 cadence: DecodeCadence | None = None,
                 kv_placement: str = default_of(KvTierSettings, "kv_placement"),
                 kv_max_age_s: float = default_of(KvTierSettings, "kv_max_age_s"), kv_format: str = "bfloat16",
                 kv_pool: SimKVPool | None = None) -> None:
        self.name, self.role, self.loop, self.hooks = name, role, loop, hooks
        self.cadence = cadence  # a decode engine's step cadence (`--decode-cadence steady`)
        self._cadence_log: list[tuple[float, float, float | None, bool]] = []  # a window's steps, for the cadence
        self._clock_s: float | None = None  # set while a fast-forward window's steps are replayed
        self.kv_io = SimTierIO(tiers, self.clock, kv_pool) if tiers is not None else None
        self.executor = SimExecutor(time_model, block_size, vocab_size, kv_io=self.kv_io)
        self.engine = LLMEngine(self.executor, config, num_blocks, kv_eviction_policy=kv_eviction_policy,
                                clock=self.clock, kv_placement=kv_placement, kv_max_age_s=kv_max_age_s,
                                kv_format=kv_format)
        self.tiers = self.engine.tiers  # the real TieredKV (None without a host tier)
        if tiers is not None:  # a reservation's host hits, loaded ahead of its KV: what a copy engine moves
            # during the lightest decode step's forward, per step (the rest in later steps)
            lightest = time_model.step_time(StepShape.decode(1, 1))
            self.engine.scheduler.ahead_load_blocks = max(1, int(lightest * tiers.host_link_bw / block_bytes))
        self.scheduler = self.engine.scheduler
        self.load = WorkerLoad(name, role)
        self.device = DeviceTier(self.engine.block_manager, block_bytes)
        self.block_bytes = block_bytes
        self.peak_tier_blocks = {"host": 0, "disk": 0}
        self._kv_wake_s: float | None = None
        self.fast_forward = fast_forward
        self.inbox: list[Callable[[], None]] = []
        self.busy = False  # a step (or a wake-up) is scheduled
        self.step_end_s = 0.0
        self.last_end_s = 0.0  # when the last step ended (or ends): idle time is counted from there
        self.window: fastforward.Window | None = None
        self._window_open_s = 0.0
        self._window_version = itertools.count()
        self._current_window = -1
        self.num_steps = 0
        self.num_ff_steps = 0
        self.busy_s = 0.0

    def clock(self) -> float:
        """The engine's clock (the `LLMEngine`'s): simulated seconds."""
        return self.loop.now if self._clock_s is None else self._clock_s

    # ---- messages ---------------------------------------------------------------------------------------
    def post(self, fn: Callable[[], None], delay_s: float = 0.0) -> None:
        """Deliver `fn` to this engine's inbox now (+delay); it runs at the engine's next step boundary."""
        self.loop.at(self.loop.now + delay_s, self._receive, fn, prio=MESSAGE)

    def _receive(self, fn: Callable[[], None]) -> None:
        self.inbox.append(fn)
        if self.window is not None:
            self._cut_window(self.loop.now)
        elif not self.busy:
            self.busy = True
            self.loop.at(self.loop.now, self._boundary)

    # ---- the loop ---------------------------------------------------------------------------------------
    def _boundary(self) -> None:
        now = self.loop.now
        inbox, self.inbox = self.inbox, []
        for fn in inbox:
            fn()
        if self.tiers is not None:  # as the real worker loop, before its reservations' bookkeeping
            self.engine.poll_kv()
            self.kv_io.start(now)
        self.hooks.before_step(self)
        sched = self.scheduler
        if sched.num_running + sched.num_waiting == 0 and not sched.has_pending_loads:
            self.busy = False
            self.device.observe(now)
            if self.tiers is not None:
                # No step follows: the idle worker loop's next poll submits what a reservation's lookup
                # started (a prefetch), and the engine wakes when an operation ends if a reservation waits.
                self.engine.poll_kv()
                self.kv_io.start(now)
                if self.hooks.has_pending(self) or self.engine.kv_lifecycle.next_wake_s() < float("inf"):
                    self._arm_kv_wake()
            return
        hold = self.hooks.hold_production_s(self)
        if hold > 0:  # backpressure: its links are backed up; look again when they should have drained
            self.loop.at(now + hold, self._boundary)
            return
        if self.fast_forward and self._may_fast_forward() and self._open_window(now):
            return
        self._step(now)

    def _wake_s(self, now: float, decode: bool) -> float:
        idle = now - self.last_end_s
        return self.executor.time_model.wake_time(idle, decode) if idle > 0 else 0.0

    def _step(self, now: float) -> None:
        outputs = self.engine.step()
        scheduled, duration = self.executor.last, self.executor.last_duration
        self.device.observe(now)
        if scheduled.is_empty and not (scheduled.kv_loads or scheduled.kv_loads_ahead):  # nothing runnable until
            # a message or a tier op
            if self.kv_io is not None:
                self._observe_tiers()
                self.kv_io.start(now)
                self._arm_kv_wake()
            self.busy = False
            return
        wake = self._wake_s(now, decode=self.executor.last_shape.prefill_tokens == 0)
        end = (now + wake) + duration  # the fast-forward's float operations, so both agree bit for bit
        if self.cadence is not None and self.role == "decode" and scheduled.chunks:  # (tokens go out)
            # a plain decode step sets the period (one that woke the engine does not)
            end = _paced_end(self.cadence, now, end, plain_decode(scheduled) and wake == 0, self._tpot_slo_s())
        if self.kv_io is not None:
            self._observe_tiers()
            self.kv_io.start(end)  # what the step produced is copied once its forward is done
        self.num_steps += 1
        self.busy_s += end - now
        self.step_end_s = self.last_end_s = end
        # a real worker times a step that woke it from its start: the wake-up is part of that step (its first
        # layers run slow), so it begins now and lasts wake + duration (consumption checks, step reports)
        self.hooks.on_step_start(self, scheduled, now, wake + duration)
        self.loop.at(end, self._step_end, scheduled, outputs)

    def _step_end(self, scheduled, outputs) -> None:
        self.hooks.on_step_end(self, scheduled, outputs, self.loop.now)
        self._boundary()

    # ---- KV tiers ---------------------------------------------------------------------------------------
    def _observe_tiers(self) -> None:
        for tier in self.tiers.tiers():
            name = tier.tier.value
            if len(tier) > self.peak_tier_blocks[name]:
                self.peak_tier_blocks[name] = len(tier)

    def _arm_kv_wake(self) -> None:
        """Wake when the next tier operation ends (work may be waiting for it), or when the placement's next
        move ahead of an expected use is due (`KVLifecycle.next_wake_s`)."""
        t = self.kv_io.next_done_s() if self.kv_io is not None else None
        move = self.engine.kv_lifecycle.next_wake_s()
        if move < float("inf"):
            t = move if t is None else min(t, move)
        if t is None:
            return
        t = max(t, self.loop.now)
        if self._kv_wake_s is not None and self._kv_wake_s <= t:
            return
        self._kv_wake_s = t
        self.loop.at(t, self._kv_wake, t, prio=MESSAGE)

    def _kv_wake(self, t: float) -> None:
        if t != self._kv_wake_s:
            return  # an earlier wake-up took its place
        self._kv_wake_s = None
        if not self.busy and (self.scheduler.num_waiting or self.hooks.has_pending(self)
                              or self.engine.kv_lifecycle.next_wake_s() <= self.loop.now):
            self.busy = True
            self.loop.at(self.loop.now, self._boundary)

    # ---- fast-forward -----------------------------------------------------------------------------------
    def _open_window(self, now: float) -> bool:
        wake = self._wake_s(now, decode=True)
        window = fastforward.plan(self.scheduler, self.executor.time_model, now + wake, self.executor.token_id,
                                  pace=self._window_pace(now, wake), boundary_s=now)
        if window is not None and self.engine.kv_lifecycle.next_wake_s() < window.ends[-1]:
            window = fastforward.cut_before(window, self.engine.kv_lifecycle.next_wake_s(), now + wake)
        if window is None:
            return False
        self.window, self._window_open_s = window, now  # the window's steps start at now + wake
        self._current_window = next(self._window_version)
        self.step_end_s = window.ends[0]
        self.last_end_s = window.ends[-1]
        self.loop.at(window.ends[-1], self._window_end, self._current_window)
        return True

    def _window_pace(self, now: float, wake: float) -> Callable[[float, float], float] | None:
        """A window's steps paced by the cadence: planned on a copy, replayed on it as they are applied."""
        if self.cadence is None or self.role != "decode":
            return None
        trial, slo, log = self.cadence.trial(), self._tpot_slo_s(), []
        self._cadence_log = log

        def pace(start: float, end: float) -> float:
            sample = wake == 0 or start != now  # a step that woke the engine does not set the period
            log.append((start, end, slo, sample))
            return _paced_end(trial, start, end, sample, slo)
        return pace

    def _tpot_slo_s(self) -> float | None:
        return self.scheduler.step_budget.tightest_tpot_s(self.scheduler.running)

    def _may_fast_forward(self) -> bool:
        """With KV tiers, a reservation waiting for blocks or for a tier operation (a prefix being copied into
        host, or prefetched from disk) may be granted at any step boundary, as operations end: step one by
        one then. One waiting for a decode slot cannot be granted before a request ends, which ends a window."""
        if self.tiers is None or not self.hooks.has_pending(self):
            return True
        sched = self.scheduler
        return len(sched.running) + sched.num_waiting_for_kv >= sched.config.max_num_seqs

    def _window_end(self, version: int) -> None:
        if version != self._current_window:
            return
        self._close_window(len(self.window.ends))
        self._boundary()

    def _cut_window(self, now: float) -> None:
        """A message arrived: the step in progress is the last one; the boundary after it drains the inbox."""
        j = bisect.bisect_left(self.window.ends, now) + 1
        end = self.window.ends[j - 1]
        self.last_end_s = end
        self._close_window(j)
        self._current_window = next(self._window_version)
        self.loop.at(end, self._boundary)

    def _close_window(self, j: int) -> None:
        window, self.window = self.window, None
        starts = [self._window_open_s] + window.ends[:j - 1]
        if self._cadence_log:
            for start, end, slo, sample in self._cadence_log[:j]:
                _paced_end(self.cadence, start, end, sample, slo)
            self._cadence_log = []
        if self.tiers is None:
            used = fastforward.apply(self.scheduler, window, j, self.executor.token_id)
        else:  # each step's tier work at its own time, as stepping does it
            try:
                used = fastforward.apply(self.scheduler, window, j, self.executor.token_id,
                                         _WindowTierWork(self, starts, window.ends))
            finally:
                self._clock_s = None
        self.device.observe_many(starts, used)
        self.num_steps += j
        self.num_ff_steps += j
        self.busy_s += window.ends[j - 1] - self._window_open_s
        self.hooks.on_decode_run(self, window.requests, window.ends[:j], self._window_open_s)  # (as a step)


def _paced_end(cadence: DecodeCadence, start: float, end: float, decode_only: bool, slo: float | None) -> float:
    """A step from `start` whose forward ends at `end`: when its outputs go out under the cadence."""
    step = end - start
    held = cadence.pace(start, step, decode_only, slo)
    return end if held == step else start + held


class _WindowTierWork:
    """A fast-forward window's tier work, step by step at each step's time (`fastforward.StepWork`)."""

    def __init__(self, engine: SimEngine, starts: list[float], ends: list[float]) -> None:
        self.e, self.starts, self.ends = engine, starts, ends

    def before(self, i: int) -> None:  # LLMEngine.step's poll_kv; SimExecutor.execute starts what it submits
        e = self.e
        e._clock_s = t = self.starts[i - 1]
        if (e.kv_io.due(t) or e.engine.block_manager.has_pins or e.tiers.has_new_ops
                or e.engine.kv_lifecycle.next_due_s() <= t):
            e.engine.poll_kv()
            e.kv_io.start(t)
            e._observe_tiers()

    def after(self, i: int) -> None:
        e = self.e
        if e.tiers.has_step_work(e._clock_s):
            e.kv_io.submit(e.tiers.after_step())
            e._observe_tiers()
            e.kv_io.start(self.ends[i - 1])

    def next_step(self, i: int) -> int:
        """The first step after i whose start finds an operation done or tier work due (the checks above)."""
        e = self.e
        if e.engine.block_manager.has_pins or e.tiers.has_new_ops:
            return i + 1
        t = min(e.kv_io.next_due_s(), e.tiers.next_work_s())
        return bisect.bisect_left(self.starts, t, i) + 1
