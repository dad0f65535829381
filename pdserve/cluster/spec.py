"""What a worker process is told at start (JSON on its command line). No torch here."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

ROLES = ("prefill", "decode", "colocated")
TRANSPORTS = ("shm", "tcp")


@dataclass(frozen=True)
class WorkerSpec:
    name: str  # e.g. "prefill-0"; the `worker` label of its metrics
    role: str  # prefill | decode | colocated
    model_dir: str
    engine: dict = field(default_factory=dict)  # EngineConfig fields
    cmd_addr: str = ""  # the worker binds: commands from the gateway
    event_addr: str = ""  # the gateway binds: events from every worker
    transport: str = "shm"
    kv_addr: str = ""  # decode/colocated with shm: the worker binds its KV header socket here
    kv_host: str = "127.0.0.1"  # tcp: the interface the KV receiver binds
    kv_timeout_s: float = 30.0  # a transfer with no progress for this long fails (lease)
    ring_mb: int = 16  # shm ring per (prefill, decode) pair
    delivery: str = "scheduled"  # prefill: the order of KV on each link (pdserve.core.delivery)
    link_share: dict | None = None  # tier -> bandwidth share under scheduled delivery
    link_bytes_s: float | None = None  # prefill: each link throttled to this (None: unthrottled)
    delivery_backlog_s: float = 2.0  # prefill: production pauses above this much queued delivery (0: never)
    decode_cadence: str = "off"  # decode: steady paces its steps' outputs (pdserve.core.decode_cadence)
    joined: bool = False  # started by `pdserve worker --join`, not by the gateway (`pdserve.cluster.joined`)
    drain_timeout_s: float = 30.0  # joined: on SIGTERM, the longest it finishes its requests before leaving
    join_timeout_s: float = 30.0  # joined: the gateway's welcome must come this soon after its `ready`

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))
