"""Stopping a server drains it (issue 15): on SIGTERM it takes no new connection, the streams in flight get
every token they asked for, and then it exits cleanly; `--drain-timeout-s` bounds the wait."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest

from serve_util import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TOKENS = 300  # ~8 s of streaming here: longer than the 3 s grace the server used to give


def _stream(server: Server, tokens: int, started: threading.Event, out: list) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=tokens, stream=True,
                                       temperature=0, extra_body={"ignore_eos": True})
    for chunk in stream:
        out.append(chunk.choices[0].finish_reason)
        if len(out) == 5:
            started.set()


@pytest.mark.parametrize("drain_s", [30, 0])
def test_sigterm_lets_the_streams_in_flight_finish_then_exits(drain_s):
    server = Server("--mode", "colocated", "--drain-timeout-s", str(drain_s))
    started, out, errors = threading.Event(), [], []

    def run() -> None:
        try:
            _stream(server, TOKENS, started, out)
        except (openai.APIError, httpx.HTTPError) as e:
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(120)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):  # no new connection once it is stopping
        httpx.get(server.url + "/health", timeout=5)
    thread.join(120)
    assert server.proc.wait(60) == 0
    if drain_s:
        assert not errors and out[-1] == "length" and len(out) >= TOKENS - 10  # to the last token: none lost
    else:
        assert out[-1] is None  # no drain: cut
