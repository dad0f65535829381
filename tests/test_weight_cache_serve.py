"""A served worker that finds its prepared-weights cache file damaged rebuilds it and says so in
`pdserve_fallbacks_total{kind="weights_cache_rebuilt"}`; its answers (a Hugging Face model of its own in q8_0: the
served workers quantize that model, not the embedded GGUF's blocks) are the in-process model's, with the cache
and without."""

from __future__ import annotations

import pytest
from openai import OpenAI
from serve_util import Server

from pdserve import LLM, SamplingParams
from pdserve.model import kernels

pytestmark = pytest.mark.skipif(not kernels.available() or kernels.qgemm_isa() == "none",
                                reason="the cache holds the compiled kernels' layouts: none on this host")

LIGHT = ("--mode", "colocated", "--kv-cache-gb", "0.25", "--kv-host-gb", "0", "--num-threads", "1",
         "--weights", "q8_0", "--served-model-name", "tiny")


PROMPT = "The capital of France is"


def complete(server: Server) -> str:
    client = OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.0)
    return out.choices[0].text


def test_a_damaged_cache_file_is_rebuilt_and_counted(tmp_path, default_model_dir):
    from conftest import make_tiny_model
    model = str(make_tiny_model(tmp_path / "model", default_model_dir))
    cache = tmp_path / "cache"
    llm = LLM(model, weights="q8_0", weights_cache=str(cache), num_threads=1, num_kv_blocks=16)  # prepares the file
    [expected] = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8))
    [path] = cache.glob("*.safetensors")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x5A
    path.write_bytes(raw)
    server = Server(*LIGHT, "--model", model, "--weights-cache", str(cache))
    try:
        assert server.wait_metric("pdserve_fallbacks_total", lambda v: v >= 1, kind="weights_cache_rebuilt") == 1
        assert complete(server) == expected.text  # the served worker quantized this model's weights (the same file)
    finally:
        server.stop()
    off = Server(*LIGHT, "--model", model, "--weights-cache", "off")
    try:
        assert complete(off) == expected.text
        assert off.metric("pdserve_fallbacks_total", kind="weights_cache_rebuilt") == 0
    finally:
        off.stop()
