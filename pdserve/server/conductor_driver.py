"""The conductor in the gateway: drives the sans-I/O `ConductorCore` with ZeroMQ and the wall clock.

Every decision (route, admit or reject, reserve then dispatch the prefill, react to a dead worker or a failed
delivery) is the core's (`pdserve.conductor.conductor_core`), the same code the simulator drives. This module
only does the I/O: it turns worker events (`pdserve.conductor.wire` messages over the event socket) into core events, carries out the
core's actions (a command to a worker's socket, an error into a request's stream, a metric), and streams
token events into each request's queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from pdserve.conductor.admission import Admission
from pdserve.conductor.actions import Level, Switch, stale
from pdserve.conductor.conductor_core import ConductorCore, Count, Fail, Observe, Send
from pdserve.conductor.routing import RoutingPolicy, WorkerLoad
from pdserve.conductor.wire import (Beat, Checkpointed, Consumed, Error, Leave, Leaving, Left, PeerGone, Prefilled, Ready,
                                  KvCache, Refused, Relanded, Release, Reserved, ReserveWaiting, Staged, Stats, Tokens,
                                  Transfer, Unpin, Welcome, WireError, to_dict)
from pdserve.core.pd.sensitivity import DEFAULT as DEFAULT_LABEL
from pdserve.worker.wire_codec import pack, unpack
from pdserve.core.sampling_params import SamplingParams, params_dict
from pdserve.core.service_tiers import ServiceTiers
from pdserve.core.sched.online_fit import REPORTED
from pdserve.transfer.zmq_auth import Refusals, secure_client

log = logging.getLogger(__name__)
STEP_RECORDS = 4096  # recent step records kept per worker (GET /v1/admin/steps)


@dataclass
class WorkerHandle:
    load: WorkerLoad
    socket: zmq.Socket
    info: dict = field(default_factory=dict)  # its `ready` event
    stats: dict = field(default_factory=dict)  # its latest `stats` event
    # its recent steps as its stats reported them, each (source, [prefill tokens, their squares, decode seqs,
    # decode context, seconds]): source `calibration` for the first stats' (its profile steps at load), else
    # `served` (GET /v1/admin/steps; `pdserve profile --from-server` fits the simulator's time model to them)
    steps: deque = field(default_factory=lambda: deque(maxlen=STEP_RECORDS))
    last_seen: float = field(default_factory=time.monotonic)  # its latest event of any kind (heartbeat)
    loop_age_s: float = 0.0  # its latest heartbeat: how long ago its main loop last came round
    joined: bool = False  # it joined the running deployment (`pdserve worker --join`): no process of ours
    released: bool = False  # leaving, drained: told it may go

    @property
    def name(self) -> str:
        return self.load.name


@dataclass
class Flight:
    """One request's stream in the gateway."""

    rid: str
    events: asyncio.Queue
    tier: str = "default"
    workers: list[str] = field(default_factory=list)  # where it runs (decode or colocated first)
    arrival_s: float = field(default_factory=time.monotonic)
    trace: dict | None = None  # the client's trace context headers (`traceparent`), when requests are traced


