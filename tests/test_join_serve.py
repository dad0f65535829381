"""Workers that join a running deployment and leave it (issue 17): `pdserve worker --join` against
`pdserve serve --control-port`, real processes over tcp, the `openai` SDK as the client. A worker that joins
takes work; one that leaves under load (SIGTERM) finishes what it holds first: no request is lost or cut."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai
import pytest

from pdserve.bench.server_proc import free_port
from serve_util import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
SECRET = {"PDSERVE_DEPLOYMENT_SECRET": secrets.token_hex(32)}


class Joined:
    """A `pdserve worker --join` process."""

    def __init__(self, control: str, role: str, name: str, *extra: str, env: dict | None = None) -> None:
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"pdserve-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "worker", "--role", role, "--join", control, "--name", name,
             "--num-threads", "1", *extra], stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, **(SECRET if env is None else env)})

    def output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.unlink(self.log.name)


def _state(server: Server, name: str) -> str | None:
    workers = httpx.get(server.url + "/health", timeout=10).json()["workers"]
    return next((w["state"] for w in workers if w["name"] == name), None)


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.25)


@pytest.fixture(scope="module")
def deployment():
    control = free_port()
    server = Server("--transport", "tcp", "--control-port", str(control), "--num-threads", "1", env=SECRET)
    yield server, f"tcp://127.0.0.1:{control}"
    server.stop()


def _stream(client: openai.OpenAI, i: int, tokens: int, out: dict) -> None:
    try:
        stream = client.completions.create(model=MODEL, prompt=f"Request {i}: a story about the sea", stream=True,
                                           max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True},
                                           stream_options={"include_usage": True})
        reason, used = None, None
        for chunk in stream:
            if chunk.choices:
                reason = chunk.choices[0].finish_reason or reason
            used = chunk.usage.completion_tokens if chunk.usage else used
        out[i] = (used, reason)
    except (openai.APIError, httpx.HTTPError) as e:
        out[i] = e


def test_workers_join_take_work_and_leave_under_load_losing_nothing(deployment):
    server, control = deployment
    # (a drain longer than the default 30 s is handed off, not "drained": room for a loaded CI host)
    joined = [Joined(control, role, f"{role}-j", "--drain-timeout-s", "240") for role in ("prefill", "decode")]
    try:
        for w in joined:
            _wait(lambda: _state(server, w.name) == "ready" or w.proc.poll() is not None, 180,
                  f"{w.name} never joined")
            assert w.proc.poll() is None, w.output()
        assert server.metric("pdserve_workers_joined_total", role="decode") == 1
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        out: dict = {}
        threads = [threading.Thread(target=_stream, args=(client, i, 96, out)) for i in range(12)]
        for t in threads:
            t.start()
        _wait(lambda: server.metric("pdserve_num_requests_running", worker="decode-j") > 0, 120,
              "no request ever ran on the joined decode worker")
        for w in joined:
            w.proc.send_signal(signal.SIGTERM)
        for w in joined:
            assert w.proc.wait(300) == 0, w.output()
            assert "left" in w.output()
        for t in threads:
            t.join(300)
        assert out == {i: (96, "length") for i in range(12)}  # every stream whole: none lost, none cut
        # a worker sends `left` and exits: the gateway may count it a moment after the process is gone
        _wait(lambda: server.metric("pdserve_workers_left_total") >= 2, 30, "a `left` event was never counted")
        assert server.metric("pdserve_workers_left_total", how="drained") == 2
        assert server.metric("pdserve_worker_deaths_total") == 0
        # (the metric counts the `left` event; /health's state follows at the supervisor's next tick)
        _wait(lambda: _state(server, "decode-j") == _state(server, "prefill-j") == "left", 30,
              "the workers that left are not shown as left")
        assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"
        after = client.completions.create(model=MODEL, prompt="After they left", max_tokens=8)
        assert after.usage.completion_tokens == 8  # the deployment serves on without them
    finally:
        for w in joined:
            w.stop()


def test_a_worker_that_cannot_serve_alongside_is_refused_and_one_without_the_secret_is_never_heard(deployment):
    server, control = deployment
    refused_before = server.metric("pdserve_worker_joins_refused_total")
    rejected_before = server.metric("pdserve_rejected_connections_total", endpoint="control")
    odd = Joined(control, "decode", "decode-odd", "--block-size", "32")
    stranger = Joined(control, "decode", "decode-stranger", "--join-timeout-s", "10",
                      env={"PDSERVE_DEPLOYMENT_SECRET": secrets.token_hex(32)})
    try:
        assert odd.proc.wait(180) == 2
        assert "refused" in odd.output() and "block size is 32" in odd.output()
        assert stranger.proc.wait(180) == 2
        assert "did not take this worker" in stranger.output()
        assert server.metric("pdserve_worker_joins_refused_total") > refused_before
        assert server.metric("pdserve_rejected_connections_total", endpoint="control") > rejected_before
        assert _state(server, "decode-odd") is None and _state(server, "decode-stranger") is None
    finally:
        odd.stop()
        stranger.stop()
