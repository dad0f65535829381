"""Metric math for the load generator: per-request timelines in, latency/throughput/SLO summary out.

Definitions (all times in seconds on one monotonic clock; summaries report milliseconds):
* TTFT = first token time - start.
* TPOT = (last token time - first token time) / (n - 1), n = output_tokens (a streamed chunk may carry several
  tokens, so the count comes from `output_tokens`, falling back to len(token_times) when that is 0); None if n < 2.
* ITL  = gaps between consecutive entries of `token_times` (per streamed chunk, as vLLM's benchmark does).
* E2E  = end - start.
* Percentiles are numpy's default linear interpolation (`np.percentile(..., method="linear")`), over
  successful requests only; ITL percentiles pool the gaps of all successful requests.
* Throughput divides successful requests / their output (and prompt) tokens by `duration_s`.
* SLO attainment is the share of ALL requests (failed ones count as misses) that meet every SLO given:
  TTFT <= slo_ttft_ms and TPOT <= slo_tpot_ms; a request with fewer than two output tokens has no TPOT and meets
  that SLO, and a successful request without any token misses the TTFT SLO.
* Goodput is the highest swept rate whose attainment (and that of every lower swept rate) is >= the threshold.
* Rejected requests (HTTP 429: refused on arrival, `rejected=True`) are counted in `num_rejected` and neither in
  `num_ok` nor in `num_errors` (nor in `errors`); num_requests = num_ok + num_errors + num_rejected. They count
  as SLO misses like failures.

Per service tier (`per_tier`, present when any record has a `service_tier`; tiers in `SERVICE_TIERS` order, then any
other name sorted): counts as above, TTFT/TPOT stats over that tier's successful requests, and `slo`:
* the tier's SLO is `tier_slos[tier]`, each of its two limits falling back to the global `slo_ttft_ms` /
  `slo_tpot_ms` when None or when the tier is not in `tier_slos`;
* `attainment` = that tier's requests meeting its SLO / ALL that tier's requests (rejected and failed ones
  count as misses); `attainment_accepted` = the same over the tier's non-rejected requests only (None if all
  were rejected), i.e. how well the requests the server took on were served;
* `goodput_rps` = that tier's requests meeting its SLO / `duration_s`.
All three are None when the tier has no SLO at all (neither its own nor a global one).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from pdserve.core.lifecycle_metrics import jitter_p99_s
from pdserve.core.service_tiers import SERVICE_TIERS

PERCENTILES = (50, 90, 99)
PERCENTILE_METHOD = "linear"
MAX_ERROR_GROUPS = 5
TIER_ORDER = SERVICE_TIERS  # the per-tier rows' order; names outside it follow, sorted

TierSlos = dict[str, tuple[float | None, float | None]]


@dataclass
class RequestRecord:
    """What the runner observed for one request. `token_times` holds every output token/chunk arrival time,
    the first included; `end_s` is None while the request is in flight; `error` is None on success."""

    start_s: float
    first_token_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    end_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    service_tier: str | None = None  # the tier it was sent in (`--tier-mix`); None: none asked for
    rejected: bool = False  # refused on arrival (HTTP 429): `error` says why; counted apart from errors

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def _first(self) -> float | None:
        if self.first_token_s is not None:
            return self.first_token_s
        return self.token_times[0] if self.token_times else None

    @property
    def ttft_s(self) -> float | None:
        first = self._first
        return None if first is None else first - self.start_s

    @property
    def tpot_s(self) -> float | None:
        n = self.output_tokens or len(self.token_times)
        first = self._first
        if n < 2 or first is None or not self.token_times:
            return None
        return (self.token_times[-1] - first) / (n - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.start_s


def latency_stats(values_s: list[float]) -> dict[str, float | None]:
    """mean/p50/p90/p99 in milliseconds (numpy linear percentiles); all None when there are no values."""
    keys = ["mean"] + [f"p{p}" for p in PERCENTILES]
    if not values_s:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=float) * 1000.0
    pct = np.percentile(ms, PERCENTILES, method=PERCENTILE_METHOD)
    return dict(zip(keys, [float(ms.mean())] + [float(v) for v in pct]))


def jitter_p99_ms(records: list[RequestRecord]) -> float | None:
    """P99 inter-token jitter (`pdserve.core.lifecycle_metrics`: |gap - the request's mean gap| over every gap of
    every successful request, pooled), in ms."""
    p99 = jitter_p99_s(r.token_times for r in records if r.ok)
    return None if p99 is None else p99 * 1000


def jitter_p99_ms_by_tier(records: list[RequestRecord]) -> dict[str, float]:
    """`jitter_p99_ms` per service tier (untagged requests are served in the default tier), for the tiers with a
    request of three or more token times."""
    tiers: dict[str, list] = {}
    for r in records:
        tiers.setdefault(r.service_tier or "default", []).append(r)
    out = {t: jitter_p99_ms(tiers[t]) for t in sorted(tiers, key=tier_order)}
    return {t: v for t, v in out.items() if v is not None}


def meets_slo(rec: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """Whether one request meets every SLO given (failed requests never do)."""
    if not rec.ok:
        return False
    if slo_ttft_ms is not None:
        ttft = rec.ttft_s
        if ttft is None or ttft * 1000.0 > slo_ttft_ms:
            return False
    if slo_tpot_ms is not None:
        tpot = rec.tpot_s
        if tpot is not None and tpot * 1000.0 > slo_tpot_ms:
            return False
    return True


def _error_groups(records: list[RequestRecord]) -> list[dict]:
    counts = Counter(r.error for r in records if not r.ok and not r.rejected)
    return [{"message": m, "count": c} for m, c in counts.most_common(MAX_ERROR_GROUPS)]


def summarize(records: list[RequestRecord], *, duration_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None, tier_slos: TierSlos | None = None) -> dict:
    """Counts, throughput over `duration_s`, TTFT/TPOT/ITL/E2E stats (ms) and SLO attainment (see module doc).

    `errors` lists the most frequent error messages (at most MAX_ERROR_GROUPS) with their counts, rejections
    apart; `slo.attainment` is None when no SLO is given or there are no requests. `per_tier` (only when a
    record has a service tier) holds the same per tier, judged by `tier_slos` (tier -> (ttft_ms, tpot_ms)).
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    attainment = (sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in records) / len(records)
                  if has_slo and records else None)
    num_rejected = sum(r.rejected for r in records)
    out = {
        "num_requests": len(records), "num_ok": len(ok), "num_errors": len(records) - len(ok) - num_rejected,
        "num_rejected": num_rejected,
        "errors": _error_groups(records),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "prompt_throughput": prompt_tokens / duration_s,
        "total_output_tokens": output_tokens, "total_prompt_tokens": prompt_tokens,
        "ttft_ms": latency_stats([v for r in ok if (v := r.ttft_s) is not None]),
        "tpot_ms": latency_stats([v for r in ok if (v := r.tpot_s) is not None]),
        "itl_ms": latency_stats([v for r in ok for v in r.itls]),
        "e2e_ms": latency_stats([v for r in ok if (v := r.e2e_s) is not None]),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms, "attainment": attainment},
        "percentile_method": f"numpy {PERCENTILE_METHOD} interpolation",
    }
    if any(r.service_tier is not None for r in records):
        out["per_tier"] = per_tier(records, duration_s=duration_s, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
                                   tier_slos=tier_slos)
    return out


