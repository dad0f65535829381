"""One PD request sequence on a decode worker, driven through the real worker (`DecodeSide` on a real engine,
a fake byte port in place of a transport) and through the simulator (`SimConductor`'s decode engine, which
receives the same commands): both make the same decisions, because both run `pdserve.core.pd.decode_books`.

The sequence: three reservations on a worker with two slots (two granted, one reported waiting, once); one
transfer delivered with its first token; one whose lease lapses (real: held, then the conductor's
`kv_failed`; simulated: the conductor's `kv_failed`) and is recomputed; an abort that lets the waiting one in;
a fourth prompt whose every token but the last is cached there, granted with no prefill worker.
"""

from __future__ import annotations

import time

import pytest

from pdserve.bench.metrics import RequestRecord
from pdserve.conductor.commands import REQUEST_COMMANDS, carry_out
from pdserve.conductor.wire import KINDS, Abort, Command, KvFailed, Reserve
from pdserve.worker.worker_commands import WorkerCommands
from pdserve.core.sampling_params import SamplingParams, params_dict
from pdserve.engine.config import EngineConfig
from pdserve.engine.pd import DecodeSide
from pdserve.engine.worker_engine import build_engine_at
from pdserve.kv.block_io import chunk_nbytes
from pdserve.sim.cluster import ClusterSpec, build
from pdserve.sim.flight import Flight
from pdserve.sim.hardware import get_gpu, get_model
from pdserve.sim.timemodel import RooflineTimeModel
from pdserve.sim.worker_commands import SimCommands
from pdserve.transfer.base import Received

BLOCK, SEQS, FIRST_TOKEN = 4, 2, 5
PARAMS = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
A = [11 + 3 * i for i in range(10)]
PROMPTS = {"a": A, "b": [500 + 7 * i for i in range(13)], "c": [900 + i for i in range(9)], "d": A[:8] + [77]}


def _reserve(rid: str) -> Reserve:
    return Reserve(rid, PROMPTS[rid], params_dict(PARAMS), f"{rid}#0")


class FakePort:
    """A receiver that hands the decode side the records queued on it: each chunk 'written' where the decode
    side places it (no bytes move) and verified."""
    address = "fake://decode"
    wakeup = None

    def __init__(self) -> None:
        self.queued: list[dict] = []

    def poll(self, timeout_ms: int = 0, place=None) -> list[Received]:
        records, self.queued = self.queued, []
        return [Received(h, place(h) if h["kind"] == "chunk" else None, True) for h in records]

    def arm(self) -> bool:
        return False

    def close(self) -> None:
        pass


class Real:
    """The real decode worker's side, as `pdserve.worker.worker` drives it."""

    def __init__(self, model_dir, lease_s: float) -> None:
        cfg = EngineConfig(block_size=BLOCK, num_kv_blocks=256, num_threads=1, max_num_batched_tokens=64,
                           kv_host_gb=0, max_num_seqs=SEQS)
        self.engine = build_engine_at(model_dir, cfg, detokenize=False)
        self.port = FakePort()
        self.side = DecodeSide(self.engine, self.port, self.engine.executor.kv_pool.layers, lease_s,
                               hold_lapsed=True)
        self.decisions: list[tuple] = []

    def command(self, cmd) -> None:
        """The real worker's command code (`pdserve.worker.worker_commands`), on a decode worker."""
        carry_out(cmd, WorkerCommands(self.engine, None, self.side, reports=None))

    def deliver(self, rid: str) -> None:
        inbound = self.side.inbound.get(f"{rid}#0")
        for layer, tensor in enumerate(self.side.layers):
            self.port.queued.append({"kind": "chunk", "xfer": inbound.xfer, "layer": layer, "first": inbound.first_block,
                                     "count": inbound.num_blocks, "nbytes": chunk_nbytes(tensor, inbound.num_blocks)})
        self.port.queued.append({"kind": "done", "xfer": inbound.xfer, "num_chunks": len(self.side.layers),
                                 "first_token": FIRST_TOKEN, "logprobs": None})

    def boundary(self) -> None:
        """One pass of the worker loop's bookkeeping, then a step when there is work."""
        self.side.receive(0)
        for g in self.side.try_reserve():
            self.decisions.append(("reserved", g.reservation.request.request_id, g.first_block, g.needs_prefill))
        for rid, _ in self.side.newly_waiting():
            self.decisions.append(("waiting", rid))
        for inbound, outcome, _ in self.side.settle():
            self.decisions.append((outcome, inbound.request_id))
        sched = self.engine.scheduler
        if sched.num_running + sched.num_waiting:
            self.engine.step()

    def lapse(self, rid: str) -> None:
        """Wait (with a deadline) until the transfer's lease runs out and it is held for the conductor."""
        deadline = time.monotonic() + 10
        while ("held", rid) not in self.decisions:
            assert time.monotonic() < deadline, "the lease never lapsed"
            self.boundary()
            time.sleep(0.01)
        self.decisions.remove(("held", rid))  # the simulator models no leases: the conductor's word follows

    def statuses(self) -> dict:
        return {rid: r.status.name for rid, r in self.engine.scheduler.requests.items()}


