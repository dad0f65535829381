"""Dynamic weights of the elastic service tiers (`default`, `flex`): how much sooner than its configured weight
says a tier's waiting requests go first (`--tier-weights dynamic`, the default; `static`: the configured
weights only).

The tiered queue policy orders elastic requests by virtual deadline, `arrival + horizon / weight`
(`pdserve.core.service_tiers`). Here each elastic tier's weight is multiplied each step by a factor from four
signals of the worker's own state, so the order follows what the tier needs now:

    factor = urgency x age x transfer x load, clamped to [FACTOR_MIN, FACTOR_MAX]

* **SLO slack** (`urgency`): the least time any of the tier's waiting requests has left before its TTFT SLO
  (`arrival + ttft - now`). With no slack left (or late) the factor is 2; with a whole SLO's worth, 1;
  linear between. A tier without a TTFT SLO: 1.
* **Queue age** (`age`): 1 + the oldest waiting request's age over the tier's horizon, capped at 1 more (a
  best-effort tier's requests do not wait forever behind a stream of SLO-bound ones).
* **Transfer progress** (`transfer`): 1 - 0.5 x the share of the tier's waiting requests whose KV link is held
  (a prefill worker's production pace: their KV could not leave now; starting them first gains nothing).
* **Decode load** (`load`): 1 - 0.5 x the share of decode slots busy (running decodes / max_num_seqs), for a
  tier without a TTFT SLO only: best-effort work yields to SLO-bound work while the decode side is full.

The priority tier is never reweighted (it is always ahead). Inputs and factors are exported per worker and
tier (`pdserve_tier_weight{worker,service_tier}` and `pdserve_tier_weight_input{worker,service_tier,input}`).
The real worker and the simulator run this same code inside the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdserve.core.request import Request
from pdserve.core.service_tiers import ServiceTiers
from pdserve.errors import check_choice

ELASTIC = ("default", "flex")
FACTOR_MIN, FACTOR_MAX = 0.25, 4.0
REORDER_CHANGE = 0.05  # a factor that moved by more than this share reorders the waiting queue
MODES = ("dynamic", "static")


def check_tier_weights(mode: str) -> str:
    return check_choice(mode, MODES, "tier_weights")


@dataclass(frozen=True)
class TierSignals:
    slack_s: float | None  # least time left before a waiting request's TTFT SLO (None: no SLO or none waiting)
    queue_age_s: float  # the oldest waiting request's age
    held_share: float  # share of its waiting requests whose KV link is held (production paused)
    decode_load: float  # running decodes / max_num_seqs


def weight_factor(signals: TierSignals, ttft_s: float | None, horizon_s: float) -> float:
    """The multiplier of an elastic tier's configured weight (see the module's doc)."""
    urgency = 1.0
    if ttft_s is not None and signals.slack_s is not None:
        urgency = 1.0 + min(max(1.0 - signals.slack_s / ttft_s, 0.0), 1.0)
    age = 1.0 + min(signals.queue_age_s / horizon_s, 1.0) if horizon_s > 0 else 1.0
    transfer = 1.0 - 0.5 * signals.held_share
    load = 1.0 - 0.5 * signals.decode_load if ttft_s is None else 1.0
    return min(max(urgency * age * transfer * load, FACTOR_MIN), FACTOR_MAX)


class TierWeights:
    def __init__(self, tiers: ServiceTiers, mode: str = "dynamic") -> None:
        self.tiers = tiers
        self.dynamic = check_tier_weights(mode) == "dynamic"
        self.factors: dict[str, float] = {name: 1.0 for name in ELASTIC}
        self.signals: dict[str, TierSignals] = {}

    def update(self, now: float, waiting: Iterable[Request], decode_load: float,
               held: Callable[[str], bool]) -> bool:
        """Recompute the factors from the waiting requests at `now`; True when one moved enough that the
        waiting queue must be reordered. `held(request_id)`: its KV link is held."""
        if not self.dynamic:
            return False
        by_tier: dict[str, list[Request]] = {name: [] for name in ELASTIC}
        for req in waiting:
            if req.service_tier in by_tier:
                by_tier[req.service_tier].append(req)
        moved = False
        for name, reqs in by_tier.items():
            tier = self.tiers[name]
            ttft_s = tier.ttft_ms / 1000.0 if tier.ttft_ms is not None else None
            signals = TierSignals(
                min((r.arrival_s + ttft_s - now for r in reqs), default=None) if ttft_s is not None else None,
                max((now - r.arrival_s for r in reqs), default=0.0),
                sum(held(r.request_id) for r in reqs) / len(reqs) if reqs else 0.0, decode_load)
            factor = weight_factor(signals, ttft_s, tier.horizon_s)
            moved |= abs(factor - self.factors[name]) > REORDER_CHANGE * self.factors[name]
            self.factors[name], self.signals[name] = factor, signals
        return moved

    def factor(self, tier: str) -> float:
        return self.factors.get(tier, 1.0)

    def report(self) -> dict:
        """{tier: {"weight": configured x factor, "slack_s", "queue_age_s", "held_share", "decode_load"}}."""
        return {name: {"weight": self.tiers[name].weight * self.factors[name],
                       "slack_s": s.slack_s, "queue_age_s": s.queue_age_s, "held_share": s.held_share,
                       "decode_load": s.decode_load}
                for name, s in self.signals.items()}
