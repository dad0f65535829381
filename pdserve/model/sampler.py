"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seeded generator."""

from __future__ import annotations

import torch

from pdserve.core.sampling_params import SamplingParams


class Sampler:
    """Samples one token per row. Seeded requests get their own generator, so their tokens do not depend on
    what else shares the batch; the executor calls `release` when a request ends."""

    def __init__(self, seed: int | None = None) -> None:
        self._default = torch.Generator()
        if seed is not None:
            self._default.manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        """logits: [S, V] fp32 -> S token ids."""
        greedy = logits.argmax(dim=-1).tolist()
        out = list(greedy)
        for row, p in enumerate(params):
            if not p.greedy:
                out[row] = self._sample_row(logits[row], p, self._generator(request_ids[row], p))
        return out

    def _generator(self, request_id: str, p: SamplingParams) -> torch.Generator:
        if p.seed is None:
            return self._default
        gen = self._per_request.get(request_id)
        if gen is None:
            gen = self._per_request[request_id] = torch.Generator()
            gen.manual_seed(p.seed)
        return gen

    @staticmethod
    def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
        logits = logits.cpu() / p.temperature
        if p.top_k > 0 and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest set whose mass reaches top_p (the first token is always kept)
            drop = sorted_probs.cumsum(0) - sorted_probs > p.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=gen).item())
