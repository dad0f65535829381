"""A decode worker's step cadence: its steps' tokens go out at a steady period, so every stream's gaps stay even.

A decode step's time follows its batch: a request with a long context joining adds its KV reads to every
step, one leaving takes them away (on an H100 with llama-3-8b, each 8,000-token request is ~0.4 ms of a ~7 ms
step). Every stream in the batch feels each such change as a shift of its inter-token gap, and a stream
whose gaps shift is what P99 inter-token jitter measures (|gap - the stream's mean gap|). Scheduled
delivery removes the shifts that came from KV arriving late; these are the consumption side's own.

`--decode-cadence steady` paces them: a step's outputs go out `period` after the step began, not when its
forward ended, where

    period = min(the q-quantile (`quantile`, 0.99) of the step times of the last `window_s` (20) seconds,
                 `max_stretch` (1.25) x this step's own time,
                 HEADROOM (0.85) x the tightest TPOT SLO among the requests decoding)

and a step that takes longer than the period is never held. While the batch is steady the period is the
steps' own time; as requests join and leave, the period holds the recent high level, so a gap changes only
when the window's quantile does (a window of several request lifetimes and a high quantile: on 600 Mooncake
requests in the simulator, untagged, 1-3 req/s, 5 s at the 95th percentile left a P99 jitter of 0.34-0.47 ms,
20 s at the 99th 0.25-0.33 ms; the maximum follows every outlier). The price is latency: each token waits `period - step time` (counted:
`held_s`, `pdserve_decode_cadence_held_seconds_total`), and the worker's device idles meanwhile (the real
worker drains its inbox and its KV bookkeeping in that time). It costs no throughput where it matters: a
saturated decode worker's steps all run near the period already. Steps carrying prefill tokens (a
recompute) are paced like any other but do not set the period. Until `MIN_SAMPLES` steps are in the window
(a worker that sat idle), nothing is held.

One copy for both clocks: the real decode worker holds a step's outputs until `started + pace(...)` (its inbox
served meanwhile, `pdserve.worker.worker`); the simulator's decode engine ends the step there
(`pdserve.sim.engine`, and its fast-forward windows step by step with a copy, `trial`).
"""

from __future__ import annotations

import bisect
from collections import deque

from pdserve.core.sched.step_budget import HEADROOM
from pdserve.errors import InvalidRequestError

CADENCE_MODES = ("off", "steady")
MIN_SAMPLES = 8


def check_cadence(mode: str) -> str:
    if mode not in CADENCE_MODES:
        raise InvalidRequestError(f"decode cadence must be one of {', '.join(CADENCE_MODES)}, got {mode!r}",
                                  param="decode_cadence")
    return mode


def plain_decode(scheduled) -> bool:
    """A step that may set the period: one token per request, no host tier loads (a `SchedulerOutput`)."""
    return (not (scheduled.kv_loads or scheduled.kv_loads_ahead)
            and all(c.num_tokens == 1 for c in scheduled.chunks))


class DecodeCadence:
    def __init__(self, window_s: float = 20.0, quantile: float = 0.99, max_stretch: float = 1.25) -> None:
        if window_s <= 0 or not 0.0 < quantile <= 1.0 or max_stretch < 1.0:
            raise ValueError("decode cadence: window_s > 0, 0 < quantile <= 1 and max_stretch >= 1 are required")
        self.window_s, self.quantile, self.max_stretch = window_s, quantile, max_stretch
        self._recent: deque[tuple[float, float]] = deque()  # (step start, its time), oldest first
        self._sorted: list[float] = []  # the same times, sorted
        self.held_s = 0.0  # seconds outputs were held past their step's end
        self.num_held = 0  # steps whose outputs were held
        self.period_s = 0.0  # the last step's period (0 until the window is warm)

    def pace(self, start_s: float, step_s: float, decode_only: bool = True, tpot_slo_s: float | None = None
             ) -> float:
        """A step began at `start_s` and took `step_s`: how long after `start_s` its outputs go out."""
        self._expire(start_s)
        period = self._period(step_s, tpot_slo_s)
        if decode_only:
            self._recent.append((start_s, step_s))
            bisect.insort(self._sorted, step_s)
        self.period_s = period
        if period <= step_s:
            return step_s
        self.held_s += period - step_s
        self.num_held += 1
        return period

    def _period(self, step_s: float, tpot_slo_s: float | None) -> float:
        n = len(self._sorted)
        if n < MIN_SAMPLES:
            return 0.0
        level = self._sorted[min(n - 1, max(0, -int(-self.quantile * n) - 1))]  # nearest rank
        period = min(level, self.max_stretch * step_s)
        return period if tpot_slo_s is None else min(period, HEADROOM * tpot_slo_s)

    def _expire(self, now_s: float) -> None:
        recent, cut = self._recent, now_s - self.window_s
        while recent and recent[0][0] < cut:
            _, step_s = recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, step_s)]

    def trial(self) -> DecodeCadence:
        """A copy to plan steps ahead with (a simulator's fast-forward window); this one is left as it is."""
        twin = DecodeCadence(self.window_s, self.quantile, self.max_stretch)
        twin._recent, twin._sorted = deque(self._recent), list(self._sorted)
        return twin

    def stats(self) -> dict:
        return {"cadence_period_s": self.period_s, "cadence_held_s": self.held_s, "cadence_held_steps": self.num_held}
