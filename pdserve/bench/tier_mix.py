"""Service-tier mixes for the load generator: `--tier-mix priority=0.2,default=0.6,flex=0.2`.

`parse_tier_mix` checks the spec (tier names from `pdserve.core.service_tiers.SERVICE_TIERS`, every fraction > 0, their
sum 1 within `SUM_TOLERANCE`); `assign_tiers` tags each request of a workload with one tier, drawn
independently with those probabilities from `random.Random(seed)`: the same arguments give the same tags, so
every rate of a sweep (and `pdserve simulate` with the same seed) sends the same tier to the same request.

`tier_flags(args)` validates both tier flags of `pdserve bench serve` / `pdserve simulate` at once (one-line
`InvalidRequestError`s) and `tier_slos(specs)` turns `--service-tier` specs into the per-tier SLOs that
`pdserve.bench.metrics.summarize` takes.
"""

from __future__ import annotations

import bisect
import itertools
import random

from pdserve.core.service_tiers import SERVICE_TIERS, ServiceTiers
from pdserve.errors import InvalidRequestError

SUM_TOLERANCE = 1e-6
_FORM = "NAME=FRACTION[,NAME=FRACTION...]"


def _fail(text: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"--tier-mix {text!r}: {why}", param="tier_mix")


def parse_tier_mix(text: str) -> dict[str, float]:
    """`priority=0.2,default=0.6,flex=0.2` -> {"priority": 0.2, "default": 0.6, "flex": 0.2} (spec order)."""
    mix: dict[str, float] = {}
    for item in (p.strip() for p in str(text).split(",")):
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq:
            raise _fail(text, f"expected {_FORM}, got {item!r}")
        if name not in SERVICE_TIERS:
            raise _fail(text, f"unknown tier {name!r}; choose from {', '.join(SERVICE_TIERS)}")
        if name in mix:
            raise _fail(text, f"tier {name!r} given twice")
        try:
            share = float(value)
        except ValueError:
            raise _fail(text, f"the fraction of {name} must be a number, got {value.strip()!r}") from None
        if not share > 0 or share == float("inf"):
            raise _fail(text, f"the fraction of {name} must be positive, got {value.strip()!r}")
        mix[name] = share
    if abs(sum(mix.values()) - 1.0) > SUM_TOLERANCE:
        raise _fail(text, f"the fractions must sum to 1, they sum to {sum(mix.values()):g}")
    return mix


def assign_tiers(num_requests: int, mix: dict[str, float], seed: int) -> list[str]:
    """One tier per request, drawn i.i.d. from `mix` with `random.Random(seed)`; deterministic for its args."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not mix:
        raise ValueError("the tier mix is empty")
    names = list(mix)
    cum = list(itertools.accumulate(mix[n] for n in names))
    rng = random.Random(seed)
    return [names[min(bisect.bisect_right(cum, rng.random() * cum[-1]), len(names) - 1)]
            for _ in range(num_requests)]


def tier_slos(specs) -> dict[str, tuple[float | None, float | None]]:
    """`--service-tier` specs -> {tier: (ttft_ms, tpot_ms)} for the tiers given (None: use the global SLO)."""
    tiers = ServiceTiers.from_specs(specs or ())
    return {n: (tiers[n].ttft_ms, tiers[n].tpot_ms) for n in SERVICE_TIERS if tiers[n].has_slo}


def tier_flags(args) -> tuple[dict[str, float] | None, dict[str, tuple[float | None, float | None]]]:
    """Validate `--tier-mix` and `--service-tier` of parsed args: (mix or None, per-tier SLOs)."""
    text = getattr(args, "tier_mix", None)
    mix = parse_tier_mix(text) if text is not None else None
    return mix, tier_slos(getattr(args, "service_tier", None))


def workload_tiers(mix: dict[str, float] | None, num_requests: int, seed: int) -> list[str | None]:
    """The tier to send with each request: None everywhere without a mix."""
    if mix is None:
        return [None] * num_requests
    return list(assign_tiers(num_requests, mix, seed))
