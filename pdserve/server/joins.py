"""Which workers may join a running deployment (`pdserve serve --control-port`, `pdserve worker --join`).

A joining worker has already proven it belongs to the deployment (its events reach the gateway only through
a CurveZMQ handshake keyed by the deployment secret, `pdserve.transfer.zmq_auth`). What is checked here is
that it can serve alongside the others: a role the deployment's mode uses, the same model (config and
tokenizer, `model_fingerprint`), the same KV block size (block hashes and transfers are counted in blocks).
Its KV codec may differ (a decode worker transcodes what it receives). A refused worker is told why and exits.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = {"pd": ("prefill", "decode"), "colocated": ("colocated",)}


@dataclass(frozen=True)
class JoinPolicy:
    mode: str
    model: str  # the gateway's model fingerprint
    block_size: int

    def check(self, event) -> str | None:
        """Why the worker whose `ready` event (`pdserve.conductor.wire.Ready`) this is may not join (None: it may)."""
        role = event.role
        if role not in ROLES[self.mode]:
            return f"a {self.mode} deployment takes {' or '.join(ROLES[self.mode])} workers, not {role!r}"
        if event.model != self.model:
            return "it serves another model than this deployment's (config.json or tokenizer.json differ)"
        if event.block_size != self.block_size:
            return f"its KV block size is {event.block_size}, this deployment's {self.block_size}"
        return None
