"""A request whose decode (or colocated) worker died goes on elsewhere, with nothing lost or changed.

The conductor core keeps every token each request has streamed (`FlightState.outputs`). When its decode
worker dies, the request moves: it is routed again (no admission: it was admitted once, and a refusal now
would lose it) and placed on a live worker as if it had just arrived with the prompt + the outputs so far as
its prompt and what is left of `max_tokens` (`FlightState.offset` marks the split; `resumed_prompt`). In PD
mode a prefill worker recomputes that whole context and sends its KV; the token it samples is the next one of
the stream, at the same sequence position, so a greedy request's text is the one an undisturbed run gives
and a seeded one keeps its seed's stream (`pdserve.model.sampler`: draws keyed by seed and position). The
tokens the new worker streams are numbered from `offset` on (the gateway's driver adds it), so the client's
stream goes on with no duplicate or missing token. Counted: `requests_migrated{reason, source}` (`source`:
`recompute`; restoring from a KV checkpoint in the host/disk tier is not built yet). With no live worker to
take it, or when the driver cannot tell which tokens were streamed (a simulator reports only some), the
request ends with an explicit 503.

A mixin of `ConductorCore`: it uses `block_size`, `mode`, `_route`, `_place`, `_finish` and `_fail`.
"""

from __future__ import annotations

import dataclasses

from pdserve.cluster.actions import Count, Fail, Send
from pdserve.cluster.routing import AFFINITY_BLOCKS
from pdserve.core.block_hash import hash_blocks


class MigrationEvents:
    def _migrate(self, f, reason: str) -> list:
        dead, prefill = f.decode, f.prefill
        if len(f.outputs) < f.num_tokens:
            return self._fail(f, 503, f"worker {dead} died while serving this request", "worker_died")
        actions = [Send(prefill, {"type": "abort", "rid": f.rid})] if prefill not in (None, dead) else []
        self._finish(f)
        moved = dataclasses.replace(
            f, decode=None, prefill=None, xfer="", queued_tokens=0, dispatched=False, prefilled_s=None,
            prediction=None, kv_addr=None, first_block=0, waiting_room=False, staged="", offset=len(f.outputs),
            started=False, outputs=list(f.outputs))
        prompt = moved.resumed_prompt
        hashes = hash_blocks(prompt[:AFFINITY_BLOCKS * self.block_size], self.block_size)
        first, second = self._route(hashes)
        if first is None or (self.mode == "pd" and second is None):
            return actions + [Fail(f.rid, 503, f"worker {dead} died while serving this request and no live "
                                   "worker is left to move it to", "worker_died")]
        actions.append(Count("requests_migrated", (("reason", reason), ("source", "recompute"))))
        return actions + self._place(moved, first, second, hashes)
