"""How long one step may run, in prefill tokens, so the service tiers' TPOT and TTFT SLOs can be kept.

A decode token waits for the whole step it is in, and so does a request that arrives while it runs: a step
that takes in a long prefill chunk (or several new prompts at once) stretches the inter-token time of every
request decoding in it and the time to first token of every request arriving meanwhile. Sarathi-Serve
bounds this with a fixed chunk size; here the bound comes from the SLOs (`--service-tier NAME:...`):

* while a request of a tier with a TPOT SLO is decoding, a step's predicted time stays within `headroom`
  (0.85) x the tightest such SLO among the decoding requests;
* whenever any tier has a TTFT SLO, a step's predicted time stays within `TTFT_SHARE` (0.25) x the tightest
  TTFT SLO, so a request arriving mid-step loses at most that before it can be scheduled.

Predicted step time:

    t(step) ~ a + b * prefill tokens + c * sum of chunk^2 + d * sum of chunk x its prefix
              + e * decode context + f * decode batch

fitted online (`pdserve.core.sched.online_fit`, non-negative least squares, the family of the admission model
plus the prefix-attention term) from the steps this worker ran that carried prefill tokens: real seconds on a
real worker, modelled seconds in the simulator. Decode-only steps are left out (the decode part is fitted
from mixed steps), so a simulator's fast-forwarded decode run changes nothing. Until the fit has
`MIN_SAMPLES` steps, a prefill token is taken to cost the most seconds per prefill token of the last few
prefill steps (their whole time: an upper bound). The scheduler asks `begin` once per step, then `take` for
each prefill chunk in queue order: each gets the most tokens that still fit (its own prefix counted). The
fit's error on the capped steps is fed back: the allowance is divided by a moving average of actual /
predicted time of those steps (between 0.5 and 3). The first chunk of a step always gets at least
`min_tokens` (a KV block), so prompts progress under any SLO. With no such SLO, or before any prefill step
was seen, every chunk gets what it asks (the token budget still applies).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from pdserve.core.sched.online_fit import OnlineFit, StepRow
from pdserve.core.request import Request, RequestStatus
from pdserve.core.sched.schedule import SchedulerOutput
from pdserve.core.service_tiers import ServiceTiers

HEADROOM = 0.85
TTFT_SHARE = 0.25
CORRECTION_EWMA = 0.1
COLD_START_STEPS = 4  # prefill steps whose seconds per token bound the cost before the fit is ready


class StepBudget:
    def __init__(self, tiers: ServiceTiers, max_tokens: int, min_tokens: int, headroom: float = HEADROOM) -> None:
        self.tpot_s = {name: t.tpot_ms / 1000.0 for name, t in tiers.tiers.items() if t.tpot_ms is not None}
        ttfts = [t.ttft_ms / 1000.0 for t in tiers.tiers.values() if t.ttft_ms is not None]
        self.max_step_s = TTFT_SHARE * min(ttfts) if ttfts else None  # the TTFT bound on any step
        self._per_token: deque = deque(maxlen=COLD_START_STEPS)  # seconds / prefill token of recent steps
        self.max_tokens = max_tokens
        self.min_tokens = min(min_tokens, max_tokens)
        self.headroom = headroom
        self.fit = OnlineFit(6)
        self.last_cap = max_tokens  # prefill tokens of a fresh prompt the last step could carry (a metric)
        self.num_capped_steps = 0
        self.num_cold_start_steps = 0  # capped with the seconds-per-token bound, the fit not ready (a fallback)
        self._left: float | None = None  # seconds of prefill this step may still add; None: no cap
        self._coef: tuple[float, ...] = ()
        self._base = 0.0  # predicted seconds of the step without its prefill
        self._granted = 0
        self._predicted: float | None = None  # the capped step's predicted seconds
        self.correction = 1.0  # actual / predicted seconds of capped steps, a moving average

    @property
    def capped(self) -> bool:
        """The step being scheduled has a prefill allowance (an SLO bounds it and a cost is known)."""
        return self._left is not None

    @property
    def active(self) -> bool:
        """Some tier has an SLO that bounds steps: they are observed and capped."""
        return bool(self.tpot_s) or self.max_step_s is not None

    def observe(self, scheduled: SchedulerOutput, seconds: float) -> None:
        """A step ran and took `seconds`; steps without prefill tokens are not used."""
        if not self.active:
            return
        if self._predicted is not None and self._predicted > 0:
            ratio = min(max(seconds / self._predicted, 0.5), 3.0)
            self.correction += CORRECTION_EWMA * (ratio - self.correction)
        self._predicted = None
        self.learn(StepRow.of(scheduled, seconds))

    def learn(self, row: StepRow) -> None:
        """A step's shape and time for the fit: one the worker ran (`observe`), or one its profile at load
        timed (`pdserve.engine.calibration`), so the fit is ready before the first request."""
        if self.active and row.prefill_tokens:
            self.fit.add(row.terms(), row.seconds)
            self._per_token.append(row.seconds / row.prefill_tokens)

    def begin(self, running: Iterable[Request]) -> None:
        """A step is being scheduled with `running` in the batch: set its prefill time allowance."""
        self._left, self._granted, self._predicted = None, 0, None
        if self.active:
            self._allow(running)
        capped = self._left is not None
        self.last_cap = max(self._fit_tokens(self.max_tokens, 0), self.min_tokens) if capped else self.max_tokens
        if capped:
            self._predicted = self._base
        self.num_capped_steps += capped and self.last_cap < self.max_tokens

    def refresh_cap(self) -> None:
        """Set `last_cap` as a step with nothing decoding would have it now, counting nothing: a worker whose
        profile the fit learned at load reports its cap before its first step (the conductor's admission
        predicts prefill in chunks of it)."""
        counts = self.num_capped_steps, self.num_cold_start_steps
        self.begin(())
        self.num_capped_steps, self.num_cold_start_steps = counts
        self._left = self._predicted = None

    def take(self, n: int, start_pos: int) -> int:
        """Tokens granted to a prefill chunk that wants `n` tokens from position `start_pos` (0: none)."""
        if self._left is None:
            return n
        got = self._fit_tokens(n, start_pos)
        if not self._granted:
            got = max(got, min(n, self.min_tokens))
        if got:
            cost = self._cost(got, start_pos)
            self._left -= cost
            self._predicted += cost
            self._granted += got
        return got

    def tightest_tpot_s(self, running: Iterable[Request]) -> float | None:
        """The tightest TPOT SLO among the decoding requests of `running` (None: none has one)."""
        if not self.tpot_s:
            return None
        slos = [self.tpot_s.get(r.service_tier) for r in running if r.status is RequestStatus.DECODING]
        return min((s for s in slos if s is not None), default=None)

    def _allow(self, running: Iterable[Request]) -> None:
        tpot, ds, ctx = None, 0, 0
        for r in running:
            if r.status is not RequestStatus.DECODING:
                continue
            ds, ctx = ds + 1, ctx + r.num_tokens
            slo = self.tpot_s.get(r.service_tier)
            if slo is not None and (tpot is None or slo < tpot):
                tpot = slo
        limits = [s for s in (None if tpot is None else self.headroom * tpot, self.max_step_s) if s is not None]
        coef = self.fit.coefficients() if limits else None
        if coef is None and not (limits and self._per_token):
            return
        if coef is None:  # cold start: the worst recent seconds per prefill token, decode included
            self._coef = (0.0, max(self._per_token), 0.0, 0.0, 0.0, 0.0)
            self.num_cold_start_steps += 1
        else:
            self._coef = tuple(float(v) for v in coef)
        a, _, _, _, e, f = self._coef
        self._base = a + e * ctx + f * ds
        self._left = min(limits) / self.correction - self._base

    def _cost(self, n: int, start_pos: int) -> float:
        _, b, c, d, _, _ = self._coef
        return b * n + c * n * n + d * n * start_pos

    def _fit_tokens(self, n: int, start_pos: int) -> int:
        """The largest m <= n whose chunk cost fits what is left (the cost grows with m), by bisection."""
        if self._cost(n, start_pos) <= self._left:
            return n
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._cost(mid, start_pos) <= self._left:
                lo = mid
            else:
                hi = mid - 1
        return lo
