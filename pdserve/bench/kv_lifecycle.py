"""What a `pdserve bench serve` run did to the server's KV deliveries, from its /metrics before and after.

Counters are differences over the run; `link_utilization` and `link_effective_utilization` are the server's
own windowed gauges when the run ended. `schedule_predictability` is the share of the run's delivered blocks
first consumed within +-5 ms of the conductor's (final) prediction, from the consumption-error histogram's
buckets (`..._at_prefilled`, `..._at_dispatch`: of the predictions made when prefilled, at dispatch) — the simulator's `sim.lifecycle` names. A
server without pdserve's metrics (another engine) gives `None`: nothing is reported for it.
"""

from __future__ import annotations

import httpx

from pdserve.bench.server_proc import scrape_metrics
from pdserve.core.pd.delivery import CONSUME_TOLERANCE_S

Samples = dict[tuple[str, tuple], float]


def scrape(endpoint: str) -> Samples | None:
    try:
        samples = scrape_metrics(endpoint.rstrip("/"))
    except (httpx.HTTPError, ValueError):
        return None
    return samples if any(name.startswith("pdserve_") for name, _ in samples) else None


def _by(samples: Samples, name: str, label: str | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, labels), v in samples.items():
        if n == name:
            key = dict(labels).get(label, "") if label else ""
            out[key] = out.get(key, 0.0) + v
    return out


def delta(before: Samples, after: Samples, name: str, label: str | None = None) -> dict[str, float]:
    """The growth of counter `name` between two scrapes, summed by `label` (only what grew)."""
    old = _by(before, name, label)
    return {k: v - old.get(k, 0.0) for k, v in _by(after, name, label).items() if v - old.get(k, 0.0) > 0}


def kv_delta(before: Samples | None, after: Samples | None) -> dict | None:
    """The run's KV delivery outcomes: transfers delivered, failed (reason -> count), wasted bytes (reason ->
    bytes), leases renewed, bytes per link, and each link's busy share at the end."""
    if before is None or after is None:
        return None
    delivered = delta(before, after, "pdserve_kv_transfer_time_seconds_count", "outcome").get("delivered", 0.0)
    wasted = delta(before, after, "pdserve_kv_wasted_bytes_total", "reason")
    link_bytes = delta(before, after, "pdserve_kv_link_bytes_total", "link")
    sent = sum(link_bytes.values())
    return {"delivered": delivered,
            "failed": delta(before, after, "pdserve_kv_transfer_failures_total", "reason"),
            "wasted_bytes": wasted,
            "wasted_rate": sum(wasted.values()) / sent if sent else None,
            "lease_renewals": sum(delta(before, after, "pdserve_kv_lease_renewals_total").values()),
            "link_bytes": link_bytes,
            "link_utilization": _by(after, "pdserve_kv_link_utilization", "link"),
            "link_effective_utilization": _by(after, "pdserve_kv_link_effective_utilization", "link"),
            "schedule_predictability": _on_time(before, after, "pdserve_kv_consumption_error_seconds"),
            "schedule_predictability_at_prefilled": _on_time(before, after,
                                                             "pdserve_kv_consumption_error_at_prefilled_seconds"),
            "schedule_predictability_at_dispatch": _on_time(before, after,
                                                            "pdserve_kv_consumption_error_at_dispatch_seconds")}


def _on_time(before: Samples, after: Samples, histogram: str) -> float | None:
    """Share of the run's observations within +-CONSUME_TOLERANCE_S (bucket edges at +-5 ms)."""
    buckets = {float(le): n for le, n in delta(before, after, f"{histogram}_bucket", "le").items()}
    total = buckets.get(float("inf"), 0.0)
    if not total:
        return None
    tol = CONSUME_TOLERANCE_S
    return (buckets.get(tol, 0.0) - buckets.get(-tol, 0.0)) / total


def describe(kv: dict) -> str:
    """One line for the printed report."""
    failed = ", ".join(f"{k} {v:.0f}" for k, v in kv["failed"].items()) or "none"
    wasted = "-" if kv["wasted_rate"] is None else f"{kv['wasted_rate']:.1%} of bytes sent"
    links = ", ".join(f"{k} {v:.0%}" for k, v in kv["link_utilization"].items()) or "-"
    effective = ", ".join(f"{v:.0%}" for v in kv.get("link_effective_utilization", {}).values()) or "-"
    on_time = kv.get("schedule_predictability")
    return (f"KV deliveries: {kv['delivered']:.0f} delivered, failed: {failed}; wasted {wasted}; "
            f"leases renewed {kv['lease_renewals']:.0f}; link busy (last 10 s): {links}, effective {effective}; "
            f"consumed on time (+-5 ms): {'-' if on_time is None else f'{on_time:.1%}'}")
