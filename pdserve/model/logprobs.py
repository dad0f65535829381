"""Logprobs of chosen tokens, from the same fp32 logits the sampler sees (before temperature, top-k or top-p:
the model's distribution, as OpenAI and vLLM report it).

An entry, per token: `[logprob, rank, [[token_id, logprob], ...]]` — the chosen token's log-probability, its
rank in the distribution (1: the most likely) and the `k` most likely tokens, most likely first. Plain lists,
so they travel in msgpack and JSON as they are.
"""

from __future__ import annotations

import torch

ROWS = 256  # prompt rows turned into logits at once (a row is vocab-size floats)


def entries(logits: torch.Tensor, chosen: list[int], k: int) -> list[list]:
    """logits [S, V] -> one entry per row, for `chosen[row]` with `k` alternatives."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(chosen, dtype=torch.long, device=lp.device).unsqueeze(1)
    picked = lp.gather(1, ids)
    ranks = (lp > picked).sum(dim=1) + 1
    picked, ranks = picked.squeeze(1).tolist(), ranks.tolist()
    if k:
        top_lp, top_ids = lp.topk(k, dim=-1)
        tops = [[[t, v] for t, v in zip(ti, tv)] for ti, tv in zip(top_ids.tolist(), top_lp.tolist())]
    else:
        tops = [[] for _ in chosen]
    return [[p, r, t] for p, r, t in zip(picked, ranks, tops)]


def prompt_entries(logits_of, first_row: int, targets: tuple[int, ...], k: int) -> list[list]:
    """The entries of the prompt tokens `targets`, predicted by the rows from `first_row` on;
    `logits_of(rows)` computes the logits of some hidden-state rows (in slices of `ROWS`)."""
    out: list[list] = []
    for start in range(0, len(targets), ROWS):
        part = targets[start:start + ROWS]
        rows = torch.arange(first_row + start, first_row + start + len(part))
        out += entries(logits_of(rows), list(part), k)
    return out
