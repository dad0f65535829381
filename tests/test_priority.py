"""`priority` (vLLM's extension: lower value first) travels from the conductor to every worker's scheduler.

The conductor over real ZeroMQ sockets (no workers: the test reads their command sockets), real `Worker`s
(a tiny random Llama) handling those commands in process, and the simulator's conductor, which must queue
reservations as the real decode worker does. End to end over HTTP:
tests/test_serve.py::test_priority_serves_an_urgent_request_before_queued_ones.
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import zmq
import zmq.asyncio

from pdserve.server.conductor_driver import Conductor
from pdserve.conductor.routing_policies import make_routing_policy
from pdserve.worker.spec import WorkerSpec
from pdserve.conductor.wire import Abort, from_dict
from pdserve.core.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=4)


async def _commands(mode: str, tmp_path, react) -> dict[str, list[dict]]:
    """Run a conductor in `mode` against bare command sockets; `react(conductor, send_event, got)` drives it.
    Returns every command each worker got."""
    ctx = zmq.asyncio.Context()
    events = ctx.socket(zmq.PULL)
    events.bind(f"ipc://{tmp_path}/events")
    conductor = Conductor(ctx, events, mode, make_routing_policy("least-loaded"))
    roles = ["colocated"] if mode == "colocated" else ["prefill", "decode"]
    pulls = {}
    for role in roles:
        pulls[role] = ctx.socket(zmq.PULL)
        pulls[role].bind(f"ipc://{tmp_path}/{role}.cmd")
        conductor.add_worker(f"{role}-0", role, f"ipc://{tmp_path}/{role}.cmd")
    to_gateway = ctx.socket(zmq.PUSH)
    to_gateway.connect(f"ipc://{tmp_path}/events")
    task = asyncio.create_task(conductor.run_events())
    got: dict[str, list[dict]] = {role: [] for role in roles}

    async def recv(role: str) -> dict:
        cmd = msgpack.unpackb(await asyncio.wait_for(pulls[role].recv(), 5))
        got[role].append(cmd)
        return cmd

    try:
        await react(conductor, lambda e: to_gateway.send(msgpack.packb(e)), recv)
    finally:
        task.cancel()
        ctx.destroy(linger=0)
    return got


def test_conductor_commands_carry_priority_in_pd_mode(tmp_path):
    async def react(conductor, send_event, recv):
        await conductor.submit("r", [1, 2, 3], PARAMS, priority=-3)
        reserve = await recv("decode")
        await send_event({"type": "reserved", "rid": "r", "xfer": reserve["xfer"], "first_block": 0,
                          "kv_addr": "tcp://127.0.0.1:1", "needs_prefill": True})
        await recv("prefill")

    got = asyncio.run(_commands("pd", tmp_path, react))
    assert [(c["type"], c["priority"]) for c in got["decode"]] == [("reserve", -3)]
    assert [(c["type"], c["priority"]) for c in got["prefill"]] == [("prefill", -3)]


def test_conductor_commands_carry_priority_in_colocated_mode(tmp_path):
    async def react(conductor, send_event, recv):
        await conductor.submit("r", [1, 2, 3], PARAMS, priority=7)
        await recv("colocated")

    got = asyncio.run(_commands("colocated", tmp_path, react))
    assert [(c["type"], c["priority"]) for c in got["colocated"]] == [("generate", 7)]


@pytest.fixture
def make_worker(tiny_llama_dir, tmp_path):
    from pdserve.worker.worker import Worker

    ctx = zmq.Context.instance()
    sink = ctx.socket(zmq.PULL)  # the gateway's event socket: lets the workers' events go somewhere
    sink.bind(f"ipc://{tmp_path}/events")
    workers = []

    def make(role: str, **engine) -> Worker:
        engine = dict(num_threads=1, num_kv_blocks=64, block_size=4, queue_policy="priority", **engine)
        spec = WorkerSpec(name=f"{role}-0", role=role, model_dir=str(tiny_llama_dir), engine=engine,
                          cmd_addr=f"ipc://{tmp_path}/{role}.cmd", event_addr=f"ipc://{tmp_path}/events",
                          transport="tcp", kv_addr=f"ipc://{tmp_path}/{role}.kv")
        workers.append(Worker(spec))
        return workers[-1]

    yield make
    for w in workers:
        w.close()
    sink.close(linger=0)


def _cmd(kind: str, rid: str, priority: int, **extra):
    """A command as it comes off the wire."""
    transfer = {"xfer": f"{rid}#0"} if kind in ("reserve", "prefill") else {}
    return from_dict({"type": kind, "rid": rid, "prompt": [5, 6, 7, 8, 9], "params": {"max_tokens": 4},
                      "priority": priority, **transfer, **extra})


def test_decode_worker_grants_reservations_in_priority_order(make_worker):
    worker = make_worker("decode", max_num_seqs=1)
    worker._handle(_cmd("reserve", "first", 0))
    assert [g.reservation.request.request_id for g in worker.decode.try_reserve()] == ["first"]
    worker._handle(_cmd("reserve", "low", 5))
    worker._handle(_cmd("reserve", "urgent", -1))
    assert worker.decode.try_reserve() == []  # the one slot is taken
    worker._handle(Abort("first"))
    granted = [g.reservation.request for g in worker.decode.try_reserve()]
    assert [(r.request_id, r.priority) for r in granted] == [("urgent", -1)]


def test_prefill_and_colocated_workers_queue_by_priority(make_worker):
    prefill = make_worker("prefill")
    prefill._handle(_cmd("prefill", "p", -2, dest="tcp://127.0.0.1:1", link="decode-0", first_block=0))
    assert prefill.engine.scheduler.requests["p"].priority == -2
    colocated = make_worker("colocated")
    colocated._handle(_cmd("generate", "g", 4))
    assert colocated.engine.scheduler.requests["g"].priority == 4


def test_simulated_decode_worker_grants_reservations_in_priority_order():
    from array import array

    from pdserve.bench.metrics import RequestRecord
    from pdserve.core.sched.policy import PriorityPolicy
    from pdserve.sim.cluster import ClusterSpec, build
    from pdserve.sim.hardware import get_gpu, get_model
    from pdserve.sim.timemodel import RooflineTimeModel

    model, gpu = get_model("llama-3-8b"), get_gpu("h100")
    loop, conductor, engines = build(ClusterSpec(mode="pd", max_num_seqs=1), model, gpu,
                                     RooflineTimeModel(model, gpu, 1))
    for engine in engines:  # as `--queue-policy priority` would
        engine.scheduler.policy = PriorityPolicy()
    records = {}
    for i, (name, priority) in enumerate([("first", 0), ("low", 5), ("urgent", -1)]):  # all at t=0
        records[name] = RequestRecord(start_s=0.0, prompt_tokens=64)
        conductor.submit(name, array("q", range(100 * i + 10, 100 * i + 74)), 8, records[name], priority)
    loop.run()
    assert sorted(records, key=lambda n: records[n].first_token_s) == ["urgent", "first", "low"]
