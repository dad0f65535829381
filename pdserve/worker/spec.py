"""What a worker process is told at start (JSON on its command line). No torch here. The settings a worker
shares with `pdserve serve` and `pdserve simulate` take their defaults from `pdserve.core.settings`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from pdserve.core.settings import (CadenceSettings, CalibrationSettings, DeliverySettings,
                                   MooncakeTransportSettings, SupervisionSettings, shared)

ROLES = ("prefill", "decode", "colocated")


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
    mooncake_protocol: str = shared(MooncakeTransportSettings, "mooncake_protocol")  # mooncake: tcp or rdma
    kv_timeout_s: float = shared(SupervisionSettings, "kv_timeout_s")  # a transfer with no progress this long fails
    # prefill: its KV paths' breakers (`pdserve.core.pd.breaker.BreakerPolicy.of`)
    kv_send_timeout_s: float = shared(SupervisionSettings, "kv_send_timeout_s")
    kv_breaker_failures: int = shared(SupervisionSettings, "kv_breaker_failures")
    kv_breaker_cool_s: float = shared(SupervisionSettings, "kv_breaker_cool_s")
    kv_stage_grace_s: float = shared(SupervisionSettings, "kv_stage_grace_s")
    ring_mb: int = 16  # shm ring per (prefill, decode) pair
    delivery: str = shared(DeliverySettings, "delivery")  # prefill: the order of KV on each link
    link_share: dict | None = None  # tier -> bandwidth share under scheduled delivery
    link_bytes_s: float | None = None  # prefill: each link throttled to this (None: unthrottled)
    delivery_backlog_s: float = shared(DeliverySettings, "delivery_backlog_s")  # prefill: production backpressure
    kv_wire_dtype: str = shared(DeliverySettings, "kv_wire_dtype")  # prefill: the format of its transfers
    decode_cadence: str = shared(CadenceSettings, "decode_cadence")  # decode: steady paces its steps' outputs
    calibration: str = shared(CalibrationSettings, "calibration")  # its time model at load (profile steps)
    joined: bool = False  # started by `pdserve worker --join`, not by the gateway (`pdserve.worker.joined`)
    drain_timeout_s: float = shared(SupervisionSettings, "drain_timeout_s")  # joined: on SIGTERM, before leaving
    join_timeout_s: float = 30.0  # joined: the gateway's welcome must come this soon after its `ready`

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))
