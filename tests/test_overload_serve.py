"""Overload and API keys on a real server with the `openai` SDK (issue 15): several keys (flags and a keys
file, with a per-key default service tier), 401 in OpenAI's shape without a known one; a tier's waiting queue
bounded by --max-queue: beyond it 429 `server_overloaded` with Retry-After, at once, and the rest served."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from serve_util import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


def test_keys_tiers_401_and_a_bounded_queue(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# one per line, optionally with its default tier\nalpha flex\nbeta\n")
    server = Server("--mode", "colocated", "--api-key", "k1", "--api-key", "k2", "--api-keys-file", str(keys),
                    "--max-queue", "1", "--max-num-seqs", "1")
    try:
        def sdk(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)

        for bad in ("wrong", ""):
            with pytest.raises(openai.AuthenticationError) as e:
                sdk(bad or "x").with_options(default_headers={"Authorization": bad}).models.list()
            assert e.value.body["code"] == "invalid_api_key" and e.value.body["type"] == "authentication_error"
        tiers = {key: sdk(key).completions.create(model=MODEL, prompt="Hi", max_tokens=2).service_tier
                 for key in ("k1", "k2", "alpha", "beta")}
        assert tiers == {"k1": "default", "k2": "default", "alpha": "flex", "beta": "default"}
        assert httpx.get(server.url + "/health").status_code == 200  # no key needed there

        async def burst() -> list[httpx.Response]:
            body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 24, "ignore_eos": True}
            async with httpx.AsyncClient(timeout=120, headers={"Authorization": "Bearer k1"}) as c:
                return await asyncio.gather(*(c.post(server.url + "/v1/completions", json=body) for _ in range(6)))

        replies = asyncio.run(burst())
        codes = sorted(r.status_code for r in replies)
        assert codes[0] == 200 and codes[-1] == 429, codes
        for r in replies:
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "server_overloaded" and r.headers["Retry-After"] == "1"
            else:
                assert r.json()["usage"]["completion_tokens"] == 24
        refused = server.metric("pdserve_admission_rejected_total", reason="server_overloaded")
        assert refused == codes.count(429)
    finally:
        server.stop()


def test_a_bad_keys_file_is_a_one_line_error(tmp_path):
    import subprocess
    import sys
    keys = tmp_path / "keys"
    keys.write_text("alpha gold\n")
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--api-keys-file", str(keys)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "line 1" in out.stderr and "Traceback" not in out.stderr
