"""Service tiers in the load generator: `--tier-mix` parsing and assignment, per-tier summaries (429s counted
apart), `send_request` against a real HTTP server that refuses with 429, and the bench CLI end to end."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import Counter

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.bench.client import send_request
from pdserve.bench.metrics import RequestRecord, summarize
from pdserve.bench.tier_mix import assign_tiers, parse_tier_mix, tier_slos
from pdserve.errors import InvalidRequestError

REFUSAL = {"error": {"message": "priority TTFT SLO unattainable under the current load", "type": "rate_limit_error",
                     "param": None, "code": "slo_unattainable"}}


# --- --tier-mix ---------------------------------------------------------------------------------------------

def test_parse_tier_mix_accepts_fractions_summing_to_one():
    assert parse_tier_mix("priority=0.2,default=0.6,flex=0.2") == {"priority": 0.2, "default": 0.6, "flex": 0.2}
    assert parse_tier_mix(" flex = 0.25 , default=0.75") == {"flex": 0.25, "default": 0.75}
    assert parse_tier_mix("default=1") == {"default": 1.0}
    assert parse_tier_mix("priority=0.3333333,default=0.6666667") == pytest.approx(
        {"priority": 0.3333333, "default": 0.6666667})


@pytest.mark.parametrize("text,needle", [
    ("priority=0.5,default=0.6", "sum to 1"),
    ("priority=0.5", "sum to 1"),
    ("gold=0.5,default=0.5", "unknown tier 'gold'"),
    ("auto=1", "unknown tier 'auto'"),
    ("default=0.5,default=0.5", "twice"),
    ("default=x", "must be a number"),
    ("priority=0,default=1", "positive"),
    ("priority=-0.5,default=1.5", "positive"),
    ("priority=nan,default=1", "positive"),
    ("default", "expected"),
    ("", "expected"),
    ("default=1,", "expected"),
])
def test_parse_tier_mix_rejects_bad_specs_in_one_line(text, needle):
    with pytest.raises(InvalidRequestError) as e:
        parse_tier_mix(text)
    msg = str(e.value)
    assert msg.startswith("--tier-mix ") and needle in msg and "\n" not in msg
    assert e.value.param == "tier_mix"


def test_assign_tiers_is_deterministic_and_roughly_proportional():
    mix = parse_tier_mix("priority=0.2,default=0.6,flex=0.2")
    tiers = assign_tiers(5000, mix, seed=3)
    assert tiers == assign_tiers(5000, mix, seed=3)
    assert tiers != assign_tiers(5000, mix, seed=4)
    assert assign_tiers(10, mix, seed=3) == tiers[:10]  # a prefix does not depend on the count
    counts = Counter(tiers)
    assert set(counts) == set(mix)
    for name, share in mix.items():
        assert counts[name] / 5000 == pytest.approx(share, abs=0.03)
    assert assign_tiers(0, mix, seed=0) == []
    assert set(assign_tiers(50, {"flex": 1.0}, seed=1)) == {"flex"}


def test_tier_slos_from_service_tier_specs():
    assert tier_slos(["priority:ttft_ms=500,tpot_ms=50,share=0.3", "flex:tpot_ms=200"]) == {
        "priority": (500.0, 50.0), "flex": (None, 200.0)}
    assert tier_slos([]) == {}
    with pytest.raises(InvalidRequestError, match="--service-tier"):
        tier_slos(["gold:ttft_ms=1"])


# --- summarize per tier -------------------------------------------------------------------------------------

def _ok(tier, ttft, tpot, n=3):
    times = [ttft + i * tpot for i in range(n)]
    return RequestRecord(start_s=0.0, first_token_s=times[0], token_times=times, end_s=times[-1], prompt_tokens=10,
                         output_tokens=n, service_tier=tier)


def _rejected(tier):
    return RequestRecord(start_s=0.0, end_s=0.001, prompt_tokens=10, error="HTTP 429: busy", service_tier=tier,
                         rejected=True)


def _failed(tier):
    return RequestRecord(start_s=0.0, end_s=0.5, prompt_tokens=10, error="HTTP 500: boom", service_tier=tier)


def test_rejections_are_counted_apart_from_errors():
    records = [_ok(None, 0.1, 0.01), _rejected(None), _rejected(None), _failed(None)]
    s = summarize(records, duration_s=2.0, slo_ttft_ms=1000)
    assert (s["num_requests"], s["num_ok"], s["num_errors"], s["num_rejected"]) == (4, 1, 1, 2)
    assert s["errors"] == [{"message": "HTTP 500: boom", "count": 1}]
    assert s["slo"]["attainment"] == pytest.approx(0.25)  # rejected and failed requests are misses
    assert s["request_throughput"] == pytest.approx(0.5)
    assert "per_tier" not in s  # no request carried a tier


def test_per_tier_counts_latencies_and_attainment():
    records = [_ok("priority", 0.1, 0.02), _ok("priority", 0.4, 0.02), _rejected("priority"), _rejected("priority"),
               _ok("default", 0.5, 0.05), _ok("default", 3.0, 0.05), _failed("default"),
               _ok("flex", 5.0, 0.3)]
    s = summarize(records, duration_s=4.0, slo_ttft_ms=2000, slo_tpot_ms=100,
                  tier_slos={"priority": (200.0, 50.0), "flex": (None, None)})
    assert list(s["per_tier"]) == ["priority", "default", "flex"]
    assert (s["num_ok"], s["num_errors"], s["num_rejected"]) == (5, 1, 2)
    pri, dft, flex = (s["per_tier"][t] for t in ("priority", "default", "flex"))
    assert (pri["num_requests"], pri["num_ok"], pri["num_rejected"], pri["num_errors"]) == (4, 2, 2, 0)
    assert pri["ttft_ms"]["p50"] == pytest.approx(250.0) and pri["tpot_ms"]["p90"] == pytest.approx(20.0)
    assert pri["slo"] == {"ttft_ms": 200.0, "tpot_ms": 50.0, "attainment": pytest.approx(0.25),
                          "attainment_accepted": pytest.approx(0.5)}  # 1 of 4; 1 of the 2 accepted
    assert pri["goodput_rps"] == pytest.approx(0.25)  # 1 met / 4 s
    # default has no SLO of its own: the global one (2000 ms TTFT, 100 ms TPOT); the failure is a miss
    assert (dft["num_requests"], dft["num_ok"], dft["num_rejected"], dft["num_errors"]) == (3, 2, 0, 1)
    assert dft["slo"] == {"ttft_ms": 2000, "tpot_ms": 100, "attainment": pytest.approx(1 / 3),
                          "attainment_accepted": pytest.approx(1 / 3)}
    # flex lists (None, None): each limit falls back to the global one; its TPOT (300 ms) misses
    assert flex["slo"]["ttft_ms"] == 2000 and flex["slo"]["tpot_ms"] == 100 and flex["slo"]["attainment"] == 0.0
    assert flex["goodput_rps"] == 0.0


def test_per_tier_slo_falls_back_per_limit_and_is_none_without_any():
    records = [_ok("priority", 0.1, 0.2), _ok("default", 0.1, 0.2), _rejected("default")]
    s = summarize(records, duration_s=1.0, slo_tpot_ms=100, tier_slos={"priority": (150.0, None)})
    pri = s["per_tier"]["priority"]["slo"]
    assert (pri["ttft_ms"], pri["tpot_ms"], pri["attainment"]) == (150.0, 100, 0.0)  # TPOT 200 ms > 100
    relaxed = summarize(records, duration_s=1.0, tier_slos={"priority": (150.0, None)})
    assert relaxed["per_tier"]["priority"]["slo"]["attainment"] == 1.0  # no TPOT limit anywhere
    dft = relaxed["per_tier"]["default"]
    assert dft["slo"] == {"ttft_ms": None, "tpot_ms": None, "attainment": None, "attainment_accepted": None}
    assert dft["goodput_rps"] is None and dft["num_rejected"] == 1
    only_rejected = summarize([_rejected("flex")], duration_s=1.0, slo_ttft_ms=100)["per_tier"]["flex"]
    assert only_rejected["slo"]["attainment"] == 0.0 and only_rejected["slo"]["attainment_accepted"] is None
    assert only_rejected["ttft_ms"]["p50"] is None


def test_untagged_requests_stay_out_of_per_tier():
    s = summarize([_ok(None, 0.1, 0.01), _ok("flex", 0.1, 0.01)], duration_s=1.0)
    assert list(s["per_tier"]) == ["flex"] and s["per_tier"]["flex"]["num_requests"] == 1


# --- a real HTTP server -------------------------------------------------------------------------------------

class FakeServer:
    """An OpenAI-style endpoint on a real socket: refuses `flex` with 429, streams two chunks otherwise."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.bodies.append(body)
            tier = body.get("service_tier") or "default"
            if tier == "flex":
                return JSONResponse(REFUSAL, status_code=429, headers={"Retry-After": "1"})

            async def stream():
                for text in ("a", "b"):
                    yield f"data: {json.dumps({'choices': [{'text': text}], 'service_tier': tier})}\n\n"
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 2}
                yield f"data: {json.dumps({'choices': [], 'usage': usage, 'service_tier': tier})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(stream(), media_type="text/event-stream")

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "fake server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def fake_server():
    s = FakeServer()
    yield s
    s.stop()


