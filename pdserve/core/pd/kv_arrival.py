"""How a request's prompt KV reached the worker that decodes it, as that worker decided it: the record behind
`usage.kv_transfer` (every response) and `pdserve_kv_recomputed_tokens_total{reason}`.

A decode worker's books (`pdserve.core.pd.decode_books.DecodeBooks`) keep one `KvArrival` per request from its
reservation (or, colocated, its arrival) to its first token, which carries `usage()`:

* `delivered_tokens`: prompt tokens whose KV came from a prefill worker;
* `recomputed_tokens`: prompt tokens this worker computed because that KV did not come (or was refused), with
  `recompute_reason`: the transfer's failure (`failed_checksum`, `failed_incomplete`, `failed_peer`: its sender
  said it failed, `failed_timeout`: its lease lapsed and no other prefill worker took it) or the conductor's
  (`failed_send`: the prefill worker could not send it, e.g. this worker unreachable on its transport;
  `prefill_gone`: the prefill worker died and recomputing here was chosen; `no_prefill_worker`: none was
  alive when its blocks were reserved);
* `cached_tokens`: prompt tokens found in this worker's prefix cache (its device and host tiers);
* `checkpoint_tokens`: prompt tokens adopted from a dead worker's KV checkpoint (a moved request).

A prompt computed here by design (colocated, or every token but the last cached here) counts neither as
delivered nor recomputed. After a move the prompt is the moved request's context (its prompt and the tokens
streamed so far), as the worker that took it reports.
"""

from __future__ import annotations

from dataclasses import dataclass

DELIVERED, RECOMPUTED, LOCAL = "delivered", "recomputed", "local"


@dataclass
class KvArrival:
    how: str = LOCAL  # DELIVERED | RECOMPUTED | LOCAL (computed here by design)
    reason: str | None = None  # why it was recomputed
    checkpoint: int = 0  # prompt tokens adopted from a checkpoint

    def usage(self, prompt_tokens: int, cached: int) -> dict:
        """`usage.kv_transfer` for a prompt of `prompt_tokens` of which `cached` (checkpoint included) were hits
        here when it was first scheduled (or reserved)."""
        checkpoint = min(self.checkpoint, cached)
        rest = max(prompt_tokens - cached, 0)
        return {"delivered_tokens": rest if self.how == DELIVERED else 0,
                "recomputed_tokens": rest if self.how == RECOMPUTED else 0,
                "recompute_reason": self.reason if self.how == RECOMPUTED else None,
                "cached_tokens": cached - checkpoint, "checkpoint_tokens": checkpoint}


def merge(usages: list[dict]) -> dict:
    """Several sequences' or prompts' `usage.kv_transfer` as one (the first recompute reason)."""
    out = KvArrival().usage(0, 0)
    for u in usages:
        for key, value in u.items():
            if key == "recompute_reason":
                out[key] = out[key] or value
            else:
                out[key] += value
    return out
