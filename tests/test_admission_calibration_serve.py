"""Admission from the first request: a real `pdserve serve` (1 prefill + 1 decode worker, the default model), its
workers' time models calibrated at start (`pdserve.engine.calibration`, a calibration cache of its own so both
profile now, under this host's present load), the official `openai` SDK as the client.

* a burst on the fresh server: what it cannot serve within the TTFT SLO is refused at once (429
  `slo_unattainable`), and at least 90% of what it takes gets its first token within the SLO; no request was
  admitted unpredicted. With `--admission-margin -0.5` (refused past half the SLO): this host's speed varies
  2x from one minute to the next with the other work on it, and a burst's prompts are admitted in the same
  100 ms, before any of them ran;
* a steady load afterwards (one request after the other, twice 10): every admitted request's prediction is
  checked at its first token (`pdserve_admission_prediction_error_seconds`), and the median error of the
  second 10 is within `TOLERANCE_S` (a 128-token prompt's TTFT is ~0.3-1.5 s here).

Sized for a slow, shared 2-core host: a 256-token prompt takes ~0.5-2.5 s to prefill here, so a burst of 24 is
~12-60 s of prefill against a 15 s SLO (7.5 s with the margin): a few taken (at least 2), the rest refused.
"""

from __future__ import annotations

import asyncio
import random
import time

import openai
import pytest

from pdserve.core.sched.online_fit import MIN_SAMPLES
from serve_util import Server, wait_for

MODEL = "SmolLM2-135M-Instruct"
BURST, BURST_TOKENS, SLO_S, MARGIN = 24, 256, 15.0, -0.5
STEADY, STEADY_TOKENS = 10, 128
TOLERANCE_S = 0.5  # the median of observed - predicted TTFT lies in a bucket within +-this
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("calibration")
    server = Server("--service-tier", f"default:ttft_ms={SLO_S * 1000:g}", "--service-tier", "flex:ttft_ms=60000",
                    "--admission-margin", str(MARGIN), env={"PDSERVE_CALIBRATION_CACHE": str(cache)})
    yield server
    server.stop()


async def _one(client: openai.AsyncOpenAI, prompt: list[int], tier: str) -> float | openai.RateLimitError:
    """The client's time to first token, or the 429 that refused it (any other error fails the test)."""
    start = time.perf_counter()
    try:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=True,
                                                 extra_body={"service_tier": tier, "ignore_eos": True})
    except openai.RateLimitError as e:
        return e
    ttft = None
    async for _ in stream:
        ttft = ttft if ttft is not None else time.perf_counter() - start
    return ttft


def _prompts(n: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)  # random token ids: no two prompts share a prefix
    return [[rng.randrange(100, 20000) for _ in range(tokens)] for _ in range(n)]


def _client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_a_fresh_server_refuses_the_burst_it_cannot_serve_and_serves_what_it_takes_in_time(server):
    assert server.metric("pdserve_worker_calibration_steps", worker="prefill-0", source="profiled") >= MIN_SAMPLES
    assert server.metric("pdserve_worker_calibration_steps", worker="decode-0", source="profiled") >= MIN_SAMPLES

    async def burst():
        client = _client(server)
        return await asyncio.gather(*(_one(client, p, "default") for p in _prompts(BURST, BURST_TOKENS, 1)))

    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    ttfts = sorted(r for r in results if not isinstance(r, openai.RateLimitError))
    assert refused, f"all {BURST} taken: TTFTs {ttfts}"
    assert {(e.status_code, e.body["code"]) for e in refused} == {(429, "slo_unattainable")}
    assert len(ttfts) >= 2, f"only {len(ttfts)} of {BURST} taken"
    within = sum(t <= SLO_S for t in ttfts)
    assert within >= 0.9 * len(ttfts), f"{within} of {len(ttfts)} within {SLO_S} s: TTFTs {ttfts}"
    assert server.metric("pdserve_fallbacks_total", kind="admission_unpredicted") == 0
    assert server.metric("pdserve_admission_rejected_total", service_tier="default", reason="slo_ttft") == \
        len(refused)


def _buckets(server: Server, tier: str) -> list[tuple[float, float]]:
    """(le, cumulative count) of the prediction error histogram of `tier`, ascending."""
    rows = [(float(dict(labels)["le"]), v) for (name, labels), v in server.metrics().items()
            if name == "pdserve_admission_prediction_error_seconds_bucket" and dict(labels)["service_tier"] == tier]
    return sorted(rows)


def _steady(server: Server, n: int, seed: int) -> list:
    async def run():
        client, ttfts = _client(server), []
        for prompt in _prompts(n, STEADY_TOKENS, seed):  # one after the other
            ttfts.append(await _one(client, prompt, "flex"))
        return ttfts
    return asyncio.run(run())


def test_predicted_ttft_is_within_tolerance_of_the_observed_on_a_steady_load(server):
    warm = _steady(server, STEADY, 2)  # the steady load's steps join the fit's window
    before = wait_for(lambda: _buckets(server, "flex"), lambda b: b and b[-1][1] >= STEADY)
    ttfts = _steady(server, STEADY, 3)
    assert all(isinstance(t, float) for t in warm + ttfts), warm + ttfts  # a 60 s SLO: none refused
    after = wait_for(lambda: _buckets(server, "flex"), lambda b: b and b[-1][1] >= 2 * STEADY)
    assert after[-1][1] == 2 * STEADY, after  # each admitted request's prediction checked, once
    counts = [(le, n - m) for (le, n), (_, m) in zip(after, before)]  # the second run's errors
    lower, upper = next((lo, le) for (lo, _), (le, n) in zip([(-float("inf"), 0)] + counts, counts)
                        if n >= STEADY / 2)
    assert -TOLERANCE_S <= lower and upper <= TOLERANCE_S, \
        f"median error in ({lower}, {upper}] s; buckets {counts}; client TTFTs {ttfts}"
