"""What serving costs: worker-hours at a price per hour, split between the service tiers that used them.

One copy for `pdserve serve` (`--price-per-hour ROLE=USD` -> `pdserve_cost_usd_total{service_tier}`),
`pdserve bench serve` (USD per 1k tokens of a run) and `pdserve simulate` (USD per 1k tokens of a simulated
cluster): a worker (one process; one GPU on a GPU host) running `seconds` at `price` USD per hour costs
`workers * seconds / 3600 * price` (`usd`), and a run's USD per 1k tokens is `usd / tokens * 1000`.

How a worker's cost is split between service tiers (`apportion`): in proportion to the work of its role the
tiers were served in the last `window_s` seconds (`pdserve.core.lifecycle_metrics.LifecycleWindow.tokens`):

* prefill worker: prompt tokens computed (a request's prompt tokens less those found in a cache);
* decode worker: output tokens;
* colocated worker: both, a computed prompt token and an output token weighing the same.

A worker's time with no such work in the window (idle) is charged to `service_tier="idle"`, so the tiers' costs
always add up to every worker's hours at its price. A worker is charged from its first report to its last.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from pdserve.errors import InvalidRequestError

ROLES = ("prefill", "decode", "colocated")
WORK = {"prefill": ("prompt",), "decode": ("output",), "colocated": ("prompt", "output")}  # what a role does
IDLE = "idle"  # the service_tier label of the time a worker served no tier


def usd(workers: float, seconds: float, price_per_hour: float) -> float:
    """Cost of `workers` running `seconds` at `price_per_hour` USD each."""
    return workers * seconds / 3600 * price_per_hour


def usd_per_1k(cost_usd: float, tokens: float) -> float | None:
    """USD per 1,000 tokens (None: no tokens)."""
    return cost_usd / tokens * 1000 if tokens else None


def parse_prices(specs: Iterable[str], flag: str = "--price-per-hour") -> dict[str, float]:
    """`ROLE=USD[,ROLE=USD...]` specs (repeatable) -> {role: USD per worker-hour}; a bare `USD` prices every role.
    Raises a one-line `InvalidRequestError` for a spec that does not parse."""
    prices: dict[str, float] = {}
    for spec in specs:
        for item in spec.split(","):
            role, sep, value = item.strip().rpartition("=")
            roles = (role.strip(),) if sep else ROLES
            if roles[0] not in ROLES:
                raise InvalidRequestError(f"{flag}: unknown role {roles[0]!r} in {spec!r}; roles: "
                                          f"{', '.join(ROLES)} (e.g. prefill=2.5,decode=2.0, or 2.5 for all)",
                                          param="price_per_hour")
            prices.update(dict.fromkeys(roles, _price(value, spec, flag)))
    return prices


def price_value(text: str) -> float | None:
    """A price: a finite number >= 0; None if `text` is not one."""
    try:
        price = float(text)
    except ValueError:
        return None
    return price if 0 <= price < float("inf") else None


def _price(value: str, spec: str, flag: str) -> float:
    price = price_value(value)
    if price is None:
        raise InvalidRequestError(f"{flag}: {value.strip()!r} in {spec!r} is not a price (USD per hour, a number "
                                  ">= 0); expected ROLE=USD, e.g. prefill=2.5,decode=2.0", param="price_per_hour")
    return price


def check_priced(prices: dict[str, float], roles: Iterable[str], flag: str = "--price-per-hour") -> None:
    """Every role a deployment runs has a price, once any price is given (none: cost is not measured)."""
    missing = [r for r in dict.fromkeys(roles) if r not in prices]
    if prices and missing:
        raise InvalidRequestError(f"{flag} has no price for the {', '.join(missing)} worker(s) this deployment "
                                  f"runs; give one (e.g. {missing[0]}=2.0) or a bare price for every role",
                                  param="price_per_hour")


def apportion(cost_usd: float, role: str, tokens: Counter) -> dict[str, float]:
    """Split a `role` worker's `cost_usd` between tiers by `tokens` ((work, tier) -> tokens: what each tier was
    served lately); no work of the role: all of it to `IDLE`."""
    weights: Counter = Counter()
    for (work, tier), n in tokens.items():
        if work in WORK[role] and n > 0:
            weights[tier] += n
    total = sum(weights.values())
    if not total:
        return {IDLE: cost_usd}
    return {tier: cost_usd * n / total for tier, n in weights.items()}


class CostMeter:
    """Each worker's cost from one of its reports to the next, split between tiers (module doc)."""

    def __init__(self, prices: dict[str, float]) -> None:
        self.prices = prices
        self._last: dict[str, float] = {}  # worker -> when its cost was last accrued

    def accrue(self, worker: str, role: str, now: float, tokens: Counter) -> dict[str, float]:
        """USD per tier that `worker` (now of `role`) cost since its last report; `tokens` as `apportion`'s."""
        last, self._last[worker] = self._last.get(worker), now
        if last is None or now <= last or role not in self.prices:
            return {}
        return apportion(usd(1, now - last, self.prices[role]), role, tokens)