def _send(url: str, tier: str | None) -> RequestRecord:
    async def go():
        async with httpx.AsyncClient(timeout=10) as client:
            return await send_request(client, url, "fake-model", [1, 2, 3], 2, service_tier=tier)
    return asyncio.run(go())


def test_send_request_marks_a_429_as_rejected(fake_server):
    fake_server.bodies.clear()
    rec = _send(fake_server.url, "flex")
    assert rec.rejected and not rec.ok and rec.service_tier == "flex"
    assert rec.error == f"HTTP 429: {REFUSAL['error']['message']}"
    assert fake_server.bodies[-1]["service_tier"] == "flex"


def test_send_request_sends_its_tier_or_none(fake_server):
    fake_server.bodies.clear()
    rec = _send(fake_server.url, "priority")
    assert rec.ok and not rec.rejected and rec.service_tier == "priority" and rec.output_tokens == 2
    assert fake_server.bodies[-1]["service_tier"] == "priority"
    plain = _send(fake_server.url, None)
    assert plain.ok and plain.service_tier is None and "service_tier" not in fake_server.bodies[-1]


# --- the CLI ------------------------------------------------------------------------------------------------

BASE = ["bench", "serve", "--endpoint", "http://127.0.0.1:9", "--workload", "fixed:8,2", "--num-requests", "2"]


