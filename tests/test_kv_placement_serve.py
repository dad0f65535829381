"""Stage-driven KV placement on a real server (`pdserve serve`, the default model, the OpenAI SDK as client):
a conversation's turns among other users' prompts that each need nearly the whole device pool; the moves
between tiers (evictions kept below) and the prefetch counters reach /metrics through the workers' stats,
the later turns find their prefixes, and the tokens are the reference's (no wrong KV is ever read). Whether a prefetch is worth making depends on how
steady the think times are against how long each tier keeps a block (timing a loaded host cannot promise),
so the prefetch itself is shown on the engine with a clock the test moves (tests/test_kv_placement.py)."""

from __future__ import annotations

import time

import openai
import pytest

from serve_util import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
# Other users' prompts, each nearly the whole 32-block device pool: every one pushes the conversation out
FILLER = [f"Inventory note {i}: " + " ".join(f"shelf {i}-{k} holds crates of {w}." for k, w in
                                             enumerate(("nails", "bolts", "rope", "paint", "glue", "tape") * 6))
          for i in range(8)]
OPENING = ("You are a patient tutor. The student asks about the water cycle: evaporation, condensation, "
           "precipitation and collection. Explain each step briefly.")
TURNS = [" Student: what is evaporation?", " Student: and condensation?", " Student: why does it rain?",
         " Student: where does the water go?", " Student: summarise all four."]
GAP_S = 1.0  # the student's think time


def _complete(client: openai.OpenAI, prompt: str) -> tuple[str, int]:
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens


def _conversation(client: openai.OpenAI, filler: bool) -> list[str]:
    """The turns' prompts, each the last one + its answer + the next question; filler prompts after each turn
    (as other users' traffic) push the conversation's blocks off the device and out of host."""
    prompt, prompts = OPENING, []
    for i, turn in enumerate(TURNS):
        start = time.monotonic()
        prompt = prompt + turn
        prompts.append(prompt)
        answer, _ = _complete(client, prompt)
        prompt += answer
        if filler:
            _complete(client, FILLER[i % len(FILLER)])
        time.sleep(max(GAP_S - (time.monotonic() - start), 0.0))
    return prompts


def test_a_conversation_is_served_from_the_lower_tiers_and_the_moves_are_counted(tmp_path):
    tiers = ["--num-kv-blocks", "32", "--block-size", "16", "--max-num-seqs", "4", "--kv-host-gb", "0.05",
             "--kv-disk-dir", str(tmp_path / "kv"), "--kv-placement", "staged", "--mode", "colocated"]
    server = Server(*tiers)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        prompts = _conversation(client, filler=True)
        outputs = [_complete(client, p)[0] for p in prompts[-1:]]
        moves = lambda **kw: server.metric("pdserve_kv_tier_moves_total", **kw)  # noqa: E731
        assert server.wait_metric("pdserve_kv_tier_moves_total", lambda v: v > 0, kind="demotion", src="device",
                                  dst="host") > 0  # evicted from the device, kept in host
        assert moves(kind="demotion", src="host", dst="disk") > 0  # and then from host, kept on disk
        assert server.metric("pdserve_prefix_cache_hit_tokens_total") > 0  # the later turns' prefixes
        series = {dict(labels)["outcome"] for (name, labels) in server.metrics()
                  if name == "pdserve_kv_prefetch_blocks_total"}
        assert series == {"issued", "used", "wasted"}
    finally:
        server.stop()
    reference = Server("--kv-host-gb", "0", "--num-kv-blocks", "512", "--mode", "colocated")
    try:
        client = openai.OpenAI(base_url=reference.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        assert [_complete(client, p)[0] for p in prompts[-1:]] == outputs
    finally:
        reference.stop()