class Conductor:
    def __init__(self, ctx: zmq.asyncio.Context, event_socket: zmq.asyncio.Socket, mode: str,
                 policy: RoutingPolicy, metrics=None, tiers: ServiceTiers | None = None,
                 admission: Admission | None = None, clock: Callable[[], float] = time.monotonic,
                 idle_prewarm: bool = True, max_queue: int | None = None, tracer=None) -> None:
        self.ctx = ctx
        self.tracer = tracer  # a `pdserve.server.tracing.RequestTracer`: every request that ends, as spans
        self.events = event_socket
        self.mode = mode
        self.metrics = metrics
        self.core = ConductorCore(mode, policy, tiers, admission, idle_prewarm=idle_prewarm, max_queue=max_queue)
        self.clock = clock
        self.workers: dict[str, WorkerHandle] = {}
        self.flights: dict[str, Flight] = {}
        self.refusals = Refusals(event_socket)  # events from outside the deployment (`zmq_auth`)
        self._refused = 0
        self.join_check: Callable[[Ready], str | None] | None = None  # why a joining worker is refused, if it is
        self._stale_logged: set[tuple] = set()  # kinds of stale events logged once
        self.switching: dict[str, str] = {}  # worker -> the role its replacement takes (role switching)

    @property
    def block_size(self) -> int:
        return self.core.block_size

    @property
    def tiers(self) -> ServiceTiers:
        return self.core.tiers

    # ---- workers ----------------------------------------------------------------------------------------
    def add_worker(self, name: str, role: str, cmd_addr: str) -> None:
        self.workers[name] = WorkerHandle(self.core.add_worker(name, role), self._connect(cmd_addr))

    def _connect(self, cmd_addr: str) -> zmq.Socket:
        # A plain (blocking-API) socket: the core's actions are carried out synchronously; with no
        # high-water mark a command is queued, never dropped and never waited for.
        sock = self.ctx.socket(zmq.PUSH, socket_class=zmq.Socket)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        secure_client(sock)  # (`pdserve.transfer.zmq_auth`)
        sock.connect(cmd_addr)
        return sock

    def step_records(self) -> list[dict]:
        """Every worker's recent steps (`WorkerHandle.steps`), oldest first per worker, named as `REPORTED`."""
        return [{"worker": w.name, "role": w.load.role, "source": source, **dict(zip(REPORTED, row))}
                for w in self.workers.values() for source, row in list(w.steps)]

    def role(self, role: str) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.load.role == role]

    @property
    def ready(self) -> bool:
        return all(w.info for w in self.workers.values() if not w.joined)

    # ---- membership: workers that join and leave (`pdserve.conductor.membership`) --------------------------
    def _join(self, event: Ready) -> bool:
        """A `ready` event from a worker this gateway did not start: take it in, or tell it why not."""
        name, role, cmd_addr = event.worker, event.role, event.cmd_addr
        known = self.workers.get(name)
        if self.join_check is None:  # still starting: the worker says it is ready again shortly
            return False
        if known is not None and known.joined and known.load.alive and known.info.get("cmd_addr") == cmd_addr:
            return True  # it said so again before our welcome reached it
        if known is not None and known.joined and known.load.alive and event.replaces:
            self.worker_died(name)  # restarted (by Ray): the dead process is still registered
        why = self.join_check(event)
        if why is None and known is not None and (known.load.alive or not known.joined):
            why = f"a worker named {name!r} is already in this deployment"
        if why is not None:
            if self.metrics:
                self.metrics.joins_refused.inc()
            sock = self._connect(cmd_addr)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.send(pack(Refused(why)))
            sock.close()
            return False
        if known is not None:
            known.socket.close(linger=0)
        actions = self.core.worker_joined(name, role, self.clock())
        self.workers[name] = WorkerHandle(self.core.workers[name], self._connect(cmd_addr), joined=True)
        self._send(name, Welcome())
        self._act(actions)
        return True

    def plan_roles(self, movable: Callable[[str], bool]) -> None:
        """--role-switching auto: the core's planner may move one worker (of those `movable`)."""
        self._act(self.core.plan_roles(self.clock(), movable))

    def replace_worker(self, name: str, role: str, cmd_addr: str) -> None:
        """A worker started in place of one that switched roles: routed to once its `ready` comes."""
        actions = self.core.worker_joined(name, role, self.clock(), loaded=False)
        self.core.workers[name].alive = False  # (its `ready` makes it alive and completes the move: `worker_ready`)
        self.workers[name] = WorkerHandle(self.core.workers[name], self._connect(cmd_addr))
        self._act(actions)

    def release_drained(self) -> list[str]:
        """Leaving workers with nothing left here are told they may go (once); -> their names."""
        names = [n for n in self.core.drained() if not self.workers[n].released]
        for name in names:
            self.workers[name].released = True
            self._send(name, Release())
        return names

    def worker_left(self, name: str, drained: bool) -> None:
        self.worker_died(name, reason="worker_left", left=drained)

    def worker_died(self, name: str, reason: str = "worker_died", restarting: bool = False,
                    left: bool | None = None) -> None:
        """A worker process ended (or was killed as hung; `left`: it left, drained or not). The prefill
        workers forget a dead decode worker first (its rings, connections, lent blocks: nothing of it is
        reused), then the core moves its requests and its prompts (`pdserve.conductor.recovery`)."""
        addr = self.workers[name].info.get("kv_addr")
        if addr:
            for w in self.role("prefill"):
                if w.name != name:
                    self._send(w.name, PeerGone(addr))
        if left is None:
            self._act(self.core.worker_died(name, self.clock(), reason, restarting))
        else:
            self._act(self.core.worker_left(name, self.clock(), left))

    def worker_restarting(self, name: str) -> None:
        """A dead worker's process is started again: it is not ready (routing passes it by) until its `ready`
        event registers it again."""
        worker = self.workers[name]
        worker.info, worker.stats, worker.last_seen, worker.loop_age_s = {}, {}, self.clock(), 0.0

    # ---- requests ---------------------------------------------------------------------------------------
    async def submit(self, rid: str, prompt: list[int], params: SamplingParams, priority: int = 0,
                     pin: tuple[str, float] | None = None, tier: str = "default", trace: dict | None = None,
                     follow: list[str] | None = None, sensitivity: str = DEFAULT_LABEL) -> Flight:
        """`pin`: (prewarm id, ttl_s): every worker the request runs on keeps its prompt's blocks; `follow`: the
        workers to run on (another sequence of the same prompt's). A refused request's stream holds just its
        error."""
        flight = Flight(rid, asyncio.Queue(), tier, trace=trace)
        self.flights[rid] = flight
        actions = self.core.arrive(rid, prompt, params_dict(params), self.clock(), tier=tier, priority=priority,
                                   pin=pin, follow=tuple(follow or ()), sensitivity=sensitivity)
        state = self.core.flights.get(rid)
        if state is not None:
            flight.workers = [w for w in (state.decode, state.prefill) if w is not None]
        self._act(actions)
        return flight

    async def unpin(self, pin_id: str, workers: list[str]) -> None:
        for name in workers:
            self._send(name, Unpin(pin_id))

    async def abort(self, rid: str) -> None:
        self.flights.pop(rid, None)
        self._act(self.core.abort(rid))

    # ---- actions ----------------------------------------------------------------------------------------
    def _act(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, Send):
                self._send(action.worker, action.cmd)
            elif isinstance(action, Fail):
                flight = self.flights.pop(action.rid, None)
                if flight is not None:
                    flight.events.put_nowait(action.event)
                    self._traced(flight, None, action.message)
            elif isinstance(action, Count):
                self._count(action)
            elif isinstance(action, Observe) and self.metrics:
                self.metrics.observe(action.metric, action.labels, action.value, action.weight)
            elif isinstance(action, Level) and self.metrics:
                getattr(self.metrics, action.metric).labels(**dict(action.labels)).set(action.value)
            elif isinstance(action, Switch):  # it drains and leaves; the supervisor starts its replacement
                self.switching[action.worker] = action.role
                self._send(action.worker, Leave())

    def _send(self, name: str, cmd) -> None:
        worker = self.workers[name]
        if worker.load.alive:
            worker.socket.send(pack(cmd), zmq.NOBLOCK)

    def _count(self, action: Count) -> None:
        if action.metric == "conductor_stale_events" and action.labels not in self._stale_logged:
            self._stale_logged.add(action.labels)  # the first of each kind is logged; all are counted
            log.info("a worker event for a request or transfer that is no longer live (%s); such events are "
                     "counted in pdserve_conductor_stale_events_total", dict(action.labels)["event"])
        if self.metrics:
            self.metrics.count(action.metric, action.labels)

    def _traced(self, flight: Flight, state, error: str | None = None) -> None:
        """Request `flight` ended (`state`: the core's record of it; None once the core let it go): its spans,
        when requests are traced."""
        if self.tracer is not None:
            self.tracer.ended(flight.trace, flight.arrival_s, state, self.clock(), error)

    def count_refusals(self) -> None:
        """Connection attempts on the events socket from outside the deployment, into the metrics."""
        n = self.refusals.count()
        if n > self._refused and self.metrics:
            self.metrics.rejected_connections.labels(endpoint="control").inc(n - self._refused)
        self._refused = n

    def events_pending(self) -> bool:
        """Worker events wait unread in the gateway's socket (its event loop is behind)."""
        return bool(self.events.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    # ---- events -----------------------------------------------------------------------------------------
    async def run_events(self) -> None:
        """Read and apply worker events until the socket closes. A message that does not decode is logged and
        counted (`pdserve_fallbacks_total{kind="bad_event"}`); an event whose handling fails is logged and
        counted apart (`kind="event_failed"`: a bug here, not a bad worker); either way the next one is read: a
        reader that died here would leave the gateway serving HTTP while no token reached any request."""
        while not self.events.closed:
            try:
                raw = await self.events.recv()
            except zmq.ZMQError:
                if self.events.closed or self.ctx.closed:
                    return
                log.exception("the gateway's event socket failed a read")
                await asyncio.sleep(0.01)  # (not a busy loop if it keeps failing)
                continue
            try:
                event = unpack(raw)
            except WireError as e:
                log.warning("a worker event (%d bytes) does not decode: %s: %r", len(raw), e, raw[:120])
                self._fallback("bad_event")
                continue
            try:
                self.on_event(event)
            except Exception:  # noqa: BLE001 - one failed event must not stop the gateway
                log.exception("handling a worker event failed: %r", event)
                self._fallback("event_failed")

    def _fallback(self, kind: str) -> None:
        if self.metrics:
            self.metrics.fallbacks.labels(kind=kind).inc()

    def on_event(self, event) -> None:
        """One worker event (`pdserve.conductor.wire`)."""
        now, core = self.clock(), self.core
        if isinstance(event, Tokens):
            self._tokens(event, now)
        elif isinstance(event, Reserved):
            self._act(core.reserved(event.rid, event.xfer, event.needs_prefill, event.kv_addr, event.first_block,
                                    now))
        elif isinstance(event, Consumed):  # at: the decode worker's monotonic clock (one host: the gateway's too)
            for rid, at in event.items:
                self._act(core.consumed(rid, at))
        elif isinstance(event, Prefilled):
            if self.metrics:
                self.metrics.observe_prefill(event)
            self._act(core.prefilled(event.rid, now, event.landing_in_s, bool(event.failed)))
        elif isinstance(event, Relanded):
            for rid, landing_in_s in event.items:
                self._act(core.relanded(rid, now, landing_in_s))
        elif isinstance(event, ReserveWaiting):
            self._act(core.reserve_waiting(event.rid, event.xfer, now))
        elif isinstance(event, Staged):
            self._act(core.staged(event.rid, event.ok, now))
        elif isinstance(event, Transfer):
            if self.metrics:
                self.metrics.observe_transfer(event)
            self._act(core.transfer_outcome(event.rid, event.outcome, event.xfer, now))
        elif isinstance(event, Error):
            flight = self.flights.pop(event.rid, None)
            if flight is not None:
                flight.events.put_nowait(to_dict(event))
                self._traced(flight, None, event.message)
            self._act(core.worker_error(event.rid))
        else:
            self._on_worker_event(event)

    def _tokens(self, event: Tokens, now: float) -> None:
        for item in event.items:
            state = self.core.flights.get(item["rid"])
            if state is None or state.decode != (event.worker or state.decode):
                # ended, or from a worker it has moved away from (one that died)
                self._act(stale("tokens"))
                continue
            item["i"] += state.offset  # numbered over its whole output, across moves
            flight = self.flights.get(item["rid"])
            if flight is not None:
                flight.events.put_nowait(item)
                if item["fin"]:
                    self.flights.pop(item["rid"], None)
            self._act(self.core.token(item["rid"], item["i"], bool(item["fin"]), now, item["t"]))
            if item["fin"] and flight is not None:
                self._traced(flight, state)

    def _on_worker_event(self, event) -> None:
        if isinstance(event, Ready) and event.cmd_addr and not self._join(event):
            return
        worker = self.workers.get(event.worker)
        if worker is None:  # a joining worker that was refused (its heartbeats until it exits)
            return
        worker.last_seen = worker.load.heard_s = self.clock()
        if isinstance(event, Beat):
            worker.loop_age_s = event.loop_age_s
        elif isinstance(event, Checkpointed):
            for rid, tokens in event.items:
                self._act(self.core.checkpointed(rid, worker.name, tokens))
        elif isinstance(event, Ready):
            worker.info = {k: v for k, v in to_dict(event).items() if k != "type"}
            self._act(self.core.worker_ready(worker.name, event, self.clock()))
        elif isinstance(event, Leaving):
            self._act(self.core.worker_leaving(worker.name))
        elif isinstance(event, Left):
            if worker.load.alive:
                self.worker_left(worker.name, event.released)
        elif isinstance(event, KvCache):
            self._act(self.core.worker_cache(worker.name, event.stored, event.evicted))
            if self.metrics:
                for tier, held in worker.load.reported.held.items():
                    self.metrics.routing_reported_blocks.labels(worker=worker.name, tier=tier).set(len(held))
        elif isinstance(event, Stats):
            source = "served" if worker.stats else "calibration"
            stats = worker.stats = {"worker": event.worker, "role": event.role, **event.values}
            worker.steps.extend((source, row) for row in stats.get("steps") or ())
            self.core.worker_steps(worker.name, stats.get("steps"), stats.get("prefill_cap"))
            if "kv_links" in stats:  # a prefill worker: its links' measured rates
                self.core.worker_links(worker.name, stats["kv_links"])
            if self.metrics:
                self.metrics.observe_worker_stats(stats)
                self.metrics.observe_backlog(self.core.backlog)
