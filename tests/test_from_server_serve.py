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