def tier_slo(tier: str, tier_slos: TierSlos | None, slo_ttft_ms: float | None,
             slo_tpot_ms: float | None) -> tuple[float | None, float | None]:
    """The (ttft_ms, tpot_ms) a tier is judged by: its own limits, each falling back to the global one."""
    own_ttft, own_tpot = (tier_slos or {}).get(tier, (None, None))
    return (own_ttft if own_ttft is not None else slo_ttft_ms, own_tpot if own_tpot is not None else slo_tpot_ms)


def tier_order(name: str) -> tuple[int, str]:
    return (TIER_ORDER.index(name), "") if name in TIER_ORDER else (len(TIER_ORDER), name)


def per_tier(records: list[RequestRecord], *, duration_s: float, slo_ttft_ms: float | None = None,
             slo_tpot_ms: float | None = None, tier_slos: TierSlos | None = None) -> dict[str, dict]:
    """{tier: counts, TTFT/TPOT stats and SLO attainment} over the records tagged with a tier (module doc)."""
    names = sorted({r.service_tier for r in records if r.service_tier is not None}, key=tier_order)
    return {name: _tier_summary([r for r in records if r.service_tier == name], duration_s,
                                *tier_slo(name, tier_slos, slo_ttft_ms, slo_tpot_ms)) for name in names}


def _tier_summary(records: list[RequestRecord], duration_s: float, ttft_ms: float | None,
                  tpot_ms: float | None) -> dict:
    ok = [r for r in records if r.ok]
    rejected = sum(r.rejected for r in records)
    accepted = len(records) - rejected
    has_slo = ttft_ms is not None or tpot_ms is not None
    met = sum(meets_slo(r, ttft_ms, tpot_ms) for r in records)
    return {
        "num_requests": len(records), "num_ok": len(ok), "num_rejected": rejected,
        "num_errors": len(records) - len(ok) - rejected,
        "ttft_ms": latency_stats([v for r in ok if (v := r.ttft_s) is not None]),
        "tpot_ms": latency_stats([v for r in ok if (v := r.tpot_s) is not None]),
        "slo": {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms,
                "attainment": met / len(records) if has_slo and records else None,
                "attainment_accepted": met / accepted if has_slo and accepted else None},
        "goodput_rps": met / duration_s if has_slo else None,
    }


def goodput(results: dict[float, float], threshold: float = 0.9) -> float | None:
    """The highest request rate whose SLO attainment is >= threshold AND every lower swept rate also met it.

    Rates are walked in increasing order and the walk stops at the first miss, so a lucky pass at a high rate
    after a failure at a lower one does not count (attainment is expected to fall with load; a non-monotonic
    sweep is noise). Returns None if the lowest rate already misses or `results` is empty.
    """
    best = None
    for rate in sorted(results):
        att = results[rate]
        if att is None or att < threshold:
            break
        best = rate
    return best
