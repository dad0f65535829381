"""A priority arrival pauses a lower tier's chunked prefill at the next chunk boundary, with real processes on
both transports: the flex prompt keeps its blocks and resumes when the priority prompt leaves it budget, the
priority request finishes first, the flex one completes, and the pause is counted
(`pdserve_prefill_yields_total`)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from serve_util import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


async def _run(url: str) -> tuple[list[str], dict[str, str]]:
    done: list[str] = []
    texts: dict[str, str] = {}

    async def one(client, name: str, prompt: str, tier: str, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                            extra_body={"service_tier": tier, "ignore_eos": True})
        assert r.service_tier == tier
        texts[name] = r.choices[0].text
        done.append(name)

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:  # ~1,000 prompt tokens at 16 a step: the flex prefill takes a few seconds
        long = "Flex batch job: " + " ".join(f"item {i} is lorem ipsum;" for i in range(170))
        await asyncio.gather(one(client, "flex", long, "flex", 0.0),
                             one(client, "priority", "Priority question: what is two plus two?", "priority", 0.6))
    finally:
        await client.close()
    return done, texts


@pytest.mark.parametrize("transport", ["shm", pytest.param("tcp", marks=pytest.mark.extended)])
def test_a_priority_arrival_pauses_a_flex_prefill_at_the_next_chunk(transport):
    server = Server("--transport", transport, "--max-num-batched-tokens", "16")
    try:
        order, texts = asyncio.run(_run(server.url))
        assert order == ["priority", "flex"]  # without the pause the priority prompt waits for the whole flex one
        assert texts["flex"] and texts["priority"]
        # the workers' stats (every 0.25 s)
        assert server.wait_metric("pdserve_prefill_yields_total", lambda v: v >= 1, worker="prefill-0",
                                  service_tier="flex") >= 1
        assert server.metric("pdserve_preemptions_total") == 0  # paused, not preempted (nothing recomputed)
        assert server.metric("pdserve_kv_transfer_failures_total") == 0
    finally:
        server.stop()
