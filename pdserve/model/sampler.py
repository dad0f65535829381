"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seeded generator."""

from __future__ import annotations

import torch
import xxhash

from pdserve.core.sampling_params import SamplingParams


class Sampler:
    """Samples one token per row. A seeded request's draw for the token at sequence position `pos` comes from
    a generator seeded by (seed, pos) alone: its tokens do not depend on what else shares the batch, on which
    worker samples them (a prefill worker samples the first token, the decode worker the rest), or on a move
    to another worker mid-stream (its prompt + outputs so far recomputed there: the same positions)."""

    def __init__(self, seed: int | None = None) -> None:
        self._default = torch.Generator()
        if seed is not None:
            self._default.manual_seed(seed)
        self._seeded = torch.Generator()

    def release(self, request_id: str) -> None:
        """A request ended (nothing is kept per request)."""

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
               positions: list[int] | None = None) -> list[int]:
        """logits: [S, V] fp32 -> S token ids; `positions`: each row's token's position in its sequence
        (prompt + outputs), which keys a seeded request's draw."""
        greedy = logits.argmax(dim=-1).tolist()
        out = list(greedy)
        for row, p in enumerate(params):
            if not p.greedy:
                out[row] = self._sample_row(logits[row], p, self._generator(p, positions[row] if positions else 0))
        return out

    def _generator(self, p: SamplingParams, pos: int) -> torch.Generator:
        if p.seed is None:
            return self._default
        self._seeded.manual_seed(draw_seed(p.seed, pos))
        return self._seeded

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


def draw_seed(seed: int, pos: int) -> int:
    """The generator seed of a seeded request's draw at sequence position `pos` (a 64-bit mix of both)."""
    return xxhash.xxh64_intdigest(f"{seed}:{pos}".encode()) & ((1 << 63) - 1)
