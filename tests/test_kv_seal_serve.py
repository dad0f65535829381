"""KV sensitivity and protection in transit, end to end (issue 40 items 1-2): `pdserve serve --transport tcp`
with real worker processes, the official `openai` SDK as the client. Across hosts is forced on loopback
(`PDSERVE_KV_CROSS_HOST=always`, test-only), and the prefill worker flips a byte of every third chunk after
sealing it, on its way to the socket (`PDSERVE_FAULT_CORRUPT_CHUNKS=3`): the decode worker refuses those
records (counted), their transfers fail and the prompts are recomputed (counted), and every answer equals the
single engine's. Labels come from the deployment (`--kv-sensitivity`), the API key (`--api-keys-file`) and the
request (`kv_sensitivity`); each shows in the bytes counted per mode."""

from __future__ import annotations

import openai
import pytest

from serve_util import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The capital of Japan is"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference():
    from pdserve import LLM, SamplingParams
    llm = LLM(num_threads=2)
    texts = [o.text for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))]
    del llm
    return texts


def _client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_labels_choose_the_protection_and_tampered_kv_is_refused_and_recomputed(reference, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("team-a\nteam-b public flex\n")
    server = Server("--transport", "tcp", "--api-keys-file", str(keys), "--kv-sensitivity", "internal",
                    env={"PDSERVE_KV_CROSS_HOST": "always", "PDSERVE_FAULT_CORRUPT_CHUNKS": "3"})
    try:
        a, b = _client(server, "team-a"), _client(server, "team-b")
        for i, prompt in enumerate(PROMPTS[:2]):  # the deployment's label: internal, across hosts -> aead
            out = a.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert out.choices[0].text == reference[i]
        aead = server.wait_metric("pdserve_kv_protected_bytes_total", lambda v: v > 0, path="tcp", mode="aead")
        assert aead > 0 and server.metric("pdserve_kv_protected_bytes_total", mode="mac") == 0
        # every third record was tampered with: the encrypted chunks among them refused, counted, their
        # prompts recomputed (a chunk refused fails its transfer as a bad checksum does); no answer differs
        assert server.wait_metric("pdserve_kv_auth_failures_total", lambda v: v >= 1, path="tcp") >= 1
        assert server.wait_metric("pdserve_kv_transfer_failures_total", lambda v: v >= 1,
                                  reason="failed_checksum", outcome="recompute") >= 1
        out = b.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0)
        assert out.choices[0].text == reference[2]  # team-b's key: public -> mac
        assert server.wait_metric("pdserve_kv_protected_bytes_total", lambda v: v > 0, path="tcp", mode="mac") > 0
        before = server.metric("pdserve_kv_protected_bytes_total", mode="aead")
        out = b.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0,
                                   extra_body={"kv_sensitivity": "secret"})  # the request's own label wins
        assert out.choices[0].text == reference[3]
        assert server.wait_metric("pdserve_kv_protected_bytes_total", lambda v: v > before, mode="aead") > before
        assert server.metric("pdserve_kv_protected_bytes_total", mode="plain") == 0
        for extra, param in (({"kv_sensitivity": "top-secret"}, "kv_sensitivity"),
                             ({"kv_sensitivity": 3}, "kv_sensitivity"), ({"kv_label": "secret"}, "kv_label")):
            with pytest.raises(openai.BadRequestError) as info:
                a.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=extra)
            error = info.value.body if "message" in info.value.body else info.value.body["error"]
            assert error["param"] == param, error
    finally:
        server.stop()
