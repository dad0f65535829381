"""Staging with real processes on both transports: while the decode worker has no room for more prompts'
blocks, the idle prefill worker computes the waiting prompts ahead (`--delivery scheduled`); their KV waits
in its prefix cache and host tier holding no device blocks, and is sent once the decode worker reserves
room. Every request completes, nothing staged is lost, nothing is recomputed."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import openai
import pytest

from serve_util import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
N, MAX_TOKENS = 6, 96
BLOCKS_PER_PROMPT = 25
NUM_BLOCKS = 64  # each worker's pool


def _prompt(i: int) -> str:  # ~395 tokens (25 blocks), distinct from the first words
    return f"Document {i}: " + " ".join(f"section {i}.{k} lists item {k * 7 + i};" for k in range(32))


def _watch(server: Server, stop: threading.Event, seen: list) -> None:
    """(staged prompts, prefill device blocks in use) as the metrics show them, every 0.1 s."""
    while not stop.is_set():
        m = server.metrics()
        seen.append((m.get(("pdserve_kv_staged_prompts", (("worker", "prefill-0"),)), 0),
                     m.get(("pdserve_kv_blocks_used", (("worker", "prefill-0"),)), 0)))
        time.sleep(0.1)


@pytest.mark.parametrize("transport", ["shm", pytest.param("tcp", marks=pytest.mark.extended)])
def test_prompts_wait_staged_while_the_decode_worker_is_full(transport):
    # 64 blocks of 16 tokens: the decode worker holds two of these requests at a time (25 blocks each, + 6 as
    # they decode); the prefill worker's host tier (~290 blocks of fp32 KV) could keep all the others staged,
    # and its hot window (half its pool) reuses a whole prompt
    server = Server("--transport", transport, "--num-kv-blocks", str(NUM_BLOCKS), "--kv-host-gb", "0.2")
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=_watch, args=(server, stop, seen), daemon=True)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=180)
        watcher.start()
        with concurrent.futures.ThreadPoolExecutor(N) as pool:
            futures = [pool.submit(client.completions.create, model=MODEL, prompt=_prompt(i),
                                   max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
                       for i in range(N)]
            results = [f.result() for f in futures]
        # the prefill worker's last stats (every 0.25 s): the dispatched prefills found their staged prompts
        # cached (device or host tier), and nothing staged is left
        hits = server.wait_metric("pdserve_prefix_cache_hit_tokens_total", lambda v: v >= 2 * 384, worker="prefill-0")
        staged_now = server.wait_metric("pdserve_kv_staged_prompts", lambda v: v == 0, worker="prefill-0")
        stop.set()
        watcher.join()
        assert all(r.usage.completion_tokens == MAX_TOKENS for r in results)  # nothing lost
        assert server.metric("pdserve_kv_staged_total") >= 2
        # staged KV held no device blocks: staged prompts waiting while the prefill worker's pool held fewer
        # blocks in use than they have, or while the blocks in use left too few for them (so their KV was in
        # the host tier, not cached on the device)
        assert any(staged >= 1 and (used < BLOCKS_PER_PROMPT * staged
                                    or used + BLOCKS_PER_PROMPT * staged > NUM_BLOCKS)
                   for staged, used in seen), (len(seen), str([s for s in seen if s[0] >= 1]))
        assert hits >= 2 * 384 and staged_now == 0
        assert server.metric("pdserve_kv_wasted_bytes_total") == 0  # every staged block was reused
        assert server.metric("pdserve_kv_transfer_failures_total") == 0
    finally:
        stop.set()
        server.stop()
