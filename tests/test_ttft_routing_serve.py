"""Routing by predicted TTFT reads the workers' own cache reports (`kv_cache` events), on a real server: 1 prefill
+ 2 decode workers, the default model, the `openai` SDK as the client.

A conversation's first turn (prompt P, 100 output tokens O) leaves P and O's KV in its decode worker's prefix
cache. The gateway sent that worker P only: O's blocks it knows of from the worker's reports alone. The next
turn (P + O, cut to 16k + 1 tokens so the worker holds all of it but its last token) is predicted to need no
prefill and no transfer there, so it goes there and is served from that cache: no prompt token computed by the
prefill worker, the whole prompt but the last token a prefix hit on that decode worker. Three conversations, each
must land on its own first turn's worker; where the gateway's guess (P only) and the report differ, it is
counted (`pdserve_routing_prefix_disagreements_total`).
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serve_util import Server, wait_for

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["The history of the printing press begins in", "A short guide to growing tomatoes on a balcony:",
          "The rules of chess, explained for a curious child:"]
OUTPUT = 100


@pytest.fixture(scope="module")
def server():
    s = Server("--prefill", "1", "--decode", "2", "--routing", "predicted-ttft")
    yield s
    s.stop()


def token_ids(server: Server, pieces: list[str]) -> list[int]:
    """The ids of generated tokens from their strings (logprobs' `tokens`): each piece tokenized alone."""
    out = []
    for piece in pieces:
        ids = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": piece,
                                                         "add_special_tokens": False}).json()["tokens"]
        assert len(ids) == 1, (piece, ids)
        out += ids
    return out


def held(server: Server) -> dict[str, float]:
    return {w: server.metric("pdserve_routing_reported_blocks", worker=w) for w in ("decode-0", "decode-1")}


def test_the_next_turn_goes_where_the_workers_report_its_history_is_cached(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for topic in TOPICS:
        prompt = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": topic}).json()["tokens"]
        before = held(server)
        first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=OUTPUT, temperature=0, logprobs=0,
                                          extra_body={"ignore_eos": True})
        history = prompt + token_ids(server, first.choices[0].logprobs.tokens)
        blocks = (len(history) - 1) // 16  # its KV: P and O but O's last token, in whole blocks
        # its decode worker's report of P + O's blocks reaches the conductor
        after = wait_for(lambda: held(server), lambda h: any(h[w] - before[w] >= blocks for w in h), 10.0)
        worker = max(after, key=lambda w: after[w] - before[w])
        assert after[worker] - before[worker] >= blocks, (before, after)
        nxt = history[:16 * blocks + 1]
        hits = server.metric("pdserve_prefix_cache_hit_tokens_total", worker=worker)
        computed = server.metric("pdserve_prompt_tokens_computed_total", worker="prefill-0")
        client.completions.create(model=MODEL, prompt=nxt, max_tokens=2, temperature=0)
        got = server.wait_metric("pdserve_prefix_cache_hit_tokens_total", lambda v: v - hits >= 16 * blocks, 10.0,
                                 worker=worker)
        assert got - hits >= 16 * blocks, f"the next turn did not run on {worker}, where its history is cached"
        assert server.metric("pdserve_prompt_tokens_computed_total", worker="prefill-0") == computed  # no prefill
    assert server.metric("pdserve_routing_prefix_disagreements_total", role="decode") >= len(TOPICS)
