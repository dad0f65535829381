"""Idle prewarm with real processes: two requests sharing a document make it a hot prefix; the prefill worker
that has not seen it is idle and computes it ahead (`warm`); concurrent requests on the document are then
spread over both prefill workers and both find it cached."""

from __future__ import annotations

import concurrent.futures
import time

import openai
import pytest

from serve_util import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
DOC = "Shared manual: " + " ".join(f"rule {k} says value {k * 13 % 97} applies to case {k};" for k in range(36))
DONE = {"worker": "prefill-1", "outcome": "done"}


def _ask(client, i: int):
    return client.completions.create(model=MODEL, prompt=f"{DOC}\nQuestion {i}: what does rule {i} say?",
                                     max_tokens=8, temperature=0, extra_body={"ignore_eos": True})


def test_an_idle_prefill_worker_warms_a_hot_document_and_then_serves_it_from_cache():
    server = Server("--prefill", "2", "--decode", "1")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        _ask(client, 0)
        assert server.metric("pdserve_kv_idle_prewarms_total") == 0  # one request is not a pattern
        _ask(client, 1)  # the same worker again (prefix affinity); the document is hot now
        deadline = time.monotonic() + 60
        while server.metric("pdserve_kv_idle_prewarms_total", **DONE) < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.metric("pdserve_kv_idle_prewarms_total", **DONE) == 1
        assert server.metric("pdserve_prefix_cache_hit_tokens_total", worker="prefill-1") == 0
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda i: _ask(client, i), range(2, 6)))
        assert all(r.usage.completion_tokens == 8 for r in results)
        # some went to prefill-1 and found the document there (all its full blocks), in the workers' last stats
        doc_tokens = results[0].usage.prompt_tokens - 16
        assert server.wait_metric("pdserve_prefix_cache_hit_tokens_total", lambda v: v >= doc_tokens - 16,
                                  worker="prefill-1") >= doc_tokens - 16
        assert server.metric("pdserve_kv_idle_prewarms_total", **DONE) == 1  # it has the document: no second pass
    finally:
        server.stop()
