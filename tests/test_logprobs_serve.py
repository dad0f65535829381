"""logprobs and echo through the OpenAI API (issue 16), with real processes and the `openai` SDK, PD and
colocated: the legacy completions shape as vLLM returns it (echo: the prompt's tokens first, the first one
`null`; `max_tokens: 0` scores the prompt alone), the chat shape, streamed chunks that add up to the whole
answer, the same numbers in both modes (in PD the first token's logprob travels with the KV) and as
`pdserve.LLM` computes them, and clear 400s for what is out of range."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pdserve import LLM, SamplingParams
from serve_util import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


# PD in `make test`: its path is the longer one (prompt logprobs and the first token's computed on the prefill worker
# and sent with the KV, the rest on the decode worker), through the same gateway formatting and the same engine
# code a colocated worker runs; colocated (one server more, every test again) only in `make test-all`
@pytest.fixture(scope="module", params=["pd", pytest.param("colocated", marks=pytest.mark.extended)])
def server(request):
    server = Server("--mode", request.param)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def engine_reference():
    """What `pdserve.LLM` says for the prompt (greedy, 3 alternatives), in this process."""
    llm = LLM(max_num_batched_tokens=2048)
    prompt = llm.engine.tokenizer.encode(PROMPT)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3,
                                                prompt_logprobs=3))[0]
    return prompt, out


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_echo_with_logprobs_is_vllms_legacy_shape_with_the_engines_numbers(server, engine_reference):
    prompt, ref = engine_reference
    r = _client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3,
                                           echo=True, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == len(prompt) + 4 == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    expected = [e[0] for e in ref.prompt_logprobs[1:]] + [e[0] for e in ref.logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-3)
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == logprob and 3 <= len(top) <= 4  # the 3 most likely, and the chosen one
        assert max(top.values()) >= logprob
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens == len(prompt)


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(server, engine_reference):
    prompt, ref = engine_reference
    r = _client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    choice = r.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(prompt) and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([e[0] for e in ref.prompt_logprobs[1:]], abs=1e-3)
    assert all(len(top) == 1 for top in choice.logprobs.top_logprobs[1:])  # logprobs 0: the chosen token only
    assert r.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as e:  # without echo, max_tokens must be positive
        _client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_streamed_chunks_add_up_to_the_whole_answer(server):
    c = _client(server)
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.8, seed=11, logprobs=2, echo=True)
    whole = c.completions.create(**kwargs).choices[0]
    tokens, logprobs, text = [], [], ""
    for chunk in c.completions.create(stream=True, **kwargs):
        text += chunk.choices[0].text
        if chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            logprobs += chunk.choices[0].logprobs.token_logprobs
    assert text == whole.text and tokens == whole.logprobs.tokens
    assert logprobs[0] is None and logprobs[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-3)


def test_chat_logprobs_and_top_logprobs(server, engine_reference):
    c = _client(server)
    messages = [{"role": "user", "content": "Name a colour."}]
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                  top_logprobs=4)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 4 and e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert e.top_logprobs[0].token == e.token  # greedy: the chosen one is the most likely
        assert e.bytes == list(e.token.encode())
    streamed = [ch.choices[0].logprobs.content[0] for ch in c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=4, stream=True)
        if ch.choices and ch.choices[0].logprobs is not None]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-3)
    plain = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
])
def test_out_of_range_logprobs_are_a_400_naming_the_field(server, path, body, param):
    r = httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = json.loads(r.text)["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
