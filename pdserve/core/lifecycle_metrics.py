"""The KV lifecycle's metrics, one copy for the gateway's /metrics, the simulator's report and `pdserve bench`.

Definitions (times in seconds):

* **schedule predictability** (per service tier): of the delivered KV blocks whose first consumption the
  conductor checked against its prediction, the share consumed within +-`CONSUME_TOLERANCE_S` (5 ms) of it
  (`on_time`); one check per transfer, weighted by its blocks. `kind` says which prediction: `final` (the
  latest refinement, the transfer's deadline), `at_prefilled`, `at_dispatch`.
* **wasted transfer ratio**: KV bytes delivered and never consumed / KV bytes delivered (`wasted_ratio`).
* **P99 inter-token jitter** (per service tier; the load generator's definition): for each request with more
  than two token times, every gap's distance from that request's mean gap, |gap - mean gap|; the deviations of
  all requests pooled, their 99th percentile (numpy linear interpolation) (`jitter_deviations`, `p99`).

`LifecycleWindow` holds these over a sliding window: the events of the last `window_s` seconds, kept in time
buckets of `window_s / NUM_BUCKETS` (a bucket leaves once all of it is older than `window_s`: the window
reaches back between `window_s` and `window_s * (1 + 1 / NUM_BUCKETS)`); `window_s=None` keeps one bucket for ever (a whole run: the simulator's report). Pure: the caller
passes `now` (the gateway its monotonic clock, the simulator its simulated time). A bucket keeps at most
`MAX_GAPS` jitter deviations per tier; past that, a uniform sample of them (reservoir sampling, seeded), so a
busy gateway's P99 costs milliseconds to compute, not a pass over every token gap of the last minute (below
`MAX_GAPS` gaps per tier in `window_s / NUM_BUCKETS` seconds it is exact).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.core.pd.delivery import CONSUME_TOLERANCE_S

NUM_BUCKETS = 20
MAX_GAPS = 4096  # jitter deviations kept per tier and bucket (past that: a uniform sample)
KINDS = ("final", "at_prefilled", "at_dispatch")  # which consumption prediction a check is against


def on_time(error_s: float) -> bool:
    """A consumption within the tolerance of its prediction (actual - predicted = `error_s`)."""
    return abs(error_s) <= CONSUME_TOLERANCE_S


def share(part: float, whole: float) -> float | None:
    """part / whole; None when there is nothing to share."""
    return part / whole if whole else None


def wasted_ratio(delivered_bytes: float, wasted_bytes: float) -> float | None:
    """Bytes delivered and never consumed / bytes delivered (None: nothing delivered)."""
    return wasted_bytes / delivered_bytes if delivered_bytes else None


def jitter_deviations(token_times: Sequence[float]) -> np.ndarray | None:
    """|gap - the request's mean gap| for each gap between its token times; None with fewer than three."""
    if len(token_times) <= 2:
        return None
    t = np.asarray(token_times)
    return np.abs(np.diff(t) - (t[-1] - t[0]) / (len(t) - 1))


def p99(deviations: Iterable[np.ndarray]) -> float | None:
    """The 99th percentile of the pooled deviations (None: none)."""
    devs = list(deviations)
    return float(np.percentile(np.concatenate(devs), 99)) if devs else None


def jitter_p99_s(streams: Iterable[Sequence[float]]) -> float | None:
    """P99 inter-token jitter of these requests' token times (module doc)."""
    return p99(d for times in streams if (d := jitter_deviations(times)) is not None)


class _Sample:
    """At most MAX_GAPS values: all of them, or past that a uniform sample (Vitter's algorithm R)."""

    def __init__(self) -> None:
        self.values = np.empty(0)
        self.seen = 0

    def add(self, values: np.ndarray, rng: np.random.Generator) -> None:
        take = values[:MAX_GAPS - self.values.size]
        if take.size:
            self.values = np.concatenate((self.values, take))
        rest = values[take.size:]
        if rest.size:  # the i-th value seen (from 0) replaces a random slot with probability MAX_GAPS / (i + 1)
            slots = rng.integers(0, self.seen + take.size + np.arange(1, rest.size + 1))
            keep = slots < MAX_GAPS
            self.values[slots[keep]] = rest[keep]
        self.seen += values.size


@dataclass
class _Bucket:
    start_s: float
    checked: Counter = field(default_factory=Counter)  # (kind, tier) -> blocks checked
    on_time: Counter = field(default_factory=Counter)  # (kind, tier) -> of those, consumed on time
    delivered_bytes: float = 0.0
    wasted_bytes: float = 0.0
    deviations: dict = field(default_factory=dict)  # tier -> _Sample of its requests' jitter deviations
    tokens: Counter = field(default_factory=Counter)  # (work, tier) -> tokens; work: prompt | output


