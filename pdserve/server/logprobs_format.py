"""Logprobs in OpenAI's two response shapes, from the engine's entries (`pdserve.model.logprobs`:
`[logprob, rank, [[token_id, logprob], ...]]`).

* `/v1/completions` (the legacy shape, as vLLM returns it): `{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}`, one element per token; `top_logprobs` maps token strings to logprobs: the `k` most likely
  and the chosen token (vLLM's rule, so `logprobs: 0` still gives the chosen one). With `echo` the prompt's
  tokens come first; the first prompt token has no logprob (`null`, and `null` alternatives). `text_offset`:
  each token's character offset in the text the choice returns.
* `/v1/chat/completions`: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]}` with the `top_logprobs` most likely alternatives.
"""

from __future__ import annotations

from pdserve.tokenizer import Tokenizer


class CompletionLogprobs:
    """Builds the legacy shape token by token (streamed chunks take what was added since the last one)."""

    def __init__(self, tokenizer: Tokenizer, offset: int = 0) -> None:
        self.tokenizer = tokenizer
        self.offset = offset  # characters of the choice's text before the next token
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict | None] = []
        self.text_offset: list[int] = []
        self._taken = 0

    def add(self, token_id: int, entry: list | None) -> None:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        self.tokens.append(text)
        self.text_offset.append(self.offset)
        self.offset += len(text)
        if entry is None:
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
            return
        logprob, _, top = entry
        self.token_logprobs.append(logprob)
        alternatives = {self.tokenizer.decode([t], skip_special_tokens=False): lp for t, lp in top}
        alternatives.setdefault(text, logprob)
        self.top_logprobs.append(alternatives)

    def add_prompt(self, prompt: list[int], entries: list | None) -> None:
        for i, token_id in enumerate(prompt):
            self.add(token_id, entries[i] if entries is not None and i < len(entries) else None)

    def body(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}

    def take(self) -> dict:
        """What was added since the last `take` (a streamed chunk's logprobs)."""
        start, self._taken = self._taken, len(self.tokens)
        return {key: values[start:] for key, values in self.body().items()}


def chat_entry(tokenizer: Tokenizer, token_id: int, entry: list, k: int) -> dict:
    def one(t: int, lp: float) -> dict:
        text = tokenizer.decode([t], skip_special_tokens=False)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    logprob, _, top = entry
    return {**one(token_id, logprob), "top_logprobs": [one(t, lp) for t, lp in top[:k]]}
