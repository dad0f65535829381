"""The shared KV pool behind a real `pdserve serve --kv-remote local` (issue 41): the server starts its own
Mooncake master and store server; a prompt served by one worker is written through to the pool, and the same
prompt on the other worker is a pool hit there (`pdserve_prefix_cache_hit_tokens_total{tier="remote"}`), with the
text the first one gave. Clients: the official openai SDK."""

from __future__ import annotations

import threading

import openai
import pytest

from pdserve.mooncake import unavailable
from serve_util import Server, wait_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Every evening the harbour master counted the boats coming home, one by one, and wrote " * 4


@pytest.fixture(scope="module")
def server():
    if unavailable():
        pytest.skip(unavailable())
    s = Server("--mode", "colocated", "--instances", "2", "--routing", "least-loaded", "--kv-remote", "local",
               "--kv-remote-pool-gb", "0.25", "--num-threads", "1")
    yield s
    s.stop()


def test_a_prompt_served_by_one_worker_is_a_pool_hit_on_the_other(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ask = lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,  # noqa: E731
                                            temperature=0).choices[0].text
    first = ask()  # both idle: colocated-0 takes it, and writes its blocks through to the pool
    assert server.wait_metric("pdserve_kv_tier_bytes_total", lambda v: v > 0, worker="colocated-0", tier="remote",
                              direction="in")
    assert server.metric("pdserve_prefix_cache_hit_tokens_total", worker="colocated-1", tier="remote") == 0
    busy = threading.Event()

    def hold_the_first_worker():  # a long stream on colocated-0: least-loaded sends the next request elsewhere
        stream = client.completions.create(model=MODEL, prompt="Count slowly:", max_tokens=200, stream=True,
                                           temperature=0, extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 1:
                busy.set()
    holder = threading.Thread(target=hold_the_first_worker)
    holder.start()
    try:
        assert busy.wait(60)
        assert ask() == first
    finally:
        holder.join(120)
    assert wait_for(lambda: server.metric("pdserve_prefix_cache_hit_tokens_total", worker="colocated-1",
                                          tier="remote") >= 64)
    assert server.metric("pdserve_prefix_cache_hit_tokens_total", worker="colocated-0", tier="remote") == 0
