"""Structured output and tool calls below the HTTP layer: the grammars a request asks for (`server.structured`,
`server.tools`), the sampler's masks (`model.grammar`) on the default model's real tokenizer, tool-call
parsing and streaming, and best_of's ranking (`server.families`)."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.errors import InvalidRequestError
from pdserve.model.grammar import GrammarMasks
from pdserve.server.choices import Collected
from pdserve.server.families import best
from pdserve.server.protocol import ChatRequest, CompletionRequest
from pdserve.server.structured import Grammars
from pdserve.server.tools import ToolStream, plan_tools, prompt_messages, split_calls
from pdserve.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    from pdserve.model.config import ModelConfig
    return Tokenizer.from_dir(default_model_dir, ModelConfig.from_dir(default_model_dir).eos_token_ids)


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer)


def _completion(**extra) -> CompletionRequest:
    return CompletionRequest(prompt="x", **extra)


def _decode_constrained(tokenizer, grammar: str, steps: int = 80, seed: int = 0) -> str:
    """Sample from random logits through the masks: whatever the 'model' prefers, the text obeys the grammar."""
    out: list[int] = []
    masks = GrammarMasks(tokenizer.to_json(), tokenizer.eos_token_ids, lambda rid: list(out))
    gen = torch.Generator().manual_seed(seed)
    try:
        for _ in range(steps):
            logits = torch.randn(1, tokenizer.vocab_size, generator=gen)
            masks.apply(logits, ["r"], [grammar])
            token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen))
            if token in tokenizer.eos_token_ids:
                break
            masks.advance(["r"], [grammar], [token])
            out.append(token)
        assert masks.errors == 0
    finally:
        masks.release("r")
        masks.close()
    return tokenizer.decode(out)


def test_no_constraint_asked_gives_no_grammar(grammars):
    assert grammars.for_request(_completion()) is None
    assert grammars.for_request(_completion(response_format={"type": "text"})) is None


@pytest.mark.parametrize("seed", range(3))
def test_json_schema_masks_give_valid_json_from_random_logits(tokenizer, grammars, seed):
    import jsonschema
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
    text = _decode_constrained(tokenizer, grammars.for_request(_completion(response_format=fmt)), 120, seed)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_choice_and_regex_masks(tokenizer, grammars):
    choices = ["red", "green", "dark blue"]
    for seed in range(3):
        assert _decode_constrained(tokenizer, grammars.for_request(_completion(guided_choice=choices)),
                                   seed=seed) in choices
    import re
    text = _decode_constrained(tokenizer, grammars.for_request(_completion(guided_regex=r"[0-9]{3}-[a-z]{2}")))
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)


def test_matcher_replays_tokens_produced_elsewhere(tokenizer, grammars):
    """A decode worker's matcher starts from the first token the prefill worker sampled."""
    grammar = grammars.for_request(_completion(guided_choice=["alpha", "beta"]))
    first = tokenizer.encode("al", add_special_tokens=False)
    masks = GrammarMasks(tokenizer.to_json(), tokenizer.eos_token_ids, lambda rid: first)
    logits = torch.zeros(1, tokenizer.vocab_size)
    masks.apply(logits, ["r"], [grammar])
    allowed = [t for t in range(tokenizer.vocab_size) if logits[0, t] > float("-inf")]
    assert allowed and all("alpha".startswith("al" + tokenizer.decode([t])) for t in allowed)
    masks.close()


@pytest.mark.parametrize("extra,param", [
    ({"guided_regex": "("}, "guided_regex"),
    ({"guided_json": {"type": "strin"}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"$ref": "#/nope"}}}},
     "response_format.json_schema.schema"),
])
def test_bad_constraints_are_400_naming_the_field(grammars, extra, param):
    with pytest.raises(InvalidRequestError) as info:
        grammars.for_request(_completion(**extra))
    assert info.value.param == param


