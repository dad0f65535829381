"""pdserve.bench.metrics on hand-made timelines: TTFT/TPOT/ITL/E2E, percentiles, SLO attainment, goodput."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.bench.metrics import RequestRecord, goodput, latency_stats, summarize


def _rec(start, times, end=None, out=None, prompt=10, error=None):
    return RequestRecord(start_s=start, first_token_s=times[0] if times else None, token_times=list(times),
                         end_s=end if end is not None else (times[-1] if times else start), prompt_tokens=prompt,
                         output_tokens=len(times) if out is None else out, error=error)


def test_request_record_derived_values():
    r = _rec(1.0, [1.5, 1.6, 1.8, 2.1], end=2.2)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.tpot_s == pytest.approx(0.2)  # (2.1 - 1.5) / 3
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2e_s == pytest.approx(1.2)
    assert r.ok


def test_tpot_uses_token_count_when_chunks_carry_several_tokens():
    r = _rec(0.0, [1.0, 2.0], out=5)  # two chunks, five tokens
    assert r.tpot_s == pytest.approx(0.25) and r.itls == pytest.approx([1.0])


def test_degenerate_records():
    one = _rec(0.0, [0.3])
    assert one.tpot_s is None and one.itls == [] and one.ttft_s == pytest.approx(0.3)
    none = RequestRecord(start_s=0.0)
    assert none.ttft_s is None and none.tpot_s is None and none.e2e_s is None
    # first_token_s falls back to token_times[0] when the runner did not set it
    assert RequestRecord(start_s=1.0, token_times=[1.25, 1.5], output_tokens=2).ttft_s == pytest.approx(0.25)


def test_latency_stats_are_numpy_linear_percentiles_in_ms():
    values = [0.001 * v for v in (1, 2, 3, 4, 10)]
    stats = latency_stats(values)
    assert stats["mean"] == pytest.approx(4.0)
    assert stats["p50"] == pytest.approx(3.0)
    assert stats["p90"] == pytest.approx(7.6)  # 4 + 0.6 * (10 - 4)
    assert stats["p99"] == pytest.approx(np.percentile([1, 2, 3, 4, 10], 99))
    assert latency_stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_summarize_counts_throughput_and_latencies():
    records = [_rec(0.0, [0.1, 0.2, 0.3], prompt=100),   # ttft 100ms, tpot 100ms
               _rec(0.0, [0.3, 0.35, 0.4], prompt=50),   # ttft 300ms, tpot 50ms
               _rec(0.0, [], error="HTTP 500: boom"),
               _rec(0.0, [], error="HTTP 500: boom"),
               _rec(0.0, [], error="timeout")]
    s = summarize(records, duration_s=2.0)
    assert (s["num_requests"], s["num_ok"], s["num_errors"]) == (5, 2, 3)
    assert s["errors"] == [{"message": "HTTP 500: boom", "count": 2}, {"message": "timeout", "count": 1}]
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(3.0) and s["prompt_throughput"] == pytest.approx(75.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0) and s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["tpot_ms"]["p90"] == pytest.approx(95.0)  # 50 + 0.9 * 50
    assert s["itl_ms"]["mean"] == pytest.approx(75.0)  # gaps 100, 100, 50, 50 ms
    assert s["e2e_ms"]["p99"] == pytest.approx(400.0 - 0.01 * 100.0)
    assert s["slo"]["attainment"] is None and "linear" in s["percentile_method"]


def test_slo_attainment_counts_errors_as_misses():
    records = [_rec(0.0, [0.1, 0.2, 0.3]),       # ttft 100, tpot 100
               _rec(0.0, [0.3, 0.35, 0.4]),      # ttft 300, tpot 50
               _rec(0.0, [0.05]),                # one token: ttft 50, meets any TPOT SLO
               _rec(0.0, [], error="boom")]
    assert summarize(records, duration_s=1.0, slo_ttft_ms=200)["slo"]["attainment"] == pytest.approx(0.5)
    assert summarize(records, duration_s=1.0, slo_tpot_ms=60)["slo"]["attainment"] == pytest.approx(0.5)
    both = summarize(records, duration_s=1.0, slo_ttft_ms=300, slo_tpot_ms=60)["slo"]
    assert both == {"ttft_ms": 300, "tpot_ms": 60, "attainment": pytest.approx(0.5)}
    assert summarize(records, duration_s=1.0, slo_ttft_ms=1000, slo_tpot_ms=1000)["slo"]["attainment"] == 0.75
    # a successful request that produced no token cannot meet a TTFT SLO
    assert summarize([_rec(0.0, [])], duration_s=1.0, slo_ttft_ms=1e9)["slo"]["attainment"] == 0.0


def test_summarize_edge_cases():
    empty = summarize([], duration_s=1.0, slo_ttft_ms=100)
    assert empty["num_requests"] == 0 and empty["slo"]["attainment"] is None and empty["ttft_ms"]["p50"] is None
    with pytest.raises(ValueError):
        summarize([], duration_s=0.0)


def test_goodput_requires_every_lower_rate_to_pass():
    assert goodput({1.0: 0.99, 2.0: 0.95, 4.0: 0.85, 8.0: 0.95}) == 2.0  # 8.0 passes but 4.0 missed
    assert goodput({4.0: 0.9, 1.0: 1.0, 2.0: 0.92}) == 4.0  # unsorted keys; threshold is inclusive
    assert goodput({1.0: 0.5, 2.0: 0.95}) is None
    assert goodput({}) is None
    assert goodput({1.0: 0.8, 2.0: 0.7}, threshold=0.75) == 1.0
