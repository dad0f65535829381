"""The gateway's event reader survives bad worker messages: a message that does not decode, or an event the
conductor cannot apply, is counted and the next event is read (a dead reader would leave the gateway serving
HTTP while no token reached any request). Real ZeroMQ sockets; the test plays the workers."""

from __future__ import annotations

import asyncio

import msgpack
import zmq
import zmq.asyncio

from pdserve.server.conductor_driver import Conductor
from pdserve.conductor.routing_policies import make_routing_policy
from pdserve.core.sampling_params import SamplingParams
from pdserve.server.metrics import Metrics


def test_bad_worker_messages_are_counted_and_the_reader_goes_on(tmp_path):
    metrics = Metrics()

    async def run() -> list:
        ctx = zmq.asyncio.Context()
        events = ctx.socket(zmq.PULL)
        events.bind(f"ipc://{tmp_path}/events")
        conductor = Conductor(ctx, events, "colocated", make_routing_policy("least-loaded"), metrics)
        cmds = ctx.socket(zmq.PULL)
        cmds.bind(f"ipc://{tmp_path}/w.cmd")
        conductor.add_worker("w", "colocated", f"ipc://{tmp_path}/w.cmd")
        worker = ctx.socket(zmq.PUSH)
        worker.connect(f"ipc://{tmp_path}/events")
        reader = asyncio.create_task(conductor.run_events())
        try:
            stream = await conductor.submit("r", [1, 2, 3], SamplingParams(max_tokens=2))
            await asyncio.wait_for(cmds.recv(), 5)
            await worker.send(b"\xc1 not msgpack")  # does not decode
            await worker.send(msgpack.packb({"type": "reserved", "rid": "r"}))  # fields missing
            await worker.send(msgpack.packb({"type": "tokens", "worker": "w", "items": [
                {"rid": "r", "i": 0, "tok": 7, "fin": None, "t": 0.0}]}))
            first = await asyncio.wait_for(stream.events.get(), 5)
            return [first, reader.done()]
        finally:
            reader.cancel()
            ctx.destroy(linger=0)

    first, reader_done = asyncio.run(run())
    assert first["tok"] == 7 and not reader_done
    assert metrics.fallbacks.labels(kind="bad_event")._value.get() == 2
