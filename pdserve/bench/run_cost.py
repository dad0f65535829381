"""What a `pdserve bench serve` run cost: USD, and USD per 1k tokens, overall and per service tier.

Two sources, as a user of any OpenAI-compatible server expects to price a run:

* `--price-per-hour USD` (the endpoint's price per hour, all its GPUs together; works against any server:
  vLLM, SGLang, pdserve): the run's cost is `usd(1, duration, price)` (`pdserve.core.cost`), the run's wall
  time at that price;
* otherwise, a pdserve server started with `--price-per-hour ROLE=USD`: the growth of its
  `pdserve_cost_usd_total{service_tier}` over the run (its workers' hours at their roles' prices, split between
  the tiers by the work each got; `service_tier="idle"`: time no tier used), read from /metrics before and after.

Tokens are those of the run's successful requests (prompt + output, and output alone), as the simulator's
`sim.cost`; per tier, those of the requests sent in that tier (untagged ones: default). No source: no cost.
"""

from __future__ import annotations

from pdserve.bench.kv_lifecycle import Samples, delta
from pdserve.bench.metrics import RequestRecord, tier_order
from pdserve.core.cost import price_value, usd, usd_per_1k
from pdserve.errors import InvalidRequestError


def parse_price(value: str | None) -> float | None:
    """`--price-per-hour` of `pdserve bench serve`: one number, USD per hour of the whole endpoint."""
    if value is None:
        return None
    price = price_value(value)
    if price is None:
        raise InvalidRequestError(f"--price-per-hour must be the endpoint's USD per hour (a number >= 0), got "
                                  f"{value!r}; per-role prices go to `pdserve serve --price-per-hour ROLE=USD`",
                                  param="price_per_hour")
    return price


def _tokens(records: list[RequestRecord]) -> tuple[int, int]:
    ok = [r for r in records if r.ok]
    out = sum(r.output_tokens for r in ok)
    return out, out + sum(r.prompt_tokens for r in ok)


def run_cost(records: list[RequestRecord], duration_s: float, price_per_hour: float | None,
             before: Samples | None, after: Samples | None) -> dict | None:
    """{source, usd, usd_per_1k_tokens, usd_per_1k_output_tokens, per_tier (server source only)}; None when
    neither a price nor the server's cost counter is there."""
    if price_per_hour is not None:
        by_tier, source = None, "--price-per-hour"
        total = usd(1, duration_s, price_per_hour)
    else:
        by_tier = delta(before, after, "pdserve_cost_usd_total", "service_tier") if before and after else {}
        if not by_tier:
            return None
        source, total = "server", sum(by_tier.values())
    out, all_tokens = _tokens(records)
    cost = {"source": source, "usd": total, "usd_per_1k_tokens": usd_per_1k(total, all_tokens),
            "usd_per_1k_output_tokens": usd_per_1k(total, out)}
    if by_tier is not None:
        cost["per_tier"] = {tier: {"usd": by_tier[tier], "usd_per_1k_tokens": usd_per_1k(
            by_tier[tier], _tokens([r for r in records if (r.service_tier or "default") == tier])[1])}
            for tier in sorted(by_tier, key=tier_order)}
    return cost


def describe(cost: dict) -> str:
    """One line for the printed report."""
    def per_1k(v: float | None) -> str:
        return "-" if v is None else f"${v:.5f}"
    tiers = "; ".join(f"{t} ${c['usd']:.4f} ({per_1k(c['usd_per_1k_tokens'])}/1k)"
                      for t, c in cost.get("per_tier", {}).items())
    return (f"cost ({cost['source']}): ${cost['usd']:.4f}, {per_1k(cost['usd_per_1k_tokens'])} per 1k tokens, "
            f"{per_1k(cost['usd_per_1k_output_tokens'])} per 1k output tokens" + (f"; by tier: {tiers}" if tiers else ""))
