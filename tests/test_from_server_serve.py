"""`pdserve profile --from-server URL` against a real `pdserve serve` (1 prefill + 1 decode worker, the default
model, an API key), the official `openai` SDK as the client: GET /v1/admin/steps needs the key like every /v1/
path; a server that has served nothing has too few steps (one-line error); after a few requests the profile is a
time model the simulator reads, fitted to the served steps the server reported (not its calibration steps)."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest

from pdserve.model.loader import resolve_model_dir
from pdserve.sim.from_server import fit_from_steps
from pdserve.sim.hardware import get_gpu, get_model
from pdserve.sim.timemodel import FittedTimeModel, StepShape, make_time_model
from serve_util import Server, wait_for
from test_cli import assert_one_line_error, run_cli

MODEL, KEY = "SmolLM2-135M-Instruct", "k-from-server"
pytestmark = pytest.mark.slow


def _steps(server: Server, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{server.url}/v1/admin/steps", headers=headers, timeout=30)


def _served(server: Server) -> dict[str, int]:
    rows = [r for r in _steps(server).json()["data"] if r["source"] == "served"]
    return {"prefill": sum(r["prefill_tokens"] > 0 and r["decode_seqs"] == 0 for r in rows),
            "decode": sum(r["decode_seqs"] > 0 and r["prefill_tokens"] == 0 for r in rows)}


def test_profile_from_a_running_server(tmp_path):
    server = Server("--num-threads", "1", "--api-key", KEY)
    try:
        out = tmp_path / "fit.json"
        assert _steps(server, None).status_code == 401
        before = _steps(server)
        assert before.status_code == 200 and {r["source"] for r in before.json()["data"]} <= {"calibration"}
        assert_one_line_error(run_cli("profile", "--from-server", server.url, "--output", str(out), timeout=60),
                              "HTTP 401 (give --api-key)")
        assert_one_line_error(run_cli("profile", "--from-server", server.url, "--api-key", KEY, "--output",
                                      str(out), timeout=60), "send the server some requests first")
        assert not out.exists()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
        rng = random.Random(0)
        for n in (16, 48, 96, 24, 64, 128):
            client.completions.create(model=MODEL, prompt=[rng.randrange(100, 30000) for _ in range(n)],
                                      max_tokens=6, extra_body={"ignore_eos": True})
        counts = wait_for(lambda: _served(server), lambda c: min(c.values()) >= 6, timeout_s=30)
        assert min(counts.values()) >= 6, counts
        _check_a_reused_prefix_is_reported(server, client)
        _check_steps_cover_the_tokens(server, client)
        records = _steps(server).json()["data"]
        assert {(r["worker"], r["role"]) for r in records} == {("prefill-0", "prefill"), ("decode-0", "decode")}
        proc = run_cli("profile", "--from-server", f"{server.url}/v1", "--api-key", KEY, "--output", str(out),
                       timeout=60)
        assert proc.returncode == 0, proc.stderr
    finally:
        server.stop()
    written = json.loads(out.read_text())
    served = [r for r in written["steps"] if r["source"] == "served"]
    assert len(served) >= sum(counts.values())
    model = FittedTimeModel.from_json(out.read_text())
    assert model.meta["source"] == f"server {server.url}/v1" and "steps" not in model.meta
    assert (model.prefill, model.decode) == (fit_from_steps(written["steps"]).prefill,
                                             fit_from_steps(written["steps"]).decode)
    assert model.step_time(StepShape.decode(1, 64)) > 0 and model.step_time(StepShape(prefill_tokens=64,
                                                                                      prefill_sq=64 * 64)) > 0
    spec = get_model(str(resolve_model_dir(None) / "config.json"))
    assert make_time_model(f"fitted:{out}", spec, get_gpu("l40s"), 1).decode == model.decode


def _decode_rows(server: Server) -> list[dict]:
    return [r for r in _steps(server).json()["data"] if r["source"] == "served" and r["worker"] == "decode-0"
            and r["decode_seqs"] > 0]


def _check_a_reused_prefix_is_reported(server: Server, client: openai.OpenAI) -> None:
    """A prompt that extends one served before (64 tokens, 4 blocks): its prefill step computes the new tokens
    after the cached ones, and reports them times that prefix (`prefill_prefix`: the fit's cached-KV term)."""
    head = [5000 + i for i in range(64)]
    for prompt in (head, head + [6000 + i for i in range(32)]):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body={"ignore_eos": True})

    def over_a_prefix() -> list[dict]:
        return [r for r in _steps(server).json()["data"] if r["source"] == "served" and r["worker"] == "prefill-0"
                and r.get("prefill_prefix")]
    rows = wait_for(over_a_prefix, lambda r: len(r) >= 1, timeout_s=30)
    assert len(rows) == 1 and 32 <= rows[0]["prefill_tokens"] <= 48, rows  # (the last cached block may be redone)
    assert rows[0]["prefill_prefix"] == rows[0]["prefill_tokens"] * (96 - rows[0]["prefill_tokens"]), rows


def _check_steps_cover_the_tokens(server: Server, client: openai.OpenAI, n: int = 48, prompt: int = 200) -> None:
    """A request alone on the decode worker: the steps the worker reported for it add up to the time between its
    tokens (`pdserve.worker.step_times`: a step runs on to the next one's start through the loop work between
    them -- outputs out, commands in, KV polled: ~1% of a step on a quiet host, more on a loaded one; the logic
    itself is checked in tests/test_step_times.py)."""
    import time
    times = []
    stream = client.completions.create(model=MODEL, prompt=[300 + i for i in range(prompt)], max_tokens=n,
                                       stream=True, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text is not None:
            times.append(time.perf_counter())
    assert len(times) == n, len(times)

    def mine() -> list[dict]:  # its steps: decode step i reads a context of prompt + i (the others' are shorter)
        rows = [r for r in _decode_rows(server) if r["decode_seqs"] == 1 and r["decode_context"] > prompt]
        return sorted(rows, key=lambda r: r["decode_context"])
    rows = wait_for(mine, lambda r: len(r) >= n - 1, timeout_s=30)
    assert [r["decode_context"] for r in rows] == list(range(prompt + 1, prompt + n)), rows
    # steps 1 .. n-2 (start to next start) against tokens 2 .. n out (the first comes from the prefill worker;
    # step i gives token i + 1; the last step has no next one to run on to)
    reported, span = sum(r["seconds"] for r in rows[:-1]), times[-1] - times[1]
    assert abs(reported / span - 1) < 0.03, (reported, span)
