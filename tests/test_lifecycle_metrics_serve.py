"""The KV lifecycle's four metrics and the cost of serving, live on a real deployment (default model, 1 prefill +
1 decode worker, the official `openai` SDK as client): after requests in three service tiers the gateway's
/metrics carries schedule predictability and P99 inter-token jitter per tier, the wasted transfer ratio and the
links' effective utilization over the last 60 s, and `pdserve_cost_usd_total` grows at the workers' prices,
split between the tiers; `pdserve bench serve` reports the run's USD per 1k tokens, from the server's counter
or from its own `--price-per-hour`; a price that does not parse is a one-line CLI error."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import openai
import pytest

from serve_util import Server, wait_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TIERS = ("priority", "default", "flex")
PRICES = {"prefill": 2.0, "decode": 3.0}  # USD per worker-hour


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args,needle", [
    (["serve", "--price-per-hour", "prefill=abc,decode=2"], "'abc' in 'prefill=abc,decode=2' is not a price"),
    (["serve", "--price-per-hour", "gpu=2"], "unknown role 'gpu'"),
    (["serve", "--price-per-hour", "prefill=2"], "no price for the decode"),
    (["bench", "serve", "--endpoint", "http://127.0.0.1:9", "--workload", "fixed:8,4", "--num-requests", "1",
      "--price-per-hour", "decode=2"], "endpoint's USD per hour"),
])
def test_a_price_that_does_not_parse_is_a_one_line_error(args, needle):
    proc = _cli(*args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr


@pytest.fixture(scope="module")
def server():
    started = time.monotonic()
    s = Server("--price-per-hour", ",".join(f"{role}={usd}" for role, usd in PRICES.items()))
    s.started = started
    yield s
    s.stop()


def _requests(server: Server, per_tier: int) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for i in range(per_tier):
        for tier in TIERS:
            with client.completions.create(model=MODEL, prompt=f"{tier} story number {i}: once upon a time",
                                           max_tokens=8, temperature=0, stream=True,
                                           extra_body={"service_tier": tier, "ignore_eos": True}) as stream:
                assert sum(1 for _ in stream) >= 8


def _cost(server: Server) -> float:
    return server.metric("pdserve_cost_usd_total")


def _predictability(server: Server) -> dict[str, float]:
    return {tier: server.metric("pdserve_kv_schedule_predictability", service_tier=tier) for tier in TIERS}


def test_the_four_metrics_and_cost_are_on_metrics(server):
    # predictions are learnt from the decode worker's consumption tails: each tier gets blocks consumed within
    # 5 ms of their prediction (rounds of requests until it does, or the deadline: a busy host's steps vary)
    on_time = {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        _requests(server, per_tier=3)
        on_time = wait_for(lambda: _predictability(server), lambda v: min(v.values()) > 0, timeout_s=2)
        if min(on_time.values()) > 0:
            break
    for tier in TIERS:
        assert 0 < on_time[tier] <= 1, (tier, on_time)
        # every request ended with 8 tokens: its gaps' distances from its mean gap
        jitter = server.wait_metric("pdserve_inter_token_jitter_p99_seconds", lambda v: v > 0, service_tier=tier)
        assert 0 < jitter < 5, tier
    wasted = server.wait_metric("pdserve_kv_wasted_transfer_ratio", lambda v: not math.isnan(v))
    assert 0 <= wasted <= 1
    assert 0 < server.wait_metric("pdserve_kv_link_effective_utilization", lambda v: v > 0) <= 1
    # cost: each worker at its price from its first report on, never more; and it keeps growing
    cost = _cost(server)
    assert 0 < cost <= sum(PRICES.values()) / 3600 * (time.monotonic() - server.started)
    assert wait_for(lambda: _cost(server), lambda v: v > cost, timeout_s=5) > cost
    for tier in TIERS:  # the tiers served in the last 60 s share the workers' time
        assert server.metric("pdserve_cost_usd_total", service_tier=tier) > 0, tier


def test_bench_reports_usd_per_1k_tokens_from_the_server_or_its_own_price(server, tmp_path):
    workload = ["--endpoint", server.url, "--workload", "fixed:24,6", "--num-requests", "6", "--rate", "20",
                "--tier-mix", "priority=0.5,flex=0.5", "--no-progress"]
    proc = _cli("bench", "serve", *workload, "--output", str(tmp_path / "server"))
    assert proc.returncode == 0, proc.stderr
    assert "cost (server)" in proc.stdout
    (run,) = json.loads((tmp_path / "server" / "result.json").read_text())["runs"]
    cost, summary = run["cost"], run["summary"]
    tokens = summary["total_prompt_tokens"] + summary["total_output_tokens"]
    assert cost["source"] == "server" and cost["usd"] > 0
    assert cost["usd_per_1k_tokens"] == pytest.approx(cost["usd"] / tokens * 1000)
    # the run's share of both workers' hours (their stats every 0.25 s: a report's worth either side)
    assert cost["usd"] <= sum(PRICES.values()) / 3600 * (summary["duration_s"] + 1.0)
    assert set(cost["per_tier"]) <= {"priority", "flex", "default", "idle"} and cost["per_tier"]["flex"]["usd"] > 0

    proc = _cli("bench", "serve", *workload, "--price-per-hour", "36", "--output", str(tmp_path / "flag"))
    assert proc.returncode == 0, proc.stderr
    (run,) = json.loads((tmp_path / "flag" / "result.json").read_text())["runs"]
    cost, summary = run["cost"], run["summary"]
    assert cost["source"] == "--price-per-hour" and "per_tier" not in cost
    assert cost["usd"] == pytest.approx(36 / 3600 * summary["duration_s"])
    assert cost["usd_per_1k_output_tokens"] == pytest.approx(cost["usd"] / summary["total_output_tokens"] * 1000)
