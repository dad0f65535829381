"""A response's choices: the text, finish reason and logprobs of one prompt's answer, in the completions or
the chat shape, whole (`Shape.choice`) or streamed chunk by chunk (`Shape.stream`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.server.logprobs_format import CompletionLogprobs, chat_entry
from pdserve.server.tools import ToolPlan
from pdserve.tokenizer import Tokenizer


@dataclass
class Collected:
    """One prompt's answer, gathered from its deltas (`pdserve.server.gateway.Delta`)."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    reason: str | None = None
    cached: int = 0
    kv: dict | None = None  # how its prompt KV reached its decode worker (`usage.kv_transfer`)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None

    def add(self, d) -> None:
        self.text.append(d.text)
        self.num_tokens, self.reason = d.num_tokens, d.finish_reason
        self.token_ids.append(d.token_id)
        self.logprobs.append(d.logprob)


@dataclass
class Shape:
    """What a request asked its choices to hold: `logprobs` alternatives per token (None: no logprobs), the
    prompt echoed (completions' `echo`; `echo_only`: `max_tokens: 0`, the prompt and nothing generated)."""

    chat: bool
    tokenizer: Tokenizer
    logprobs: int | None = None
    echo: bool = False
    echo_only: bool = False
    prompt_texts: list[str] = field(default_factory=list)
    tools: ToolPlan | None = None  # chat with tools offered: the answer may be tool calls

    def choice(self, index: int, got: Collected, prompt: list[int], prompt_index: int = 0) -> dict:
        text = "".join(got.text)
        out = {"index": index, "finish_reason": got.reason, "logprobs": None}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
            if self.tools is not None:
                out["message"], out["finish_reason"] = self.tools.message(text, got.reason)
            if self.logprobs is not None:
                out["logprobs"] = {"content": [chat_entry(self.tokenizer, t, e, self.logprobs)
                                               for t, e in zip(got.token_ids, got.logprobs) if e is not None]}
            return out
        lead = self.prompt_texts[prompt_index] if self.echo else ""
        out["text"] = lead + text
        if self.logprobs is not None:
            built = CompletionLogprobs(self.tokenizer)
            if self.echo:
                built.add_prompt(prompt, got.prompt_logprobs)
                built.offset = len(lead)
            for t, e in zip(got.token_ids, got.logprobs):
                built.add(t, e)
            out["logprobs"] = built.body()
        return out

    def stream(self) -> StreamLogprobs:
        return StreamLogprobs(self)


class StreamLogprobs:
    """A streamed choice's logprobs, chunk by chunk (None where none were asked for)."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.built = CompletionLogprobs(shape.tokenizer)

    def prompt(self, prompt: list[int], entries: list | None) -> dict | None:
        if self.shape.logprobs is None:
            self.built.offset = len(self.shape.prompt_texts[0])
            return None
        self.built.add_prompt(prompt, entries)
        self.built.offset = len(self.shape.prompt_texts[0])
        return self.built.take()

    def token(self, d) -> dict | None:
        k = self.shape.logprobs
        if k is None or d.logprob is None:
            return None
        if self.shape.chat:
            return {"content": [chat_entry(self.shape.tokenizer, d.token_id, d.logprob, k)]}
        self.built.add(d.token_id, d.logprob)
        return self.built.take()
