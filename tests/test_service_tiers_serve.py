"""Service tiers end to end: real `pdserve serve` processes, the official `openai` SDK as the client.

* the `service_tier` a request asks for (or `auto`) comes back in the response; an unknown one is a 400;
* the guaranteed tier's reserved share is lent to other tiers while idle and taken back for a priority
  request (an elastic request is preempted, counted per tier), colocated;
* per-tier queue order on a PD decode worker: priority, then default, then flex;
* prediction-based admission: once a worker has reported its step times, a request whose tier's SLO is out
  of reach is refused at once with 429, `Retry-After` and code `slo_unattainable` (streaming or not); a tier
  without an SLO is served; `--admission off` serves everything.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from serve_util import Server, wait_for

MODEL = "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.slow


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _aclient(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


async def _stream(c, done: list, name: str, tier: str, max_tokens: int, started: asyncio.Event | None = None):
    """Stream one completion in `tier`; set `started` at its first chunk; append `name` to `done` at its end."""
    async with await c.completions.create(model=MODEL, prompt=f"Story {name}:", max_tokens=max_tokens,
                                          temperature=0, stream=True,
                                          extra_body={"service_tier": tier, "ignore_eos": True}) as stream:
        async for _ in stream:
            if started is not None:
                started.set()
    done.append(name)


@pytest.fixture(scope="module")
def colocated():
    server = Server("--mode", "colocated", "--max-num-seqs", "2", "--service-tier", "priority:share=0.5",
                    "--service-tier", "flex:ttft_ms=1")
    yield server
    server.stop()


def test_the_tier_used_comes_back_and_an_unknown_one_is_a_400(colocated):
    c = _client(colocated)
    for asked, used in ((None, "default"), ("auto", "default"), ("priority", "priority"), ("default", "default")):
        extra = {} if asked is None else {"service_tier": asked}
        resp = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                         extra_body=extra)
        assert resp.service_tier == used
    with c.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream=True,
                              extra_body={"service_tier": "priority"}) as stream:
        assert {chunk.service_tier for chunk in stream} == {"priority"}
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"service_tier": "scale"})
    assert "allowed: auto, priority, default, flex" in e.value.body["message"]
    assert e.value.body["param"] == "service_tier"


def test_priority_takes_its_lent_share_back(colocated):
    """Two long default streams hold both slots (priority's share lent out); a priority request arrives: at
    the next step one default request is preempted, and the priority request finishes long before them."""
    done: list[str] = []
    before = colocated.metric("pdserve_preemptions_total", service_tier="default")

    async def main():
        c = _aclient(colocated)
        started = [asyncio.Event(), asyncio.Event()]
        longs = [asyncio.create_task(_stream(c, done, f"long{i}", "default", 600, started[i])) for i in range(2)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        await asyncio.wait_for(_stream(c, done, "urgent", "priority", 8), 60)
        assert not any(t.done() for t in longs)
        await asyncio.wait_for(asyncio.gather(*longs), 300)

    asyncio.run(main())
    assert done[0] == "urgent"
    assert wait_for(lambda: colocated.metric("pdserve_preemptions_total", service_tier="default") > before)
    assert colocated.metric("pdserve_preemptions_total", service_tier="priority") == 0


def test_admission_refuses_an_unattainable_slo_with_429_and_serves_best_effort_tiers(colocated):
    c = _client(colocated)
    for i in range(10):  # step times for the worker's model (a lone request: pure prefill, then decode steps)
        c.completions.create(model=MODEL, prompt=f"Warm up number {i}", max_tokens=3)

    def flex():  # refused once the worker's stats (every 0.25 s) have reached the gateway's admission
        try:
            c.completions.create(model=MODEL, prompt="Quick one", max_tokens=3, extra_body={"service_tier": "flex"})
        except openai.RateLimitError as e:
            return e
        return None

    refused = wait_for(flex, lambda e: e is not None, timeout_s=10, every_s=0.1)
    assert refused is not None, "a 1 ms TTFT SLO was never refused"
    assert refused.status_code == 429 and refused.body["code"] == "slo_unattainable"
    assert int(refused.response.headers["retry-after"]) >= 1
    raw = httpx.post(colocated.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True,
        "service_tier": "flex"})
    assert raw.status_code == 429 and raw.json()["error"]["type"] == "rate_limit_error"  # before any SSE
    greedy = dict(model=MODEL, prompt="Quick one", max_tokens=3, temperature=0)
    default = c.completions.create(**greedy, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 3 and default.choices[0].finish_reason == "length"
    priority = c.completions.create(**greedy, extra_body={"ignore_eos": True,  # no SLO: best effort, served
                                                          "service_tier": "priority"})
    assert priority.service_tier == "priority" and priority.usage.completion_tokens == 3
    assert priority.choices[0].text == default.choices[0].text  # a tier orders the queue, never the tokens
    assert colocated.metric("pdserve_admission_rejected_total", service_tier="flex", reason="slo_ttft") >= 2
    assert colocated.metric("pdserve_requests_total", service_tier="default") >= 10
    assert colocated.metric("pdserve_time_to_first_token_seconds_count", service_tier="priority") >= 1


def test_pd_decode_worker_orders_its_queue_by_tier_and_admission_off_serves_all():
    server = Server("--max-num-seqs", "1", "--admission", "off", "--service-tier", "default:ttft_ms=1")
    order: list[str] = []

    async def main():
        c = _aclient(server)
        started = asyncio.Event()
        busy = asyncio.create_task(_stream(c, order, "busy", "default", 200, started))
        await asyncio.wait_for(started.wait(), 60)
        queued = []
        for name, tier in (("flex", "flex"), ("default", "default"), ("priority", "priority")):
            queued.append(asyncio.create_task(_stream(c, order, name, tier, 4)))
            n = len(queued)
            assert await asyncio.to_thread(wait_for, lambda: server.metric("pdserve_num_requests_waiting",
                                                                           worker="decode-0") >= n)
        await asyncio.wait_for(asyncio.gather(busy, *queued), 300)

    try:
        asyncio.run(main())
        assert order == ["busy", "priority", "default", "flex"]
        assert server.metric("pdserve_admission_rejected_total") == 0
    finally:
        server.stop()