@pytest.mark.parametrize("extra,needle", [
    (["--tier-mix", "priority=0.5,default=0.6"], "--tier-mix"),
    (["--tier-mix", "gold=1"], "--tier-mix"),
    (["--tier-mix", "default=1", "--service-tier", "gold:ttft_ms=1"], "--service-tier"),
    (["--service-tier", "priority:ttft_ms=-5"], "--service-tier"),
])
def test_bad_tier_flags_are_one_line_errors(extra, needle, capsys):
    from pdserve.cli import main
    assert main(BASE + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0]
    assert "cannot reach" not in err[0]  # checked before any traffic


def test_bench_serve_with_a_tier_mix_reports_per_tier(fake_server, tmp_path, capsys):
    from pdserve.cli import main
    out = tmp_path / "tiers"
    fake_server.bodies.clear()
    rc = main(["bench", "serve", "--endpoint", fake_server.url, "--workload", "fixed:8,2", "--num-requests", "12",
               "--rate", "200", "--tier-mix", "priority=0.4,default=0.3,flex=0.3", "--seed", "5",
               "--service-tier", "priority:ttft_ms=5000", "--slo-tpot-ms", "5000", "--output", str(out),
               "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "service tiers" in printed and "met acc" in printed
    res = json.loads((out / "result.json").read_text())
    assert res["service_tiers"] == ["priority:ttft_ms=5000"]
    assert res["tier_mix"] == {"priority": 0.4, "default": 0.3, "flex": 0.3}
    run = res["runs"][0]
    sent = assign_tiers(12, res["tier_mix"], seed=5)
    assert [r["service_tier"] for r in run["requests"]] == sent
    assert sorted(b["service_tier"] for b in fake_server.bodies) == sorted(sent)
    s = run["summary"]
    n_flex = sent.count("flex")
    assert s["num_rejected"] == n_flex and s["num_errors"] == 0 and s["num_ok"] == 12 - n_flex
    per = s["per_tier"]
    assert per["flex"]["num_rejected"] == per["flex"]["num_requests"] == n_flex
    assert per["priority"]["slo"]["ttft_ms"] == 5000 and per["priority"]["slo"]["tpot_ms"] == 5000
    assert per["priority"]["slo"]["attainment"] == 1.0
    assert per["flex"]["slo"]["attainment"] == 0.0 and per["flex"]["slo"]["attainment_accepted"] is None
