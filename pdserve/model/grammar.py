"""Constrained decoding: the sampler's token masks for requests that carry a grammar (`SamplingParams.grammar`,
an llguidance grammar built by the gateway: `pdserve.server.structured`).

Each such request has an llguidance matcher here, created when the request first samples on this worker and
fed every output token it already has (a decode worker gets the first token from the prefill worker). A step
masks the logits of the grammar rows to the tokens the matcher allows, samples, and has each matcher consume
its token; the next token's mask is then computed at once in a background thread (llguidance drops the GIL),
so it is ready while the engine updates, schedules and runs the next forward: off the critical path.
A matcher in error (it could not take the outputs a request moved with, or a token: never while masks are
applied) allows only the end of the sequence, so the answer ends there, short of the grammar: such requests are
counted in `errors` (the worker's stats: `pdserve_fallbacks_total{kind="grammar_error"}`) and logged.

Why llguidance and not xgrammar: `benchmarks/bench_grammar.py` (docs/benchmarks.md, "Other measurements").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

log = logging.getLogger("pdserve.grammar")


class GrammarMasks:
    def __init__(self, tokenizer_json: str, eos_token_ids: tuple[int, ...],
                 outputs_of: Callable[[str], list[int]]) -> None:
        import llguidance
        import llguidance.numpy
        self._llg, self._np = llguidance, llguidance.numpy
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=list(eos_token_ids) or None)
        self.outputs_of = outputs_of  # a request's output token ids so far
        self.matchers: dict[str, object] = {}
        self.masks: dict[str, np.ndarray] = {}
        self.pending: dict[str, Future] = {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar")
        self._bits = torch.arange(32, dtype=torch.int32)
        self.errors = 0  # requests whose matcher went into error (each counted once)
        self._failed: set[str] = set()

    def apply(self, logits: torch.Tensor, request_ids: list[str], grammars: list[str | None]) -> None:
        """Mask, in place, every grammar row of `logits` [S, V] to the tokens its matcher allows next."""
        rows, masks = [], []
        for row, (rid, grammar) in enumerate(zip(request_ids, grammars)):
            if grammar is None:
                continue
            mask = self._mask(rid, grammar)
            if self.matchers[rid].is_error() and rid not in self._failed:  # (its mask: the end of sequence)
                self._failed.add(rid)
                self.errors += 1
                log.warning("request %s: its grammar cannot go on (%s); its answer ends here", rid,
                            self.matchers[rid].get_error())
            rows.append(row)
            masks.append(mask)
        if not rows:
            return
        # one unpack of all the rows' bitmasks: bit j of word w allows token 32 * w + j
        words = torch.from_numpy(np.concatenate(masks))  # [R, ceil(V / 32)] int32
        allowed = ((words.unsqueeze(-1) >> self._bits) & 1).flatten(1).bool()
        width = min(allowed.shape[1], logits.shape[1])
        index = torch.tensor(rows, device=logits.device)
        block = logits.index_select(0, index)
        block[:, :width].masked_fill_(~allowed[:, :width].to(logits.device), float("-inf"))
        block[:, width:] = float("-inf")
        logits.index_copy_(0, index, block)

    def advance(self, request_ids: list[str], grammars: list[str | None], tokens: list[int]) -> None:
        """Each grammar row's matcher takes its sampled token; its next mask starts computing now."""
        for rid, grammar, token in zip(request_ids, grammars, tokens):
            matcher = self.matchers.get(rid) if grammar is not None else None
            if matcher is None:
                continue
            if not matcher.consume_token(token):
                continue  # (in error now: the next apply counts it)
            self.pending[rid] = self.pool.submit(self._fill, matcher, self.masks[rid])

    def release(self, request_id: str) -> None:
        future = self.pending.pop(request_id, None)
        if future is not None:
            future.result()  # (the thread may be writing its mask)
        self.matchers.pop(request_id, None)
        self.masks.pop(request_id, None)
        self._failed.discard(request_id)

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def _mask(self, rid: str, grammar: str) -> np.ndarray:
        future = self.pending.pop(rid, None)
        if future is not None:
            future.result()
            return self.masks[rid]
        matcher = self.matchers.get(rid)
        if matcher is None:
            matcher = self._llg.LLMatcher(self.tokenizer, grammar)
            done = self.outputs_of(rid)
            if done:
                matcher.consume_tokens(list(done))  # (refused: the matcher is in error, counted in apply)
            self.matchers[rid] = matcher
            self.masks[rid] = self._np.allocate_token_bitmask(1, self.tokenizer.vocab_size)
        self._fill(matcher, self.masks[rid])
        return self.masks[rid]

    def _fill(self, matcher, mask: np.ndarray) -> None:
        self._np.fill_next_token_bitmask(matcher, mask, 0)
