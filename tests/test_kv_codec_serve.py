"""KV codecs in a real `pdserve serve` (issue 16), through the openai SDK: a decode worker keeping int8 under a
prefill worker computing in auto transcodes what it receives (counted), holds ~3.8x the blocks in the same
--kv-cache-gb, and answers as the auto model does; int8 on both roles moves fewer bytes per request and
answers exactly as `pdserve.LLM(kv_cache_dtype="int8")`; bad dtypes are one-line errors."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from pdserve import LLM, SamplingParams
from serve_util import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Write a short poem about the sea:", "def fibonacci(n):"]
TOKENS = 24


def complete(server: Server, prompt: str) -> list[str]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    return r.choices[0].logprobs.tokens


def reference(kv_cache_dtype: str, margins: bool = False):
    """The in-process engine's greedy tokens for PROMPTS (and, with `margins`, each step's top-2 logprob gap)."""
    llm = LLM(kv_cache_dtype=kv_cache_dtype, kv_host_gb=0)
    tok = llm.engine.tokenizer
    sp = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=2)
    outs = [llm.generate([p], sp)[0] for p in PROMPTS]
    tokens = [[tok.decode([t]) for t in o.token_ids] for o in outs]
    if not margins:
        return tokens
    return tokens, [[e[2][0][1] - e[2][1][1] for e in o.logprobs] for o in outs]


def test_decode_worker_transcodes_into_its_own_codec():
    server = Server("--mode", "pd", "--decode-kv-cache-dtype", "int8", "--kv-cache-gb", "0.5")
    try:
        got = [complete(server, p) for p in PROMPTS]
        blocks = {w: server.metric("pdserve_kv_blocks_total", worker=w) for w in ("prefill-0", "decode-0")}
        transcoded = server.metric("pdserve_kv_chunks_transcoded_total", worker="decode-0")
    finally:
        server.stop()
    assert transcoded > 0
    assert blocks["decode-0"] / blocks["prefill-0"] == pytest.approx(256 / 68, rel=0.01)
    # int8 KV changes the logits a little: the greedy tokens are auto's up to the first near-tie at most
    ref, margins = reference("auto", margins=True)
    for g, r, gaps in zip(got, ref, margins):
        first = next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), None)
        assert first is None or gaps[first] < 0.1, (first, g, r, gaps)


def test_kv_re_encoded_for_the_wire_is_decoded_into_the_pool():
    """--kv-wire-dtype int8 under auto pools: the prefill worker ships every transfer as int8 (its bytes counted
    by tier and format), the decode worker decodes it into its float32 pool, and the answers are auto's up to
    the first near-tie."""
    server = Server("--mode", "pd", "--kv-wire-dtype", "int8")
    try:
        got = [complete(server, p) for p in PROMPTS]
        transcoded = server.wait_metric("pdserve_kv_chunks_transcoded_total", lambda v: v > 0, worker="decode-0")
        wire_int8 = server.wait_metric("pdserve_kv_wire_bytes_total", lambda v: v > 0, service_tier="default",
                                       format="int8")
        wire_pool = server.metric("pdserve_kv_wire_bytes_total", service_tier="default", format="float32")
        received = server.wait_metric("pdserve_kv_transfer_bytes_total", lambda v: v >= wire_int8)
    finally:
        server.stop()
    assert transcoded > 0 and wire_int8 > 0 and not wire_pool
    assert received == pytest.approx(wire_int8)  # what went is what the decode worker took: int8 records
    ref, margins = reference("auto", margins=True)
    for g, r, gaps in zip(got, ref, margins):
        first = next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), None)
        assert first is None or gaps[first] < 0.1, (first, g, r, gaps)


@pytest.mark.extended  # (two servers, ~30 s: `make test-all`; int8 decode is served in the transcoding test above)
def test_int8_on_both_roles_is_the_int8_engine_with_fewer_bytes():
    bytes_per_request = {}
    answers = {}
    for dtype in ("auto", "int8"):
        server = Server("--mode", "pd", "--kv-cache-dtype", dtype, "--kv-cache-gb", "0.5")
        try:
            answers[dtype] = [complete(server, p) for p in PROMPTS]
            bytes_per_request[dtype] = server.metric("pdserve_kv_transfer_bytes_total") / len(PROMPTS)
            assert server.metric("pdserve_kv_chunks_transcoded_total") == 0
        finally:
            server.stop()
    assert answers["int8"] == reference("int8")
    assert bytes_per_request["int8"] / bytes_per_request["auto"] == pytest.approx(68 / 256, rel=0.05)


@pytest.mark.parametrize("flag", ["--kv-cache-dtype", "--decode-kv-cache-dtype", "--prefill-kv-cache-dtype",
                                  "--kv-wire-dtype"])
def test_unknown_dtype_is_a_one_line_error(flag):
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", flag, "fp4"], capture_output=True,
                          text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "fp4" in lines[0] and "int8" in lines[0] and "int4" in lines[0]
