"""The conductor: the gateway's view of every worker, and the life of each request across them.

For each request it picks workers (routing policy), then in PD mode asks the decode worker to reserve KV
blocks and, once they are reserved, tells the prefill worker where to deliver the prompt's KV; in colocated
mode it sends the request to one worker. Token events stream back into the request's queue. It reacts to
failures with explicit outcomes: a dead decode worker fails its requests with an error; a dead prefill
worker makes the decode worker recompute the requests it was prefilling; with no prefill worker left,
requests go to a decode worker whole (a counted fallback).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import asdict, dataclass, field

import msgpack
import zmq
import zmq.asyncio

from pdserve.cluster.routing import RoutingPolicy, WorkerLoad
from pdserve.cluster.routing import AFFINITY_BLOCKS
from pdserve.core.block_hash import hash_blocks
from pdserve.core.sampling_params import SamplingParams


@dataclass
class WorkerHandle:
    load: WorkerLoad
    socket: zmq.asyncio.Socket
    info: dict = field(default_factory=dict)  # its `ready` event
    stats: dict = field(default_factory=dict)  # its latest `stats` event

    @property
    def name(self) -> str:
        return self.load.name


@dataclass
class Flight:
    """One request in the cluster."""

    rid: str
    prompt: list[int]
    params: dict
    events: asyncio.Queue
    priority: int = 0  # lower is served first under --queue-policy priority (vLLM's convention)
    pin: tuple[str, float] | None = None  # a prewarm: (id, ttl_s)
    decode: WorkerHandle | None = None
    prefill: WorkerHandle | None = None
    xfer: str = ""
    done: bool = False


class Conductor:
    def __init__(self, ctx: zmq.asyncio.Context, event_socket: zmq.asyncio.Socket, mode: str,
                 policy: RoutingPolicy, metrics=None) -> None:
        self.ctx = ctx
        self.events = event_socket
        self.mode = mode
        self.policy = policy
        self.metrics = metrics
        self.workers: dict[str, WorkerHandle] = {}
        self.flights: dict[str, Flight] = {}
        self._xfers = itertools.count()
        self.block_size = 16

    # ---- workers ----------------------------------------------------------------------------------------
    def add_worker(self, name: str, role: str, cmd_addr: str) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(cmd_addr)
        self.workers[name] = WorkerHandle(WorkerLoad(name, role), sock)

    def role(self, role: str) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.load.role == role]

    @property
    def ready(self) -> bool:
        return all(w.info for w in self.workers.values())

    async def send(self, worker: WorkerHandle, cmd: dict) -> None:
        if worker.load.alive:
            await worker.socket.send(msgpack.packb(cmd))

    def worker_died(self, name: str) -> None:
        worker = self.workers[name]
        worker.load.alive = False
        if self.metrics:
            self.metrics.worker_deaths.labels(worker=name).inc()
        for flight in list(self.flights.values()):
            if flight.decode is worker:
                self._fail(flight, 503, f"worker {name} died while serving this request", "worker_died")
            elif flight.prefill is worker and flight.decode is not None:
                asyncio.ensure_future(self.send(flight.decode, {"type": "kv_failed", "xfer": flight.xfer}))

    # ---- requests ---------------------------------------------------------------------------------------
    async def submit(self, rid: str, prompt: list[int], params: SamplingParams, priority: int = 0,
                     pin: tuple[str, float] | None = None) -> Flight:
        """`pin`: (prewarm id, ttl_s): every worker the request runs on keeps its prompt's blocks."""
        flight = Flight(rid, prompt, _params_dict(params), asyncio.Queue(), priority, pin)
        hashes = hash_blocks(prompt[:AFFINITY_BLOCKS * self.block_size], self.block_size)
        if self.mode == "colocated":
            flight.decode = self._pick("colocated", hashes)
        else:
            flight.decode = self._pick("decode", hashes)
            flight.prefill = self._pick("prefill", hashes)
        if flight.decode is None:
            self._fail(flight, 503, "no live worker can serve this request", "no_worker")
            return flight
        self.flights[rid] = flight
        flight.decode.load.outstanding += 1
        flight.decode.load.remember(hashes)
        if self.mode == "colocated":
            await self.send(flight.decode, {"type": "generate", "rid": rid, "prompt": prompt, "params": flight.params,
                                            "priority": priority, "pin": pin})
            return flight
        flight.xfer = f"{rid}#{next(self._xfers)}"
        if flight.prefill is not None:
            flight.prefill.load.outstanding += 1
            flight.prefill.load.remember(hashes)
        await self.send(flight.decode, {"type": "reserve", "rid": rid, "prompt": prompt, "params": flight.params,
                                        "xfer": flight.xfer, "priority": priority, "pin": pin})
        return flight

    def _pick(self, role: str, hashes) -> WorkerHandle | None:
        workers = self.role(role)
        load = self.policy.pick([w.load for w in workers], hashes)
        return None if load is None else self.workers[load.name]

    async def unpin(self, pin_id: str, workers: list[str]) -> None:
        for name in workers:
            await self.send(self.workers[name], {"type": "unpin", "id": pin_id})

    async def abort(self, rid: str) -> None:
        flight = self.flights.get(rid)
        if flight is None:
            return
        self._finish(flight)
        for worker in (flight.decode, flight.prefill):
            if worker is not None:
                await self.send(worker, {"type": "abort", "rid": rid})

    def _finish(self, flight: Flight) -> None:
        if flight.done:
            return
        flight.done = True
        self.flights.pop(flight.rid, None)
        for worker in (flight.decode, flight.prefill):
            if worker is not None:
                worker.load.outstanding -= 1

    def _release_prefill(self, flight: Flight) -> None:
        if flight.prefill is not None and not flight.done:
            flight.prefill.load.outstanding -= 1
            flight.prefill = None

    def _fail(self, flight: Flight, status: int, message: str, code: str) -> None:
        flight.events.put_nowait({"type": "error", "status": status, "message": message, "code": code,
                                  "etype": "server_error" if status >= 500 else "invalid_request_error"})
        self._finish(flight)

    # ---- events -----------------------------------------------------------------------------------------
    async def run_events(self) -> None:
        while True:
            event = msgpack.unpackb(await self.events.recv())
            try:
                await self._on_event(event)
            except Exception:  # noqa: BLE001 - one bad event must not stop the gateway
                if self.metrics:
                    self.metrics.fallbacks.labels(kind="bad_event").inc()

    async def _on_event(self, event: dict) -> None:
        kind = event["type"]
        if kind == "ready":
            worker = self.workers[event["worker"]]
            worker.info = event
            self.block_size = event["block_size"]
        elif kind == "stats":
            self.workers[event["worker"]].stats = event
            if self.metrics:
                self.metrics.observe_worker_stats(event)
        elif kind == "tokens":
            for item in event["items"]:
                flight = self.flights.get(item["rid"])
                if flight is not None:
                    flight.events.put_nowait(item)
                    if item["fin"]:
                        self._finish(flight)
        elif kind == "reserved":
            await self._on_reserved(event)
        elif kind == "prefilled":
            flight = self.flights.get(event["rid"])
            if self.metrics:
                self.metrics.observe_prefill(event)
            if flight is not None:
                self._release_prefill(flight)
        elif kind == "transfer":
            if self.metrics:
                self.metrics.observe_transfer(event)
            flight = self.flights.get(event["rid"])
            if event["outcome"] == "recompute" and flight is not None and flight.prefill is not None:
                await self.send(flight.prefill, {"type": "abort", "rid": flight.rid})  # its work is moot now
                self._release_prefill(flight)
        elif kind == "error":
            flight = self.flights.get(event.get("rid"))
            if flight is not None:
                flight.events.put_nowait(event)
                await self.abort(flight.rid)

    async def _on_reserved(self, event: dict) -> None:
        flight = self.flights.get(event["rid"])
        if flight is None or flight.xfer != event["xfer"]:
            return
        if not event["needs_prefill"]:
            self._release_prefill(flight)
            return
        if flight.prefill is None or not flight.prefill.load.alive:
            if self.metrics:
                self.metrics.fallbacks.labels(kind="no_prefill_worker").inc()
            self._release_prefill(flight)
            await self.send(flight.decode, {"type": "kv_failed", "xfer": flight.xfer})
            return
        await self.send(flight.prefill, {"type": "prefill", "rid": flight.rid, "prompt": flight.prompt,
                                         "params": flight.params, "dest": event["kv_addr"], "xfer": flight.xfer,
                                         "first_block": event["first_block"], "priority": flight.priority,
                                         "pin": flight.pin})


def _params_dict(params: SamplingParams) -> dict:
    d = asdict(params)
    d["stop"] = []  # stop strings are the gateway's business (it detokenizes)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