class Sim:
    """The simulator's decode engine, given the same commands (as the core would send them)."""

    def __init__(self) -> None:
        model, gpu = get_model("llama-3-8b"), get_gpu("h100")
        spec = ClusterSpec(mode="pd", block_size=BLOCK, num_kv_blocks=256, max_num_seqs=SEQS, host_kv_gb=0,
                           idle_prewarm=False)
        self.loop, self.conductor, _ = build(spec, model, gpu, RooflineTimeModel(model, gpu, 1))
        self.conductor.decisions = []
        self.engine = self.conductor.by_name["decode-0"]
        for rid, prompt in PROMPTS.items():
            f = Flight(rid, prompt, PARAMS, RequestRecord(start_s=0.0))
            f.decode = self.engine
            self.conductor.flights[rid] = f

    def command(self, cmd) -> None:
        self.conductor._command(self.engine, cmd)  # noqa: SLF001 - the core's Send, without the core

    def deliver(self, rid: str) -> None:
        f = self.conductor.flights[rid]
        f.delivered, f.first_token = 1.0, FIRST_TOKEN
        self.conductor.ready[self.engine.name].append(f)

    def boundary(self) -> None:
        self.engine.post(lambda: None)
        self.loop.run(until=self.loop.now + 0.05)

    @property
    def decisions(self) -> list[tuple]:
        out = []
        for event, args, _, _ in self.conductor.decisions:
            if event == "reserved":
                rid, _, needs_prefill, _, first_block, _ = args
                out.append(("reserved", rid, first_block, needs_prefill))
            elif event == "reserve_waiting":
                out.append(("waiting", args[0]))
        return out

    def statuses(self) -> dict:
        return {rid: r.status.name for rid, r in self.engine.scheduler.requests.items()}


@pytest.fixture
def real(tiny_llama_dir):
    return Real(tiny_llama_dir, lease_s=0.5)


def test_the_real_worker_and_the_simulator_make_the_same_decisions(real):
    sim = Sim()
    states = []

    def both(fn, *args) -> None:
        for side in (real, sim):
            getattr(side, fn)(*args)
        for side in (real, sim):
            side.boundary()
        states.append((real.statuses(), sim.statuses()))

    for rid in "abc":
        both("command", _reserve(rid))
    both("deliver", "a")
    real.lapse("b")
    both("command", KvFailed("b#0"))
    both("command", Abort("a"))
    both("deliver", "c")
    both("command", Abort("b"))
    both("command", Abort("c"))
    both("command", _reserve("d"))

    real_outcomes = [d for d in real.decisions if d[0] in ("delivered", "recompute")]
    # b: recomputed on the conductor's word; d: no KV to wait for, its last prompt token computed here
    assert real_outcomes == [("delivered", "a"), ("delivered", "c"), ("delivered", "d")]
    real_grants = [d for d in real.decisions if d[0] in ("reserved", "waiting")]
    assert real_grants == sim.decisions
    assert real_grants == [("reserved", "a", 0, True), ("reserved", "b", 0, True), ("waiting", "c"),
                           ("reserved", "c", 0, True), ("reserved", "d", 2, False)]
    for real_state, sim_state in states:
        assert real_state == sim_state
    assert states[4][0]["b"] == "DECODING"  # recomputed there after the lapse
    assert states[-1][0] == {"d": "DECODING"}


def test_the_real_and_the_simulated_worker_each_carry_out_every_request_command():
    membership = {"shutdown", "welcome", "release", "leave", "refused"}  # a worker process's, not a request's
    assert {c.kind for c in REQUEST_COMMANDS} == {kind for kind, cls in KINDS.items() if cls in Command} - membership
    for target in (WorkerCommands, SimCommands):
        assert [c.kind for c in REQUEST_COMMANDS if not callable(getattr(target, c.kind, None))] == [], target
