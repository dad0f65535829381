"""The OpenAI API as vLLM users know it, end to end (PD mode, the `openai` SDK): n > 1 and best_of with the
prompt computed once, structured output that always parses and validates, tool calls (whole and streamed)."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from serve_util import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 16  # the default --block-size
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24}}, "required": ["name", "age", "city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 30},
                                                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}}
TOPICS = ["a pilot", "a baker", "a poet", "a chess player", "a doctor", "a child", "a farmer", "a painter",
          "a sailor", "a judge", "a teacher", "a runner", "a singer", "a nurse", "a miner", "a tailor",
          "a cook", "a guard", "a monk", "a clerk"]


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=300)


def _computed(server) -> float:
    return server.metric("pdserve_prompt_tokens_computed_total")


def test_n_samples_differ_repeat_with_the_seed_and_share_one_prefill(server):
    prompt = "In the old harbour town the fishermen told stories about the lighthouse keeper who " * 3
    c = client(server)
    before = _computed(server)
    first = c.completions.create(model=MODEL, prompt=prompt, n=3, seed=11, temperature=1.0, max_tokens=12)
    texts = [ch.text for ch in sorted(first.choices, key=lambda ch: ch.index)]
    assert [ch.index for ch in first.choices] == [0, 1, 2] and len(set(texts)) == 3
    n_prompt = first.usage.prompt_tokens
    assert 3 <= first.usage.completion_tokens <= 36
    # the prompt ran through the model once; each other sequence computed only what no full block covers
    tail = n_prompt % BLOCK or BLOCK
    computed = server.wait_metric("pdserve_prompt_tokens_computed_total", lambda v: v - before >= n_prompt + 2 * tail)
    assert computed - before == n_prompt + 2 * tail, (computed - before, n_prompt)
    again = c.completions.create(model=MODEL, prompt=prompt, n=3, seed=11, temperature=1.0, max_tokens=12)
    assert [ch.text for ch in sorted(again.choices, key=lambda ch: ch.index)] == texts


def test_best_of_returns_the_best_n_and_counts_every_token(server):
    body = dict(model=MODEL, prompt="My favourite animal is", temperature=1.0, max_tokens=6, seed=5,
                extra_body={"ignore_eos": True})
    resp = client(server).completions.create(n=2, best_of=4, **body)
    assert len(resp.choices) == 2 and resp.usage.completion_tokens == 4 * 6
    assert all(ch.logprobs is None for ch in resp.choices)
    # sequence i samples with seed + i, so n=4 with the same seed shows all four best_of ran: the two returned
    # are the two with the highest cumulative logprob, best first
    scored = client(server).completions.create(n=2, best_of=4, logprobs=0, **body)
    every = client(server).completions.create(n=4, logprobs=0, **body)
    total = {ch.text: sum(ch.logprobs.token_logprobs) for ch in every.choices}
    assert len(total) == 4, total  # (four different samples: the ranking means something)
    ranked = sorted(total, key=total.get, reverse=True)
    assert [ch.text for ch in scored.choices] == [ch.text for ch in resp.choices] == ranked[:2], total
    for ch in scored.choices:
        assert sum(ch.logprobs.token_logprobs) == pytest.approx(total[ch.text], abs=1e-4)
    with pytest.raises(openai.BadRequestError):
        client(server).completions.create(model=MODEL, prompt="x", n=3, best_of=2, max_tokens=2)


def test_streamed_n_choices_each_end(server):
    stream = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                    n=2, max_tokens=8, stream=True, seed=3, temperature=1.0,
                                                    stream_options={"include_usage": True})
    texts, ended, usage, roles = {}, set(), None, {}
    for chunk in stream:
        for ch in chunk.choices:
            if ch.delta.role:  # once per choice, its first chunk (sent with its first token, as vLLM does)
                assert ch.index not in texts and ch.delta.role == "assistant" and ch.index not in roles
                roles[ch.index] = True
            assert ch.index in roles
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                ended.add(ch.index)
        usage = chunk.usage or usage
    assert ended == {0, 1} and all(texts.values()) and usage.completion_tokens <= 16


@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
def test_json_output_parses_and_validates_for_20_prompts(server, kind):
    fmt = {"type": "json_object"} if kind == "json_object" else {
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    c = client(server)

    async def one(topic):
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=300)
        r = await ac.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f'Describe {topic} as a JSON object with the keys '
                                                               '"name", "age" and "city".'}],
            response_format=fmt, max_tokens=150, temperature=0.3, seed=1)
        return r.choices[0]

    async def main():
        return await asyncio.gather(*(one(t) for t in TOPICS))

    for choice in asyncio.run(main()):
        assert choice.finish_reason == "stop", choice.message.content
        value = json.loads(choice.message.content)
        assert isinstance(value, dict)
        if kind == "json_schema":
            jsonschema.validate(value, PERSON)
    assert c.models.list().data  # (the server is fine afterwards)


def test_guided_choice_and_regex(server):
    c = client(server)
    r = c.completions.create(model=MODEL, prompt="Is the sky green? Answer:", max_tokens=8, temperature=1.0,
                             extra_body={"guided_choice": ["yes", "no", "not sure"]})
    assert r.choices[0].text in ("yes", "no", "not sure")
    r = c.completions.create(model=MODEL, prompt="A phone number:", max_tokens=12,
                             extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text)


def test_forced_tool_call_parses_into_the_declared_schema(server):
    c = client(server)
    messages = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    named = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, ADD], max_tokens=60,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    required = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, ADD], max_tokens=80,
                                         tool_choice="required", parallel_tool_calls=False)
    assert required.choices[0].finish_reason == "tool_calls"
    (call,) = required.choices[0].message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_streamed_tool_call_deltas_reassemble(server):
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    calls, reasons = {}, []
    for tool_choice in ({"type": "function", "function": {"name": "add"}}, "required"):
        stream = client(server).chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, ADD],
                                                        tool_choice=tool_choice, max_tokens=60, stream=True,
                                                        parallel_tool_calls=False)
        got = {}
        for chunk in stream:
            for ch in chunk.choices:
                for tc in ch.delta.tool_calls or []:
                    entry = got.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                    entry["id"] = entry["id"] or tc.id
                    entry["name"] += (tc.function.name or "") if tc.function else ""
                    entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
                if ch.finish_reason:
                    reasons.append(ch.finish_reason)
        calls[str(tool_choice)] = got
    named = calls[str({"type": "function", "function": {"name": "add"}})][0]
    assert named["name"] == "add" and named["id"]
    jsonschema.validate(json.loads(named["arguments"]), ADD["function"]["parameters"])
    (required,) = calls["required"].values()
    assert required["name"] in ("add", "get_weather") and json.loads(required["arguments"])
    assert reasons == ["stop", "tool_calls"]


def test_a_tool_conversation_round_trips(server):
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees, rain"}]
    c = client(server)
    # after the tool's result, a call forced by name is that function's, its arguments its schema's
    forced = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, ADD], max_tokens=60,
                                       tool_choice={"type": "function", "function": {"name": "add"}})
    (call,) = forced.choices[0].message.tool_calls
    assert call.function.name == "add" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])
    # and `none` forces an answer in words
    words = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=16,
                                      tool_choice="none")
    assert not words.choices[0].message.tool_calls and words.choices[0].message.content
    assert words.usage.completion_tokens >= 1 and words.choices[0].finish_reason in ("stop", "length")
    assert server.metric("pdserve_fallbacks_total", kind="tools_in_system_prompt") >= 1
