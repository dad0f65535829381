"""The shared KV pool behind a real `pdserve serve --kv-remote local` (issue 41): the server starts its own
Mooncake master and store server; a prompt served by one worker is written through to the pool, and the same
prompt on the other worker is a pool hit there (`pdserve_prefix_cache_hit_tokens_total{tier="remote"}`), with the
text the first one gave: two colocated workers, and two prefill workers of a pd deployment. Clients: the official
openai SDK; routing least-loaded, the first worker kept busy so the repeat goes to the other."""

from __future__ import annotations

import threading

import openai
import pytest

from pdserve.mooncake import unavailable
from serve_util import Server, wait_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Every evening the harbour master counted the boats coming home, one by one, and wrote " * 4
LONG = "A very long list of harbours, ships and their cargo follows, line after line, page after page. " * 150
SHAPES = {"colocated": (["--mode", "colocated", "--instances", "2"], "colocated-0", "colocated-1"),
          "pd": (["--prefill", "2", "--decode", "1"], "prefill-0", "prefill-1")}


@pytest.fixture(scope="module", params=[pytest.param("colocated", marks=pytest.mark.extended), "pd"])
def shaped(request):
    if unavailable():
        pytest.skip(unavailable())
    args, first, other = SHAPES[request.param]
    s = Server(*args, "--routing", "least-loaded", "--kv-remote", "local", "--kv-remote-pool-gb", "0.25",
               "--num-threads", "1")
    yield s, first, other
    s.stop()


def test_a_prompt_served_by_one_worker_is_a_pool_hit_on_the_other(shaped):
    server, first_worker, other_worker = shaped
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ask = lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,  # noqa: E731
                                            temperature=0).choices[0].text
    first = ask()  # all idle: the first worker takes it, and writes its blocks through to the pool
    assert server.wait_metric("pdserve_kv_tier_bytes_total", lambda v: v > 0, worker=first_worker, tier="remote",
                              direction="in")
    assert server.metric("pdserve_prefix_cache_hit_tokens_total", worker=other_worker, tier="remote") == 0
    looked_up = server.metric("pdserve_prefix_cache_query_tokens_total", worker=first_worker)

    def hold_the_first_worker():  # a long request on it (a ~3k-token prompt): least-loaded sends the next one to
        stream = client.completions.create(model=MODEL, prompt=LONG, max_tokens=100, stream=True,  # the other
                                           temperature=0, extra_body={"ignore_eos": True})
        for _ in stream:
            pass
    holder = threading.Thread(target=hold_the_first_worker)
    holder.start()
    try:  # (once the first worker has taken it: its lookup is counted)
        assert server.wait_metric("pdserve_prefix_cache_query_tokens_total", lambda v: v > looked_up + 1000,
                                  worker=first_worker, timeout_s=60)
        assert ask() == first
    finally:
        holder.join(180)
    assert wait_for(lambda: server.metric("pdserve_prefix_cache_hit_tokens_total", worker=other_worker,
                                          tier="remote") >= 64)
    assert server.metric("pdserve_prefix_cache_hit_tokens_total", worker=first_worker, tier="remote") == 0
