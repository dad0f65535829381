"""Incremental detokenization with stop strings, correct for multi-byte UTF-8. No torch.

Tokens are decoded in a sliding window starting one step back (as vLLM does) so byte-level BPE pieces merge correctly, and
text ending in U+FFFD (an incomplete UTF-8 sequence) is held back until the next token completes it. For
streaming, the last `max(len(stop)) - 1` characters are also held back: they might be the start of a stop
string that the next token completes, and a stop string must never reach the client.
"""

from __future__ import annotations

from pdserve.tokenizer import Tokenizer

class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), include_stop_str: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._stop = stop
        self._include_stop = include_stop_str
        self._skip_special = skip_special_tokens
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""  # everything decoded so far (truncated at a stop string once one is found)
        self._emitted = 0  # characters of `text` already handed out by `take_new_text`
        self.stopped_on: str | None = None

    def push(self, token_ids: list[int]) -> bool:
        """Add tokens; return True when a stop string was found (text is then final and truncated)."""
        for token_id in token_ids:
            self._ids.append(token_id)
            piece = self._decode_step()
            if piece and self._append(piece):
                return True
        return False

    def take_new_text(self, final: bool) -> str:
        """Text not yet handed out; while not final, keep back what could still become a stop string."""
        end = len(self.text) if final or self.stopped_on else max(len(self.text) - self._holdback, self._emitted)
        new, self._emitted = self.text[self._emitted:end], end
        return new

    @property
    def emitted_text(self) -> str:
        """The text handed out so far by `take_new_text`."""
        return self.text[:self._emitted]

    def _decode_step(self) -> str:
        # Decode from one step back so the new token's text is seen in context, then slide the window.
        prefix = self._tok.decode(self._ids[self._prefix_offset:self._read_offset], self._skip_special)
        full = self._tok.decode(self._ids[self._prefix_offset:], self._skip_special)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # incomplete UTF-8 sequence (or nothing visible yet): wait for more tokens
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix):]

    def _append(self, piece: str) -> bool:
        start = max(len(self.text) - self._holdback, 0)
        self.text += piece
        hits = [(self.text.find(s, start), s) for s in self._stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        i, stop = min(hits)
        self.text = self.text[:i + len(stop)] if self._include_stop else self.text[:i]
        self.stopped_on = stop
        return True
