"""Recompute you can see (issue 40 item 5), with real processes and the official `openai` SDK as the client:
every response's `usage.kv_transfer` says how its prompt's KV reached the decode worker (delivered, recomputed
and why, cached there), `pdserve_kv_recomputed_tokens_total{reason}` counts what was recomputed, and a
prefill worker that joins a `--transport auto` deployment gets an address it can use (its KV delivered, not
lapsing after `--kv-timeout-s` and recomputed). (A prefill worker that reports its delivery failed has the
decode worker recompute at once, reason `failed_send`: `test_conductor_core`; by hand, with the address fix
undone, the joined worker's requests took 1.5 s each instead of 30 s.)"""

from __future__ import annotations

import time

import openai
import pytest

from pdserve.bench.server_proc import free_port
from serve_util import Server, wait_for
from test_join_serve import SECRET, Joined, _state

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KV_TIMEOUT_S = 30.0  # a transfer that lapses takes this long: each request here must take far less
TEXT = "the tide came in over the rocks while the lighthouse keeper wrote in his log " * 3


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _kv(usage) -> dict:
    """`usage.kv_transfer`: an extension the SDK keeps in `model_extra` (its own fields parse as before)."""
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    return usage.model_extra["kv_transfer"]


def _complete(client: openai.OpenAI, i: int) -> tuple[float, object]:
    start = time.monotonic()
    out = client.completions.create(model=MODEL, prompt=f"Request {i}: {TEXT}", max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4
    return time.monotonic() - start, out.usage


def _stream_usage(client: openai.OpenAI, prompt: str):
    """The usage of a streamed chat completion: only its last chunk carries one (`include_usage`)."""
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    return chunks[-1].usage


def _joined(*serve_args: str):
    """A gateway with one decode worker and no prefill worker of its own, and a prefill worker that joined it
    (`pdserve worker --join`, tcp)."""
    control = free_port()
    server = Server("--control-port", str(control), "--prefill", "0", "--decode", "1", "--num-threads", "1",
                    "--kv-timeout-s", str(KV_TIMEOUT_S), *serve_args, env=SECRET)
    worker = Joined(f"tcp://127.0.0.1:{control}", "prefill", "prefill-j")
    state = wait_for(lambda: _state(server, "prefill-j") if worker.proc.poll() is None else "exited",
                     lambda s: s in ("ready", "exited"), timeout_s=180, every_s=0.25)
    if state != "ready":
        out = worker.output()
        worker.stop()
        server.stop()
        raise AssertionError(f"the prefill worker never joined ({state}): {out}")
    return server, worker


def test_a_prefill_worker_joined_to_an_auto_deployment_delivers_and_usage_says_so():
    server, worker = _joined("--transport", "auto")
    try:
        client = _client(server)
        done = [_complete(client, i) for i in range(3)]
        for seconds, usage in done:
            assert seconds < KV_TIMEOUT_S / 2, done  # no transfer lapsed
            assert _kv(usage) == {"delivered_tokens": usage.prompt_tokens, "recomputed_tokens": 0,
                                  "recompute_reason": None, "cached_tokens": 0, "checkpoint_tokens": 0}
        assert server.metric("pdserve_kv_transfer_time_seconds_count", outcome="delivered") == 3
        assert server.metric("pdserve_kv_recovery_total") == 0
        assert server.metric("pdserve_kv_recomputed_tokens_total") == 0
        # the same prompt again: its whole blocks are in the decode worker's prefix cache, the rest delivered
        _, again = _complete(client, 0)
        kv = _kv(again)
        assert kv["cached_tokens"] > 0 and kv["cached_tokens"] == again.prompt_tokens_details.cached_tokens
        assert kv["delivered_tokens"] == again.prompt_tokens - kv["cached_tokens"] and kv["recomputed_tokens"] == 0
        # streamed: the last chunk's usage carries it too
        usage = _stream_usage(client, "Tell me about the sea")
        assert _kv(usage)["delivered_tokens"] == usage.prompt_tokens
    finally:
        worker.stop()
        server.stop()


def test_usage_shows_recomputed_tokens_and_why_when_delivery_fails():
    # every chunk the prefill worker sends is corrupted after its checksum: the decode worker refuses it
    server = Server("--num-threads", "1", env={"PDSERVE_FAULT_CORRUPT_CHUNKS": "1"})
    try:
        client = _client(server)
        _, usage = _complete(client, 0)
        assert _kv(usage) == {"delivered_tokens": 0, "recomputed_tokens": usage.prompt_tokens,
                              "recompute_reason": "failed_checksum", "cached_tokens": 0, "checkpoint_tokens": 0}
        streamed = _stream_usage(client, "Tell me about the sea")
        assert _kv(streamed)["recomputed_tokens"] == streamed.prompt_tokens
        assert _kv(streamed)["recompute_reason"] == "failed_checksum"
        assert server.metric("pdserve_kv_recomputed_tokens_total", reason="failed_checksum") == (
            usage.prompt_tokens + streamed.prompt_tokens)
    finally:
        server.stop()
