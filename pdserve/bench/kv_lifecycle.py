"""What a `pdserve bench serve` run did to the server's KV deliveries, from its /metrics before and after.

Counters are differences over the run; `link_utilization` is the server's own windowed gauge when the run
ended. A server without pdserve's metrics (another engine) gives `None`: nothing is reported for it.
"""

from __future__ import annotations

import httpx

from pdserve.bench.server_proc import scrape_metrics

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


def _delta(before: Samples, after: Samples, name: str, label: str | None = None) -> dict[str, float]:
    old = _by(before, name, label)
    return {k: v - old.get(k, 0.0) for k, v in _by(after, name, label).items() if v - old.get(k, 0.0) > 0}


def kv_delta(before: Samples | None, after: Samples | None) -> dict | None:
    """The run's KV delivery outcomes: transfers delivered, failed (reason -> count), wasted bytes (reason ->
    bytes), leases renewed, bytes per link, and each link's busy share at the end."""
    if before is None or after is None:
        return None
    delivered = _delta(before, after, "pdserve_kv_transfer_time_seconds_count", "outcome").get("delivered", 0.0)
    wasted = _delta(before, after, "pdserve_kv_wasted_bytes_total", "reason")
    link_bytes = _delta(before, after, "pdserve_kv_link_bytes_total", "link")
    sent = sum(link_bytes.values())
    return {"delivered": delivered,
            "failed": _delta(before, after, "pdserve_kv_transfer_failures_total", "reason"),
            "wasted_bytes": wasted,
            "wasted_rate": sum(wasted.values()) / sent if sent else None,
            "lease_renewals": sum(_delta(before, after, "pdserve_kv_lease_renewals_total").values()),
            "link_bytes": link_bytes,
            "link_utilization": _by(after, "pdserve_kv_link_utilization", "link")}


def describe(kv: dict) -> str:
    """One line for the printed report."""
    failed = ", ".join(f"{k} {v:.0f}" for k, v in kv["failed"].items()) or "none"
    wasted = "-" if kv["wasted_rate"] is None else f"{kv['wasted_rate']:.1%} of bytes sent"
    links = ", ".join(f"{k} {v:.0%}" for k, v in kv["link_utilization"].items()) or "-"
    return (f"KV deliveries: {kv['delivered']:.0f} delivered, failed: {failed}; wasted {wasted}; "
            f"leases renewed {kv['lease_renewals']:.0f}; link busy (last 10 s): {links}")