def test_tool_plans(grammars):
    msgs = [{"role": "user", "content": "weather in Oslo?"}]
    assert plan_tools(ChatRequest(messages=msgs, tools=[WEATHER], tool_choice="none"), grammars) is None
    assert plan_tools(ChatRequest(messages=msgs, tools=[WEATHER]), grammars).mode == "auto"
    named = plan_tools(ChatRequest(messages=msgs, tools=[WEATHER],
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}}), grammars)
    message, reason = named.message('{"city": "Oslo"}', "stop")
    assert reason == "stop" and message["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                          "arguments": '{"city": "Oslo"}'}
    for bad in ({"tool_choice": "required"}, {"tools": [WEATHER], "tool_choice": "sometimes"},
                {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}):
        with pytest.raises(InvalidRequestError):
            plan_tools(ChatRequest(messages=msgs, **bad), grammars)


def test_required_tool_call_masks_give_a_call_in_the_schema(tokenizer, grammars):
    plan = plan_tools(ChatRequest(messages=[{"role": "user", "content": "x"}], tools=[WEATHER],
                                  tool_choice="required", parallel_tool_calls=False), grammars)
    text = _decode_constrained(tokenizer, plan.grammar, 80, seed=1)
    message, reason = plan.message(text, "stop")
    assert reason == "tool_calls" and len(message["tool_calls"]) == 1
    call = message["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and isinstance(json.loads(call["arguments"])["city"], str)


def test_split_calls_and_stream_reassembly(grammars):
    text = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    content, calls = split_calls(text)
    assert content == "Let me check." and [json.loads(c["function"]["arguments"])["city"] for c in calls] == [
        "Oslo", "Rome"]
    plan = plan_tools(ChatRequest(messages=[{"role": "user", "content": "x"}], tools=[WEATHER],
                                  tool_choice="required"), grammars)
    stream, got = ToolStream(plan), []
    for i in range(0, len(text) - len("Let me check. "), 5):  # (required mode: calls only)
        got += stream.feed(text[len("Let me check. "):][i:i + 5])
    assert [d["tool_calls"][0]["index"] for d in got] == [0, 1]
    assert stream.finish_reason("stop") == "tool_calls"
    auto = ToolStream(plan_tools(ChatRequest(messages=[{"role": "user", "content": "x"}], tools=[WEATHER]),
                                 grammars))
    assert auto.feed("Hel") == [{"content": "Hel"}] and auto.feed("lo") == [{"content": "lo"}]


def test_tools_go_to_the_system_prompt_when_the_template_lacks_them(grammars):
    plan = plan_tools(ChatRequest(messages=[{"role": "user", "content": "x"}], tools=[WEATHER]), grammars)
    history = [{"role": "user", "content": "x"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "content": "12 C", "tool_call_id": "c"}]
    messages, tools = prompt_messages(history, plan, template_takes_tools=False)
    assert tools is None and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    assert '<tool_call>{"name": "get_weather"' in messages[2]["content"] and "tool_calls" not in messages[2]
    assert "12 C" in messages[3]["content"]
    same, tools = prompt_messages(history, plan, template_takes_tools=True)
    assert same == history and tools[0]["function"]["name"] == "get_weather"


def test_best_of_ranks_by_cumulative_logprob():
    def seq(*lps):
        c = Collected()
        c.logprobs = [[lp, 1, []] for lp in lps]
        return c
    a, b, c = seq(-1.0, -1.0), seq(-0.1, -0.2), seq(-5.0)
    assert best([a, b, c], 2) == [b, a]


def test_a_request_moved_mid_stream_resumes_its_grammar(tiny_llama_dir, grammars, tokenizer):
    """A request that moves to another worker computes its earlier outputs as prompt there
    (`SamplingParams.grammar_replay`): the matcher takes them first and the answer continues where it was."""
    import re

    from pdserve import LLM, SamplingParams
    pattern = r"[a-z]{6}-[0-9]{6}"
    grammar = grammars.for_request(_completion(guided_regex=pattern))
    llm = LLM(str(tiny_llama_dir))
    prompt = tokenizer.encode("code:", add_special_tokens=False)
    whole = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, grammar=grammar))[0].token_ids
    assert re.fullmatch(pattern, tokenizer.decode(whole)) and len(whole) > 3
    k = len(whole) // 2  # moved after k outputs: the prompt there ends with them
    rest = llm.generate([prompt + list(whole[:k])], SamplingParams(
        temperature=0, max_tokens=40, grammar=grammar, grammar_replay=k))[0].token_ids
    assert list(whole[:k]) + list(rest) == list(whole)
    fresh = llm.generate([prompt + list(whole[:k])], SamplingParams(temperature=0, max_tokens=40,
                                                                      grammar=grammar))[0].token_ids
    assert re.fullmatch(pattern, tokenizer.decode(fresh))  # (without the replay it starts the pattern again)


def test_a_matcher_in_error_ends_the_answer_and_is_counted_once(tokenizer, grammars):
    """Outputs the grammar cannot take (here: replayed text outside the choice) leave only the end of sequence."""
    grammar = grammars.for_request(_completion(guided_choice=["alpha", "beta"]))
    wrong = tokenizer.encode("gamma", add_special_tokens=False)
    masks = GrammarMasks(tokenizer.to_json(), tokenizer.eos_token_ids, lambda rid: wrong)
    for _ in range(2):
        logits = torch.zeros(1, tokenizer.vocab_size)
        masks.apply(logits, ["r"], [grammar])
        allowed = {t for t in range(tokenizer.vocab_size) if logits[0, t] > float("-inf")}
        assert allowed and allowed <= set(tokenizer.eos_token_ids)
    assert masks.errors == 1
    masks.release("r")
    masks.close()


@pytest.mark.parametrize("nl", ["", "\n"])
def test_the_call_grammar_takes_a_call_with_or_without_hermes_newlines(tokenizer, grammars, nl):
    plan = plan_tools(ChatRequest(messages=[{"role": "user", "content": "x"}], tools=[WEATHER],
                                  tool_choice="required"), grammars)
    text = f'<tool_call>{nl}{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}{nl}</tool_call>{nl}'
    masks = GrammarMasks(tokenizer.to_json(), tokenizer.eos_token_ids,
                         lambda rid: tokenizer.encode(text, add_special_tokens=False))
    logits = torch.zeros(1, tokenizer.vocab_size)
    masks.apply(logits, ["r"], [plan.grammar])
    assert masks.errors == 0 and all(logits[0, t] == 0 for t in tokenizer.eos_token_ids)  # complete: may end
    masks.close()


def test_tools_errors_name_the_tool(grammars):
    msgs = [{"role": "user", "content": "x"}]
    bad = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nope"}}}
    for tools, choice, param in (
            ([WEATHER, WEATHER], "auto", "tools[1].function.name"),
            ([WEATHER, bad], {"type": "function", "function": {"name": "f"}}, "tools[1].function.parameters")):
        with pytest.raises(InvalidRequestError) as info:
            plan_tools(ChatRequest(messages=msgs, tools=tools, tool_choice=choice), grammars)
        assert info.value.param == param
