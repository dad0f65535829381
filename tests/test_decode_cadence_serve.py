"""`pdserve serve --decode-cadence steady` as a user runs it: real gateway and workers, the `openai` SDK.

The decode worker holds each step's tokens until its steady period (pdserve.core.sched.decode_cadence), serving
its inbox meanwhile: streams still complete with the same greedy text as without it, concurrent requests
keep joining the held batch, and the hold shows in `/metrics`. A bad mode is a one-line CLI error.
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai

from serve_util import Server

PROMPTS = ["Tell me about the sea.", "List three colours.", "Why is the sky blue?", "Count to ten."]


def stream(client: openai.OpenAI, prompt: str) -> str:
    text = []
    for chunk in client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=24,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True}):
        text.append(chunk.choices[0].text if chunk.choices else "")
    return "".join(text)


def test_steady_cadence_streams_the_same_text_and_counts_its_hold():
    server = Server("--decode-cadence", "steady")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0)
        expected = [stream(client, p) for p in PROMPTS]  # one at a time, then all at once
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: stream(client, p), PROMPTS * 2))
        assert together == expected * 2 and all(expected)
        deadline = time.monotonic() + 10  # (workers report their stats every 0.25 s)
        while (held := server.metric("pdserve_decode_cadence_held_seconds_total", worker="decode-0")) == 0:
            assert time.monotonic() < deadline, "no hold reported"  # 8 streams: some steps beat the period
            time.sleep(0.25)
        assert held > 0
        assert server.metric("pdserve_decode_cadence_period_seconds", worker="decode-0") > 0
    finally:
        server.stop()


def test_an_unknown_cadence_is_a_one_line_error():
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--decode-cadence", "smooth"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "decode cadence" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
