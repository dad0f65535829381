"""Scheduled KV delivery with real processes on a saturated (throttled) link, both transports: a priority
request's KV overtakes a flex request's KV queued before it (`--delivery scheduled`, the tiers' link
shares), while `--delivery fifo` sends it after; the lifecycle metrics move (consumption predictions
checked per block, effective link utilization); backpressure pauses production while the link is backed up."""

from __future__ import annotations

import asyncio

import openai
import pytest

from serve_util import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
LINK_GBPS = "0.016"  # 2 MB/s: a few seconds for a few hundred tokens' KV, well below production


async def _finish_order() -> list[str]:
    """A long flex prompt, then (once its prefill has begun) a short priority one: which finishes first."""
    done: list[str] = []

    async def one(client, name: str, prompt: str, tier: str, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                        extra_body={"service_tier": tier, "ignore_eos": True})
        done.append(name)

    client = openai.AsyncOpenAI(base_url=SERVER.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        long = "Flex job: " + " ".join(["lorem ipsum dolor sit amet"] * 30)
        await asyncio.gather(one(client, "flex", long, "flex", 0.0),
                             one(client, "priority", "Priority question: what is two plus two?", "priority", 0.3))
    finally:
        await client.close()
    return done


SERVER: Server


# the fifo control runs in the default suite too (its cheapest transport): the order depends on --delivery
@pytest.mark.parametrize("transport,delivery", [("shm", "scheduled"), ("tcp", "scheduled"), ("shm", "fifo")])
def test_priority_kv_overtakes_flex_kv_on_a_saturated_link(transport, delivery):
    global SERVER
    # tcp also checks backpressure: 32-token chunks, each more KV than 0.1 s of the link carries, so the
    # prefill worker waits between a flex prompt's chunks (a flex backlog does not hold a priority one)
    pause = ["--delivery-backlog-s", "0.1", "--max-num-batched-tokens", "32"] if transport == "tcp" else []
    # shm: no backpressure (a water level of 0), so production is not paced and only the delivery order decides
    # which KV lands first (the fifo control would otherwise see the flex prompt's production split by the link)
    SERVER = Server("--transport", transport, "--delivery", delivery, "--link-gbps", LINK_GBPS,
                    *(pause or ["--delivery-backlog-s", "0"]))
    try:
        link = "prefill-0->decode-0"
        order = asyncio.run(_finish_order())
        expected = ["priority", "flex"] if delivery == "scheduled" else ["flex", "priority"]
        assert order == expected
        # delivered blocks' consumption was predicted and checked (at dispatch too, once admission's step
        # model has enough steps: not in a run this short); the workers' stats (every 0.25 s) carry the totals
        assert SERVER.wait_metric("pdserve_kv_consumption_error_seconds_count", lambda v: v > 0) > 0
        effective = SERVER.wait_metric("pdserve_kv_link_effective_utilization", lambda v: v > 0.3, link=link)
        assert 0.3 < effective <= 1.0, effective  # throttled: it ran near its rate while it had a backlog
        assert SERVER.metric("pdserve_kv_transfer_failures_total") == 0
        if pause:  # a flex prompt alone: its chunks wait for the link (with the priority one waiting, they
            # did not: a flex backlog does not hold a priority prompt's production)
            client = openai.OpenAI(base_url=SERVER.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            client.completions.create(model=MODEL, prompt="Flex again: " + " ".join(["lorem ipsum"] * 50),
                                      max_tokens=2, temperature=0, extra_body={"service_tier": "flex"})
        paused = SERVER.wait_metric("pdserve_production_paused_seconds_total", lambda v: v > 0.5 or not pause,
                                    worker="prefill-0")
        assert (paused > 0.5) if pause else (paused == 0), paused  # (shm: a water level of 0 never pauses)
    finally:
        SERVER.stop()



def test_a_queued_transfers_consumption_is_predicted_again_when_a_priority_one_shares_its_link():
    # 8 MB/s: a ~300-token default prompt's KV (~14 MB) queues for seconds after its prefill; a short
    # priority prompt prefilled meanwhile takes its tier's share of the link, so the default one's landing
    # estimate moves and the prefill worker reports it (`relanded`)
    server = Server("--link-gbps", "0.064")
    try:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(prompt: str, tier: str, delay_s: float) -> None:
            await asyncio.sleep(delay_s)
            await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                            extra_body={"service_tier": tier, "ignore_eos": True})

        async def both() -> None:
            try:
                await asyncio.gather(one("Default job: " + " ".join(["lorem ipsum dolor sit amet"] * 60),
                                         "default", 0.0),
                                     one("Priority: what is two plus two?", "priority", 0.8))
            finally:
                await client.close()

        asyncio.run(both())
        assert server.metric("pdserve_kv_prediction_refinements_total", service_tier="default") >= 1
        assert server.metric("pdserve_kv_consumption_error_at_prefilled_seconds_count") > 0
        assert server.metric("pdserve_kv_transfer_failures_total") == 0
    finally:
        server.stop()
