"""OpenAI request bodies (pydantic) and their translation into prompts and `SamplingParams`.

Validation errors become `InvalidRequestError` with the offending field as `param`, so the HTTP layer
answers 400 in OpenAI's error format.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.core.sampling_params import MAX_LOGPROBS, SamplingParams
from pdserve.errors import InvalidRequestError


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are accepted and ignored, like vLLM

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


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None


class PrewarmRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    ttl_s: float


class WorkerRequest(BaseModel):
    """POST /v1/cluster/workers: place one more worker (--cluster ray)."""
    model_config = ConfigDict(extra="forbid")

    role: Literal["prefill", "decode", "colocated"]


def check_supported(req: _Common) -> None:
    if req.n != 1:
        raise InvalidRequestError("only n=1 is supported", param="n")
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


def sampling_params(req: _Common, max_tokens: int) -> SamplingParams:
    k = logprobs_asked(req)
    echo = isinstance(req, CompletionRequest) and req.echo
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, max_tokens=max_tokens,
        stop=req.stop or (), stop_token_ids=req.stop_token_ids or (), seed=req.seed, ignore_eos=req.ignore_eos,
        logprobs=k, prompt_logprobs=k if echo else None)


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
        out.append({"role": m.role, "content": content or ""})
    return out
