"""The KV lifecycle's metrics over a sliding window (`pdserve.core.lifecycle_metrics`) and the cost of serving
(`pdserve.core.cost`), by hand-computed values; the gateway's gauges (`pdserve.server.metrics.Metrics`) fed as
its drivers feed them; and one definition for the gateway, the simulator and `pdserve bench`."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from pdserve.bench.metrics import RequestRecord, jitter_p99_ms, jitter_p99_ms_by_tier
from pdserve.core.cost import CostMeter, apportion, check_priced, parse_prices, usd, usd_per_1k
from pdserve.core.lifecycle_metrics import MAX_GAPS, LifecycleWindow, jitter_deviations, jitter_p99_s
from pdserve.errors import InvalidRequestError
from pdserve.server.metrics import Metrics


def test_predictability_is_the_share_of_checked_blocks_within_5_ms_per_tier_and_prediction():
    w = LifecycleWindow(60.0)
    w.consumed(1.0, "priority", 0.003, 4)  # on time
    w.consumed(1.0, "priority", -0.005, 2)  # on time: the edge counts
    w.consumed(2.0, "priority", 0.0051, 2)  # late
    w.consumed(2.0, "flex", -0.2, 3)  # early
    w.consumed(2.0, "flex", 0.0, 1)
    w.consumed(2.0, "flex", 0.0, 10, kind="at_dispatch")  # another prediction: not in "final"
    assert w.predictability(3.0) == {"priority": 6 / 8, "flex": 1 / 4}
    assert w.predictability_all(3.0) == 7 / 12
    assert w.predictability(3.0, "at_dispatch") == {"flex": 1.0}
    assert w.predictability(3.0, "at_prefilled") == {} and w.predictability_all(3.0, "at_prefilled") is None


def test_the_window_forgets_what_is_older_than_it():
    w = LifecycleWindow(10.0)  # buckets of 0.5 s
    w.consumed(0.2, "default", 0.0, 1)
    w.delivered(0.2, 1000)
    w.consumed(6.0, "default", 1.0, 1)
    w.delivered(6.0, 3000)
    w.wasted(6.1, 1000)
    assert w.predictability(10.4) == {"default": 0.5} and w.wasted_ratio(10.4) == 0.25
    # the bucket [0, 0.5) leaves once all of it is older than 10 s
    assert w.predictability(10.6) == {"default": 0.0} and w.wasted_ratio(10.6) == 1000 / 3000
    assert w.predictability(16.6) == {} and w.wasted_ratio(16.6) is None
    forever = LifecycleWindow(None)  # the simulator's: the whole run
    forever.delivered(0.0, 10)
    forever.wasted(1e6, 5)
    assert forever.wasted_ratio(1e9) == 0.5
    with pytest.raises(ValueError):
        LifecycleWindow(0.0)


def test_jitter_is_each_gap_from_its_own_requests_mean_gap_pooled_then_p99():
    # gaps 1, 2, 1 (mean 4/3): deviations 1/3, 2/3, 1/3
    assert jitter_deviations([0.0, 1.0, 3.0, 4.0]) == pytest.approx([1 / 3, 2 / 3, 1 / 3])
    assert jitter_deviations([0.0, 1.0]) is None  # one gap: no jitter
    # pooled with a steady request (gaps 0.5, 0.5: deviations 0, 0): sorted 0, 0, 1/3, 1/3, 2/3; the 99th
    # percentile (linear) sits at rank 0.99 * 4 = 3.96: 1/3 + 0.96 * (2/3 - 1/3)
    expected = 1 / 3 + 0.96 / 3
    assert jitter_p99_s([[0.0, 1.0, 3.0, 4.0], [10.0, 10.5, 11.0], [5.0, 6.0]]) == pytest.approx(expected)
    w = LifecycleWindow(60.0)
    w.stream(1.0, "flex", [0.0, 1.0, 3.0, 4.0])
    w.stream(1.0, "flex", [10.0, 10.5, 11.0])
    w.stream(1.0, "priority", [0.0, 0.1, 0.2, 0.3])
    w.stream(1.0, "default", [0.0, 0.1])
    got = w.jitter_p99_s(2.0)
    assert got.keys() == {"flex", "priority"}
    assert got["flex"] == pytest.approx(expected) and got["priority"] == pytest.approx(0.0, abs=1e-12)


def test_past_max_gaps_a_bucket_keeps_a_uniform_sample_of_them():
    rng = np.random.default_rng(1)
    # 19,600 gaps in one bucket: steady streams first (no jitter), then jittery ones (kept only if sampled)
    streams = [list(np.arange(50) * 0.02) for _ in range(200)]
    streams += [list(np.cumsum(rng.exponential(0.02, 50))) for _ in range(200)]
    w = LifecycleWindow(60.0)
    for times in streams:
        w.stream(1.0, "default", times)
    (bucket,) = w._buckets  # noqa: SLF001
    assert bucket.deviations["default"].values.size == MAX_GAPS and bucket.deviations["default"].seen == 19600
    exact = jitter_p99_s(streams)
    assert w.jitter_p99_s(1.0)["default"] == pytest.approx(exact, rel=0.1)
    few = LifecycleWindow(60.0)  # below MAX_GAPS: exact
    for times in streams[:50]:
        few.stream(1.0, "default", times)
    assert few.jitter_p99_s(1.0)["default"] == jitter_p99_s(streams[:50])


def test_bench_and_simulator_jitter_is_the_windows_code():
    rng = np.random.default_rng(0)
    records = [RequestRecord(0.0, token_times=list(np.cumsum(rng.exponential(0.05, n))), service_tier=tier,
                             output_tokens=n) for n, tier in ((20, "priority"), (5, "flex"), (50, None), (9, "flex"))]
    records.append(RequestRecord(0.0, token_times=[0.0, 9.0, 9.5], error="boom"))  # failed: not counted
    w = LifecycleWindow(60.0)
    for r in records[:-1]:
        w.stream(0.0, r.service_tier or "default", r.token_times)
    by_tier = jitter_p99_ms_by_tier(records)
    assert by_tier == pytest.approx({t: v * 1000 for t, v in w.jitter_p99_s(0.0).items()})
    assert list(by_tier) == ["priority", "default", "flex"]
    assert jitter_p99_ms(records) == pytest.approx(jitter_p99_s(r.token_times for r in records[:-1]) * 1000)


def test_price_specs_parse_or_say_why_in_one_line():
    assert parse_prices(["prefill=2.5,decode=2", "colocated=1"]) == {"prefill": 2.5, "decode": 2.0, "colocated": 1.0}
    assert parse_prices(["3"]) == {"prefill": 3.0, "decode": 3.0, "colocated": 3.0}
    assert parse_prices(["2", "decode=4"]) == {"prefill": 2.0, "decode": 4.0, "colocated": 2.0}
    assert parse_prices([]) == {}
    for bad in ("gpu=1", "prefill=abc", "=2", "prefill=", "prefill=-1", "decode=nan", "prefill=2,", "decode=inf"):
        with pytest.raises(InvalidRequestError) as e:
            parse_prices([bad])
        assert "--price-per-hour" in e.value.message and "\n" not in e.value.message
    check_priced({"prefill": 1.0, "decode": 1.0}, ("prefill", "decode"))
    check_priced({}, ("prefill", "decode"))  # no price: cost not measured
    with pytest.raises(InvalidRequestError, match="no price for the decode"):
        check_priced({"prefill": 1.0}, ("prefill", "decode"))


def test_cost_is_worker_hours_at_the_price_split_by_each_roles_work():
    assert usd(2, 1800, 3.0) == 3.0 and usd_per_1k(3.0, 1500) == 2.0 and usd_per_1k(3.0, 0) is None
    tokens = Counter({("prompt", "priority"): 30, ("prompt", "flex"): 10, ("output", "default"): 100,
                      ("output", "flex"): 60})
    assert apportion(8.0, "prefill", tokens) == {"priority": 6.0, "flex": 2.0}
    assert apportion(8.0, "decode", tokens) == {"default": 5.0, "flex": 3.0}
    assert apportion(20.0, "colocated", tokens) == {"priority": 3.0, "flex": 7.0, "default": 10.0}
    assert apportion(8.0, "decode", Counter({("prompt", "flex"): 5})) == {"idle": 8.0}
    meter = CostMeter({"prefill": 2.0, "decode": 4.0})
    assert meter.accrue("decode-0", "decode", 100.0, tokens) == {}  # its first report: charged from here
    assert meter.accrue("decode-0", "decode", 1000.0, tokens) == pytest.approx({"default": 0.625, "flex": 0.375})
    assert meter.accrue("prefill-0", "prefill", 1000.0, tokens) == {}
    assert meter.accrue("prefill-0", "prefill", 4600.0, Counter()) == {"idle": 2.0}


def _sample(metrics: Metrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def _stats(worker: str, role: str, **values) -> dict:
    return {"worker": worker, "role": role, "running": 0, "waiting": 0, "blocks_used": 0, "blocks_total": 8,
            "prompt_tokens": 0, **values}


def test_the_gateways_gauges_follow_the_events_its_drivers_feed():
    metrics = Metrics({"prefill": 3600.0, "decode": 7200.0})  # USD per hour: 1 and 2 USD per second
    metrics.refresh()
    assert math.isnan(_sample(metrics, "pdserve_kv_wasted_transfer_ratio"))  # nothing received yet
    assert _sample(metrics, "pdserve_kv_schedule_predictability", service_tier="default") is None
    tier = (("service_tier", "priority"),)
    metrics.observe("kv_consumption_error", tier, 0.001, 3)
    metrics.observe("kv_consumption_error", tier, 0.5, 1)
    metrics.observe("kv_consumption_error_at_dispatch", tier, 9.0, 5)  # not the gauge's prediction
    metrics.observe_worker_stats(_stats("decode-0", "decode", kv_bytes_received=4000,
                                        kv_wasted_bytes={"aborted": 1000}))
    metrics.observe_worker_stats(_stats("prefill-0", "prefill", kv_wasted_bytes={"stage_evicted": 5000}))
    metrics.observe_stream("flex", [0.0, 1.0, 3.0, 4.0])
    metrics.refresh()
    assert _sample(metrics, "pdserve_kv_schedule_predictability", service_tier="priority") == 0.75
    assert _sample(metrics, "pdserve_kv_consumption_error_seconds_count", service_tier="priority") == 4
    assert _sample(metrics, "pdserve_kv_wasted_transfer_ratio") == 0.25  # staged-and-dropped is no transfer
    assert _sample(metrics, "pdserve_inter_token_jitter_p99_seconds", service_tier="flex") == pytest.approx(
        jitter_p99_s([[0.0, 1.0, 3.0, 4.0]]))
    metrics.observe_tokens("flex", 0, 3)
    metrics.observe_worker_stats(_stats("decode-0", "decode", kv_bytes_received=4000))
    assert _sample(metrics, "pdserve_cost_usd_total", service_tier="flex") > 0  # 2 USD/s since its last report
    assert _sample(metrics, "pdserve_cost_usd_total", service_tier="idle") is None


def test_without_prices_no_cost_is_counted():
    metrics = Metrics()
    metrics.observe_tokens("default", 10, 1)
    for _ in range(2):
        metrics.observe_worker_stats(_stats("decode-0", "decode"))
    assert _sample(metrics, "pdserve_cost_usd_total", service_tier="default") is None
