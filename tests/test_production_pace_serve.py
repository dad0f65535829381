"""Production paced per link with real processes (`pdserve.core.pd.production_pace`): one prefill worker, two
decode workers, throttled links. While the link to one decode worker is backed up with long prompts' KV, the
prompts bound for the other go on (the held ones wait at a chunk boundary: counted `held`), chunks are cut
to a link's headroom (counted `capped`), nothing fails, and every output is the one the model gives alone."""

from __future__ import annotations

import asyncio

import openai
import pytest

from pdserve import LLM, SamplingParams
from serve_util import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


def _prompts(tokenizer) -> list[list[int]]:
    """Token ids (the same ones to the server and to the reference): long and short prompts alternating."""
    texts = []
    for i in range(6):
        words = 40 if i % 2 == 0 else 4
        texts.append(f"Job {i}: " + " ".join(["lorem ipsum dolor sit amet"] * words))
    return [tokenizer.encode(t) for t in texts]


def test_a_backed_up_link_holds_only_its_own_prompts_and_outputs_are_unchanged():
    llm = LLM()
    prompts = _prompts(llm.tokenizer)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reference = [o.text for o in llm.generate(prompts, params)]
    del llm
    # 2 MB/s per link and 0.2 s of water: a long prompt's KV (~12 MB) backs its link up for seconds
    server = Server("--prefill", "1", "--decode", "2", "--link-gbps", "0.016", "--delivery-backlog-s", "0.2",
                    "--max-num-batched-tokens", "64")
    try:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)

        async def one(ids: list[int], delay_s: float) -> str:
            await asyncio.sleep(delay_s)
            out = await client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                                  extra_body={"ignore_eos": True})
            assert out.usage.completion_tokens == 6
            return out.choices[0].text

        async def run_all():
            try:
                return await asyncio.gather(*(one(p, 0.2 * i) for i, p in enumerate(prompts)))
            finally:
                await client.close()

        assert asyncio.run(run_all()) == reference
        # the workers' stats (every 0.25 s) carry the counts
        assert server.wait_metric("pdserve_production_paced_total", lambda v: v > 0, worker="prefill-0",
                                  outcome="capped") > 0
        assert server.wait_metric("pdserve_production_paced_total", lambda v: v > 0, worker="prefill-0",
                                  outcome="held") > 0
        assert server.metric("pdserve_kv_transfer_failures_total") == 0
    finally:
        server.stop()