class LifecycleWindow:
    """The lifecycle metrics over the last `window_s` seconds (None: since the start)."""

    def __init__(self, window_s: float | None) -> None:
        if window_s is not None and not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s!r}")
        self.window_s = window_s
        self._buckets: deque[_Bucket] = deque()
        self._rng = np.random.default_rng(0)  # (the jitter samples past MAX_GAPS)

    # ---- events in ----------------------------------------------------------------------------------------
    def consumed(self, now: float, tier: str, error_s: float, blocks: int, kind: str = "final") -> None:
        """A transfer's `blocks` first consumed `error_s` after (`< 0`: before) the `kind` prediction."""
        b = self._bucket(now)
        b.checked[kind, tier] += blocks
        b.on_time[kind, tier] += blocks * on_time(error_s)

    def delivered(self, now: float, nbytes: float) -> None:
        """KV bytes delivered (received and verified by a decode worker)."""
        self._bucket(now).delivered_bytes += nbytes

    def wasted(self, now: float, nbytes: float) -> None:
        """Delivered KV bytes that will never be consumed (their transfer failed, their request ended)."""
        self._bucket(now).wasted_bytes += nbytes

    def stream(self, now: float, tier: str, token_times: Sequence[float]) -> None:
        """A request's token times, once it ended (its jitter deviations join the window's)."""
        d = jitter_deviations(token_times)
        if d is not None:
            self._bucket(now).deviations.setdefault(tier, _Sample()).add(d, self._rng)

    def tokens(self, now: float, work: str, tier: str, n: int) -> None:
        """`n` tokens of `work` (prompt: computed, not found cached; output) served to a request of `tier`."""
        self._bucket(now).tokens[work, tier] += n

    # ---- metrics out --------------------------------------------------------------------------------------
    def predictability(self, now: float, kind: str = "final") -> dict[str, float]:
        """Per tier with checks in the window: the share of its checked blocks consumed on time."""
        checked, hits = self._sum(now, "checked"), self._sum(now, "on_time")
        return {tier: hits[k, tier] / n for (k, tier), n in checked.items() if k == kind and n}

    def predictability_all(self, now: float, kind: str = "final") -> float | None:
        """As `predictability`, over every tier."""
        return share(*self.blocks_checked(now, kind))

    def blocks_checked(self, now: float, kind: str = "final") -> tuple[int, int]:
        """(blocks consumed on time, blocks checked) in the window, over every tier."""
        checked, hits = self._sum(now, "checked"), self._sum(now, "on_time")
        return (sum(v for (k, _), v in hits.items() if k == kind), sum(v for (k, _), v in checked.items() if k == kind))

    def wasted_ratio(self, now: float) -> float | None:
        live = self._live(now)
        return wasted_ratio(sum(b.delivered_bytes for b in live), sum(b.wasted_bytes for b in live))

    def jitter_p99_s(self, now: float) -> dict[str, float]:
        """Per tier with a request of three or more tokens ended in the window: its P99 jitter."""
        pooled: dict[str, list] = {}
        for b in self._live(now):
            for tier, sample in b.deviations.items():
                pooled.setdefault(tier, []).append(sample.values)
        return {tier: p99(devs) for tier, devs in pooled.items()}

    def token_counts(self, now: float) -> Counter:
        """(work, tier) -> tokens served in the window."""
        return self._sum(now, "tokens")

    # ---- the window ---------------------------------------------------------------------------------------
    def _bucket(self, now: float) -> _Bucket:
        step = self._step()
        if step is None:
            if not self._buckets:
                self._buckets.append(_Bucket(0.0))
            return self._buckets[-1]
        start = now - now % step
        if not self._buckets or self._buckets[-1].start_s < start:
            self._buckets.append(_Bucket(start))
        self._expire(now)
        return self._buckets[-1]

    def _step(self) -> float | None:
        return None if self.window_s is None else self.window_s / NUM_BUCKETS

    def _expire(self, now: float) -> None:
        if self.window_s is not None:
            while self._buckets and self._buckets[0].start_s + self._step() <= now - self.window_s:
                self._buckets.popleft()

    def _live(self, now: float) -> list[_Bucket]:
        self._expire(now)
        return list(self._buckets)

    def _sum(self, now: float, name: str) -> Counter:
        total: Counter = Counter()
        for b in self._live(now):
            total.update(getattr(b, name))
        return total
