"""OpenAI request bodies (pydantic) and their translation into prompts and `SamplingParams`.

Validation errors become `InvalidRequestError` with the offending field as `param`, so the HTTP layer
answers 400 in OpenAI's error format.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.core.sampling_params import MAX_LOGPROBS, SamplingDefaults, SamplingParams
from pdserve.errors import InvalidRequestError


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # extension (vLLM): usage so far in every chunk


# Fields of OpenAI's (and vLLM's) APIs pdserve knows but does not do yet, each with the values that ask for
# nothing (accepted); any other value is a 400 naming the field. Fields nobody knows are a 400 too.
NEUTRAL = {
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none", "auto"),
    "logit_bias": lambda v: not v,
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: not v,
    "repetition_penalty": lambda v: v in (None, 1, 1.0),
    "min_p": lambda v: v in (None, 0, 0.0),
    "min_tokens": lambda v: v in (None, 0),
    "use_beam_search": lambda v: not v,
    "length_penalty": lambda v: v in (None, 1, 1.0),
    "skip_special_tokens": lambda v: v in (None, True),
    "spaces_between_special_tokens": lambda v: v in (None, True),
    "include_stop_str_in_output": lambda v: not v,
    "add_generation_prompt": lambda v: v in (None, True),
    "continue_final_message": lambda v: not v,
    "add_special_tokens": lambda v: v is None,  # (or what the endpoint does anyway: `check_supported`)
    "chat_template": lambda v: v is None,
    "chat_template_kwargs": lambda v: not v,
    "prompt_logprobs": lambda v: v is None,
    "truncate_prompt_tokens": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "store": lambda v: not v,
    "metadata": lambda v: not v,
}
# OpenAI's end-user id (a span attribute under --otlp-endpoint: `enduser.id`); vLLM's structured output fields
# (`pdserve.server.structured` reads them)
MAX_N = 64  # sequences per prompt (n, best_of)
HONOURED_AS_IS = {"user", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"}


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # every other field is checked in `check_supported`: none ignored

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    seed: int | None = None
    ignore_eos: bool = False  # extension (vLLM): generate exactly max_tokens
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logprobs: bool | int | None = None
    priority: int = 0  # extension (vLLM): lower runs first under the priority queue policy
    service_tier: str | None = None  # OpenAI: auto | priority | default | flex (`pdserve.core.service_tiers`)
    kv_sensitivity: str | None = None  # extension (pdserve): public | internal | secret (`core.pd.sensitivity`)
    response_format: dict | None = None  # text | json_object | json_schema (`pdserve.server.structured`)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    best_of: int | None = None  # that many sequences per prompt; the n with the best cumulative logprob returned


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str = "{}"


class ToolCall(BaseModel):
    """An assistant message's earlier call, as OpenAI returned it."""
    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    name: str | None = None  # given to the chat template, which may use it
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls (`pdserve.server.tools`)
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None  # functions the model may call (`pdserve.server.tools`)
    tool_choice: str | dict | None = None  # none | auto | required | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool | None = None


class PrewarmRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    ttl_s: float


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a prompt or chat messages -> token ids."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # (prompt)
    add_generation_prompt: bool = True  # (messages)
    tools: list[dict] | None = None  # (messages) rendered as /v1/chat/completions renders them


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids -> text."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class WorkerRequest(BaseModel):
    """POST /v1/cluster/workers: place one more worker (--cluster ray)."""
    model_config = ConfigDict(extra="forbid")

    role: Literal["prefill", "decode", "colocated"]


def check_supported(req: _Common) -> None:
    """Every field the request sent is honoured, asks for nothing, or is refused here (400 naming it)."""
    for name, value in (req.model_extra or {}).items():
        if name in HONOURED_AS_IS:
            continue
        if name == "add_special_tokens" and value in (None, not isinstance(req, ChatRequest)):
            continue  # what this endpoint does anyway (completions add them, chat's template has them)
        if name not in NEUTRAL:
            raise InvalidRequestError(f"Unrecognized request argument supplied: {name}", param=name,
                                      code="unrecognized_argument")
        if not NEUTRAL[name](value):
            raise InvalidRequestError(f"{name} is not supported by this server (yet); the unsupported parameters "
                                      f"are listed in docs/reference/http-api.md", param=name,
                                      code="unsupported_parameter")
    if isinstance(req.n, bool) or not 1 <= req.n <= MAX_N:
        raise InvalidRequestError(f"n must be an integer in [1, {MAX_N}], got {req.n!r}", param="n")
    best_of = getattr(req, "best_of", None)
    if best_of is not None and (isinstance(best_of, bool) or not req.n <= best_of <= MAX_N):
        raise InvalidRequestError(f"best_of must be an integer in [n, {MAX_N}], got {best_of!r}", param="best_of")
    if best_of is not None and best_of > 1 and req.stream:
        raise InvalidRequestError("best_of cannot be streamed (the best sequences are known at the end)",
                                  param="best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise InvalidRequestError(f"{name} is not supported", param=name)
    logprobs_asked(req)


def logprobs_asked(req: _Common) -> int | None:
    """The alternatives per token a request asks for (None: no logprobs): completions' `logprobs: k`, chat's
    `logprobs: true` with `top_logprobs: k`; 400 for anything else."""
    bound = f"an integer in [0, {MAX_LOGPROBS}]"
    if isinstance(req, ChatRequest):
        if req.logprobs is not None and not isinstance(req.logprobs, bool):
            raise InvalidRequestError("logprobs must be a boolean for chat completions", param="logprobs")
        k = req.top_logprobs
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS):
            raise InvalidRequestError(f"top_logprobs must be {bound}, got {k!r}", param="top_logprobs")
        if k and not req.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        return (k or 0) if req.logprobs else None
    k = req.logprobs
    if k is None:
        return None
    if isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS:
        raise InvalidRequestError(f"logprobs must be {bound}, got {k!r}", param="logprobs")
    return k


def sampling_params(req: _Common, max_tokens: int, grammar: str | None = None,
                    defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
    """The request's sampling params: a sampling field it leaves unset (absent or null) takes the model's default
    (`defaults`, `--generation-config`), else OpenAI's (`SamplingParams`' own)."""
    k = logprobs_asked(req)
    echo = isinstance(req, CompletionRequest) and req.echo
    return SamplingParams(
        **defaults.fill(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k), max_tokens=max_tokens,
        stop=req.stop or (), stop_token_ids=req.stop_token_ids or (), seed=req.seed, ignore_eos=req.ignore_eos,
        logprobs=k, prompt_logprobs=k if echo else None, grammar=grammar)


def completion_prompts(prompt) -> list[str | list[int]]:
    """A completion `prompt` is a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def chat_messages(req: ChatRequest) -> list[dict]:
    """Messages as plain dicts for the chat template; multi-part content must be text parts."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise InvalidRequestError("only text content parts are supported", param=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        calls = [c.model_dump() for c in m.tool_calls] if m.tool_calls else None
        extra = {k: v for k, v in (("name", m.name), ("tool_calls", calls), ("tool_call_id", m.tool_call_id)) if v}
        out.append({"role": m.role, "content": content or "", **extra})
    return out
