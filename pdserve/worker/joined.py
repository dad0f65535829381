"""`pdserve worker --join`: a worker started on any host that joins a running deployment, and leaves it.

    PDSERVE_DEPLOYMENT_SECRET=<the gateway's> pdserve worker --role decode --join tcp://GATEWAY:5557 \
        --data-host 10.0.0.7 [engine flags]

It binds its command socket and (decode, colocated) its KV receiver on `--data-host` (default: the address
this host reaches the gateway from), connects to the gateway's control socket (CurveZMQ, keyed by the
deployment secret: a process without it is never heard), and registers with its `ready` event, which here
names its command address and its model (`pdserve.server.joins` decides whether it may join; a refused
worker prints why and exits with status 2). KV goes between hosts over the tcp transport.

On SIGTERM (or SIGINT) it leaves without losing a request (`Departure`): it tells the gateway, which sends it
no new work; it finishes what it holds (decoding its requests, prefilling and delivering its prompts) until
the gateway releases it, sends what its links still queue, says it left, and exits. After
`--drain-timeout-s` it leaves anyway: what it still had moves to the other workers (recomputed there).
It also stops when the gateway stops.
"""

from __future__ import annotations

import os
import socket
import time
from urllib.parse import urlsplit

from pdserve.worker.spec import WorkerSpec
from pdserve.conductor.wire import Leaving, Left
from pdserve.core.pd.breaker import breaker_settings
from pdserve.core.settings import (CadenceSettings, CalibrationSettings, DeliverySettings, SupervisionSettings,
                                   default_of)
from pdserve.errors import InvalidRequestError
from pdserve.transfer import peer_auth

ROLES = ("prefill", "decode", "colocated")
READY_EVERY_S = 2.0  # a joining worker says it is ready again this often until the gateway welcomes it


def worker_spec(role: str, join: str, engine: dict, *, name: str | None = None, data_host: str | None = None,
                supervision: SupervisionSettings = SupervisionSettings(),
                delivery: DeliverySettings = DeliverySettings(), cadence: CadenceSettings = CadenceSettings(),
                calibration: CalibrationSettings = CalibrationSettings(),
                join_timeout_s: float = default_of(WorkerSpec, "join_timeout_s")) -> WorkerSpec:
    """The spec of a worker that joins the gateway at `join` (checked here: bad input is a one-line error
    before the model loads). `engine`: EngineConfig fields, `model` among them. A joined worker takes its
    delivery order and backlog from `delivery` (its link shares and rate are the spec's defaults)."""
    from pdserve.model.loader import resolve_model_dir
    if role not in ROLES:
        raise InvalidRequestError(f"--role must be prefill, decode or colocated, got {role!r}", param="role")
    host, port = parse_join(join)
    if not peer_auth.valid_secret(os.environ.get(peer_auth.ENV, "")):
        raise InvalidRequestError(f"a joining worker proves it belongs to the deployment with its secret: set "
                                  f"{peer_auth.ENV} to the gateway's (64 hex digits)", param="join")
    if not join_timeout_s > 0:
        raise InvalidRequestError("--join-timeout-s must be positive", param="join_timeout_s")
    data_host = data_host or local_address(host, port)
    engine = dict(engine)
    model_dir = str(resolve_model_dir(engine.pop("model", None)))
    return WorkerSpec(name=name or f"{role}-{socket.gethostname()}-{os.getpid()}", role=role, model_dir=model_dir,
                      engine=engine, cmd_addr=zmq_address(data_host, "*"), event_addr=zmq_address(host, port),
                      transport="tcp", kv_host=data_host, kv_timeout_s=supervision.kv_timeout_s,
                      **breaker_settings(supervision),
                      delivery=delivery.delivery, delivery_backlog_s=delivery.delivery_backlog_s,
                      kv_wire_dtype=delivery.kv_wire_dtype, joined=True,
                      drain_timeout_s=supervision.drain_timeout_s, join_timeout_s=join_timeout_s,
                      decode_cadence=cadence.decode_cadence, calibration=calibration.calibration)


def parse_join(url: str) -> tuple[str, int]:
    """`tcp://HOST:PORT` -> (host, port)."""
    parts = urlsplit(url)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise InvalidRequestError(f"--join must be the gateway's control address tcp://HOST:PORT (its "
                                  f"--control-port), got {url!r}", param="join")
    return parts.hostname, parts.port


def local_address(host: str, port: int) -> str:
    """The address of this host's interface that reaches (host, port): where the gateway and the other workers
    reach this worker when no --data-host is given (a UDP connect sends nothing; it only picks the route)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))
        except OSError as e:
            raise InvalidRequestError(f"cannot reach the gateway at {host}:{port}: {e.strerror}", param="join") from e
        return s.getsockname()[0]


def zmq_address(host: str, port: int | str) -> str:
    return f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"


class Departure:
    """A worker's membership (every worker leaves this way when the conductor moves it to another role; a
    joined one also on SIGTERM). Joining: its `ready` sent, the gateway's `welcome` must come within
    `join_timeout_s` (a worker without the deployment's secret is never heard: it says so and exits).
    Leaving: asked (a signal) -> `leaving` sent -> released by the gateway (nothing the conductor routed here
    is left) -> its deliveries out -> `left` sent and the loop stops. Past the drain timeout it stops without
    waiting for the release."""

    def __init__(self, worker, drain_timeout_s: float, join_timeout_s: float = 30.0, clock=time.monotonic,
                 welcomed: bool = False) -> None:
        self.worker = worker
        self.drain_timeout_s = drain_timeout_s
        self.join_timeout_s = join_timeout_s
        self.clock = clock
        self.started_s = self.last_ready_s = clock()
        self.welcomed = welcomed  # (a worker the gateway started needs no welcome)
        self.asked_s: float | None = None
        self.announced = False
        self.released = False

    def ask(self, *_) -> None:
        """The signal handler: leave (a second signal changes nothing)."""
        if self.asked_s is None:
            self.asked_s = self.clock()

    def step(self) -> None:
        """Each pass of the worker loop."""
        w, now = self.worker, self.clock()
        if not self.welcomed and now - self.last_ready_s > READY_EVERY_S:  # (a gateway still starting drops it)
            w.emit(w.ready_event)
            self.last_ready_s = now
        if not self.welcomed and now - self.started_s > self.join_timeout_s:
            print(f"pdserve: the gateway did not take this worker within {self.join_timeout_s:g} s: check --join "
                  f"(its --control-port) and that PDSERVE_DEPLOYMENT_SECRET is the gateway's", flush=True)
            w.running, w.exit_code = False, 2
            return
        if self.asked_s is None:
            return
        if not self.announced:
            w.emit(Leaving(w.spec.name))
            self.announced = True
            print(f"pdserve: worker {w.spec.name} leaving: finishing its requests", flush=True)
        timed_out = now - self.asked_s > self.drain_timeout_s
        if (self.released and self._delivered()) or timed_out:
            w.emit(Left(w.spec.name, self.released and not timed_out))
            w.running = False
            print(f"pdserve: worker {w.spec.name} left" + ("" if self.released else
                                                           " (drain timed out: its requests move)"), flush=True)

    def _delivered(self) -> bool:
        """A prefill worker has nothing left on its links (every transfer sent and closed)."""
        p = self.worker.prefill
        return p is None or not (p.outbound or p.closing or p.lent)
