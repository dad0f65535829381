"""One conductor, two clocks: the gateway's driver and the simulator's make the same decisions.

The simulator runs a PD cluster (2 prefill + 2 decode engines) with service tiers, SLOs and admission, and
records every event it fed the `ConductorCore` with the actions it got back. The same event sequence is then
fed to the real gateway conductor (`server/conductor_driver.py`) over real ZeroMQ sockets, on a clock that reads
the recorded times: every command each worker socket receives, every request refused or failed, and the
counted metrics must be what the simulator's core decided.
"""

from __future__ import annotations

import asyncio
from array import array
from collections import Counter

import msgpack
import pytest
import zmq
import zmq.asyncio

from pdserve.bench.metrics import RequestRecord
from pdserve.conductor.admission import Admission
from pdserve.conductor.recovery import HEARD_S, MAX_RENEW_S
from pdserve.server.conductor_driver import Conductor
from pdserve.conductor.actions import stale
from pdserve.conductor.conductor_core import ConductorCore, Count, Fail, Observe, Send
from pdserve.conductor.routing_policies import make_routing_policy
from pdserve.conductor.wire import Abort, KvFailed, Ready, Redirect, Renew, Reserve, from_dict, to_dict
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.service_tiers import ServiceTiers
from pdserve.server.metrics import Metrics
from pdserve.sim.cluster import ClusterSpec, build
from pdserve.sim.events import MESSAGE
from pdserve.sim.hardware import get_gpu, get_model
from pdserve.sim.timemodel import RooflineTimeModel

MODEL, GPU = get_model("llama-3-8b"), get_gpu("h100")
TIER_SPECS = ("priority:ttft_ms=400,share=0.25", "default:ttft_ms=150,tpot_ms=40", "flex:ttft_ms=60")
TIER_CYCLE = ("priority", "default", "flex", "default", "flex")
NUM = 90


def _simulate_and_record():
    spec = ClusterSpec(mode="pd", num_prefill=2, num_decode=2, max_num_seqs=8, num_kv_blocks=400,
                       service_tiers=TIER_SPECS, host_kv_gb=0)
    loop, conductor, _ = build(spec, MODEL, GPU, RooflineTimeModel(MODEL, GPU, 1))
    conductor.decisions = []
    records = []

    def arrive(i: int) -> None:
        # three shared prefixes, so routing has affinity to weigh; 2,048-token prompts queue up on prefill
        prompt = array("q", [1000 * (i % 3) + k for k in range(1024)] + [50_000 + 64 * i + k for k in range(1024)])
        records.append(RequestRecord(start_s=loop.now, prompt_tokens=len(prompt)))
        conductor.submit(f"r{i}", prompt, 24, records[-1], tier=TIER_CYCLE[i % len(TIER_CYCLE)])

    for i in range(NUM):
        loop.at(i * 0.015, arrive, i, prio=MESSAGE)
    loop.run()
    return conductor, records


def _replay_on_real_conductor(decisions, tmp_path, stage_blocks: dict, stage_max: dict, capacity: dict
                              ) -> tuple[dict, dict, Metrics]:
    """Feed the recorded events to the gateway's conductor; return the commands each worker socket got, the
    error events of refused or failed requests, and the metrics."""
    names = ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    now = [0.0]

    async def run():
        ctx = zmq.asyncio.Context()
        events = ctx.socket(zmq.PULL)
        events.bind(f"ipc://{tmp_path}/events")
        metrics = Metrics()
        conductor = Conductor(ctx, events, "pd", make_routing_policy("prefix-affinity"), metrics,
                              ServiceTiers.from_specs(TIER_SPECS), Admission(), clock=lambda: now[0])
        pulls = {}
        for name in names:
            pulls[name] = ctx.socket(zmq.PULL)
            pulls[name].bind(f"ipc://{tmp_path}/{name}.cmd")
            conductor.add_worker(name, name.split("-")[0], f"ipc://{tmp_path}/{name}.cmd")
            conductor.on_event(from_dict({"type": "ready", "worker": name, "role": name.split("-")[0], "block_size": 16,
                                "max_num_batched_tokens": 8192 if name.startswith("prefill") else 2048,
                                "stage_blocks": stage_blocks.get(name, 0), "stage_max_blocks": stage_max[name],
                                "kv_capacity_blocks": capacity[name]}))
        flights = {}
        for event, args, kwargs, _ in decisions:
            now[0] = _time_of(event, args)
            if event == "arrive":
                rid, prompt, params = args[0], list(args[1]), args[2]
                sp = SamplingParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in params.items()})
                flights[rid] = await conductor.submit(rid, prompt, sp, kwargs["priority"], None, kwargs["tier"])
            else:
                await _feed(conductor, event, args)
        got = {name: [] for name in names}
        await asyncio.sleep(0.2)
        for name, sock in pulls.items():
            while True:
                try:
                    got[name].append(msgpack.unpackb(await asyncio.wait_for(sock.recv(), 0.2)))
                except TimeoutError:
                    break
        last = {rid: f.events._queue[-1] for rid, f in flights.items() if not f.events.empty()}  # noqa: SLF001
        errors = {rid: e for rid, e in last.items() if e.get("type") == "error"}
        ctx.destroy(linger=0)
        return got, errors, metrics

    return asyncio.run(run())


def _time_of(event: str, args) -> float:
    return {"arrive": lambda: args[3], "prefilled": lambda: args[1], "token": lambda: args[3],
            "reserved": lambda: args[5], "consumed": lambda: args[1], "reserve_waiting": lambda: args[2],
            "staged": lambda: args[2]}.get(event, lambda: 0.0)()


async def _feed(conductor: Conductor, event: str, args) -> None:
    """The core event the simulator fed its core, as the worker event that makes the gateway feed it."""
    if event == "abort":
        await conductor.abort(args[0])
    else:
        conductor.on_event(from_dict(_worker_event(event, args)))


def _worker_event(event: str, args) -> dict:
    """The worker event (as it travels) that makes the gateway feed its core `event`."""
    if event == "reserved":
        rid, xfer, needs, addr, first, _ = args
        return {"type": "reserved", "rid": rid, "xfer": xfer, "needs_prefill": needs, "kv_addr": addr,
                "first_block": first}
    if event == "prefilled":
        return {"type": "prefilled", "rid": args[0], "failed": None, "landing_in_s": args[2]}
    if event == "consumed":
        return {"type": "consumed", "items": [[args[0], args[1]]]}
    if event == "token":
        rid, index, finished, _ = args
        return {"type": "tokens", "items": [{"rid": rid, "i": index, "t": 7, "fin": "length" if finished else None}]}
    if event == "worker_steps":
        return {"type": "stats", "worker": args[0], "role": args[0].split("-")[0], "values": {
            "steps": [list(s) for s in args[1]], "running": 0, "waiting": 0, "blocks_used": 0, "blocks_total": 400,
            "prompt_tokens": 0, "prefill_cap": args[2] if len(args) > 2 else None}}
    if event == "worker_cache":
        return {"type": "kv_cache", "worker": args[0], "stored": args[1], "evicted": args[2]}
    if event == "worker_links":
        return {"type": "stats", "worker": args[0], "role": "prefill", "values": {
            "kv_links": args[1], "running": 0, "waiting": 0, "blocks_used": 0, "blocks_total": 400, "prompt_tokens": 0}}
    if event == "reserve_waiting":
        return {"type": "reserve_waiting", "rid": args[0], "xfer": args[1]}
    if event == "staged":
        return {"type": "staged", "rid": args[0], "ok": args[1]}
    raise AssertionError(f"unexpected event {event}")


def _plain(value):
    if isinstance(value, array | tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def test_gateway_and_simulator_drivers_make_the_same_decisions(tmp_path):
    sim, records = _simulate_and_record()
    decisions = sim.decisions
    kinds = Counter(event for event, *_ in decisions)
    assert kinds["arrive"] == NUM and kinds["reserved"] > 0 and kinds["prefilled"] > 0 and kinds["worker_steps"] > 8
    sent: dict[str, list] = {}
    failed, counted, observed = {}, Counter(), Counter()
    for _, _, _, actions in decisions:
        for a in actions:
            if isinstance(a, Send):
                sent.setdefault(a.worker, []).append(_plain(to_dict(a.cmd)))
            elif isinstance(a, Fail):
                failed[a.rid] = (a.status, a.code)
            elif isinstance(a, Count):
                counted[(a.metric, a.labels)] += 1
            elif isinstance(a, Observe):  # a histogram with negative buckets has no _sum: count those
                signed = a.metric.startswith("kv_") or a.metric == "prediction_error"
                observed[(a.metric, a.labels)] += a.weight if signed else a.value
    rejected = [r for r in records if r.rejected]
    assert rejected and len(rejected) < NUM, "the workload must make admission refuse some requests, not all"
    assert {sim_cmd["type"] for cmds in sent.values() for sim_cmd in cmds} >= {"reserve", "prefill"}

    # the decode engines fill up: idle prefill engines stage the prompts waiting for room
    assert kinds["reserve_waiting"] > 0 and kinds["staged"] > 0
    assert any(c["type"] == "stage" for cmds in sent.values() for c in cmds)
    capacity = {name: load.max_recent_blocks for name, load in sim.core.workers.items()}
    got, errors, metrics = _replay_on_real_conductor(decisions, tmp_path, sim.core.staging.plan.blocks, sim.core.staging.plan.max_blocks,
                                                     capacity)
    for name in got:
        assert got[name] == sent.get(name, []), name
    assert {rid: (e["status"], e["code"]) for rid, e in errors.items()} == failed
    for (metric, labels), n in counted.items():
        value = metrics.registry.get_sample_value(f"pdserve_{metric}_total", dict(labels))
        assert value == n, (metric, labels)
    assert observed  # admission's predictions, one per arrival once the workers' step times are known
    assert observed[("prediction_error", (("service_tier", "default"),))] > 0  # checked at first tokens
    assert counted[("fallbacks", (("kind", "admission_unpredicted"),))] > 0  # the first arrivals: no model yet
    # the consumption predictions, checked per delivered block
    assert {metric for metric, _ in observed} >= {"kv_consumption_error", "kv_consumption_error_at_dispatch"}
    for (metric, labels), total in observed.items():
        name = f"pdserve_{metric}_seconds_count" if metric.startswith("kv_") else \
            f"pdserve_admission_{metric}_seconds_count" if metric == "prediction_error" else \
            f"pdserve_admission_{metric}_seconds_sum"
        value = metrics.registry.get_sample_value(name, dict(labels))
        assert value == pytest.approx(total), (metric, labels)


def test_core_refuses_with_no_live_worker_and_fails_requests_of_a_dead_decode_worker():
    core = ConductorCore("pd", make_routing_policy("least-loaded"))
    core.add_worker("prefill-0", "prefill")
    core.add_worker("decode-0", "decode")
    actions = core.arrive("a", list(range(40)), {}, 0.0)
    (send,) = actions
    assert send == Send("decode-0", Reserve("a", list(range(40)), {}, "a#0", priority=0, pin=None, tier="default"))
    # the prefill worker dies before the reservation is granted: the decode worker recomputes
    assert Send("decode-0", KvFailed("a#0", "prefill_gone")) in core.worker_died("prefill-0")
    assert core.reserved("a", "a#0", True, "addr", 0) == [Count("fallbacks", (("kind", "no_prefill_worker"),)),
                                                          Send("decode-0", KvFailed("a#0", "no_prefill_worker"))]
    died = core.worker_died("decode-0")
    assert [a for a in died if isinstance(a, Fail)] == [Fail("a", 503, "worker decode-0 died while serving this "
                                                              "request and no live worker is left to move it "
                                                              "to", "worker_died")]
    assert core.flights == {} and core.workers["decode-0"].outstanding == 0
    (count, fail) = core.arrive("b", [1, 2, 3], {}, 1.0)
    assert fail.status == 503 and fail.code == "no_worker"


def test_a_dead_decode_workers_request_moves_with_its_outputs_and_goes_on_numbered_after_them():
    core = ConductorCore("pd", make_routing_policy("least-loaded"))
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")):
        core.add_worker(name, role)
    core.arrive("a", list(range(40)), {"max_tokens": 10, "grammar": "g"}, 0.0)
    assert core.flights["a"].decode == "decode-0"
    core.reserved("a", "a#0", True, "addr-0", 0, 0.1)
    core.prefilled("a", 0.2)
    for i, tok in enumerate((7, 8, 9)):
        core.token("a", i, False, 0.3 + i, tok)
    died = core.worker_died("decode-0", 5.0)
    assert Count("requests_migrated", (("reason", "worker_died"), ("source", "recompute"))) in died
    (reserve,) = [a for a in died if isinstance(a, Send)]
    assert reserve.worker == "decode-1" and reserve.cmd.prompt == list(range(40)) + [7, 8, 9]
    assert reserve.cmd.params == {"max_tokens": 7, "grammar": "g", "grammar_replay": 3}  # (outputs in prompt)
    assert reserve.cmd.xfer == "a#1"
    f = core.flights["a"]
    assert f.prefill == "prefill-0" and f.first_token_s == 0.3 and f.num_tokens == 3
    assert core.workers["decode-0"].outstanding == 0 and core.backlog["decode-0"].decoding == 0
    core.reserved("a", "a#1", True, "addr-1", 0, 5.1)
    core.prefilled("a", 5.2)
    core.token("a", 3, False, 5.3, 10)  # the driver numbers the new worker's tokens after the 3 streamed
    assert f.outputs == [7, 8, 9, 10] and core.backlog["decode-1"].decoding == 1
    core.token("a", 9, True, 6.0, 16)
    assert core.flights == {} and core.workers["decode-1"].outstanding == 0
    assert core.backlog["decode-1"].decoding == 0 and core.workers["prefill-0"].outstanding == 0


def _dispatched() -> ConductorCore:
    """A PD core with request "a" reserved on decode-0 and its prompt dispatched to prefill-0."""
    core = ConductorCore("pd", make_routing_policy("least-loaded"))
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        core.add_worker(name, role)
    core.arrive("a", list(range(40)), {"max_tokens": 4}, 0.0)
    core.reserved("a", "a#0", True, "addr-0", 0, 0.1)
    return core


def test_a_delivery_given_up_after_the_prefill_keeps_who_prefilled_it():
    core = _dispatched()
    core.prefilled("a", 0.2)
    core.prefilled("a", 0.9, failed=True)  # its sender gave the delivery up later (reported again)
    f = core.flights["a"]
    assert f.prefilled_by == "prefill-0" and f.gave_up and core.workers["prefill-0"].outstanding == 0


def test_a_prefill_report_that_comes_after_the_first_token_keeps_who_prefilled_and_when():
    core = _dispatched()
    f = core.flights["a"]
    assert f.dispatched_s is not None
    core.token("a", 0, False, 0.5, 7)  # the decode worker's first token overtook the prefill worker's report
    core.prefilled("a", 0.7)
    assert (f.prefilled_by, f.prefilled_s, f.first_token_s) == ("prefill-0", 0.5, 0.5)
    assert core.workers["prefill-0"].outstanding == 0


def test_a_dead_decode_workers_checkpointed_request_moves_with_a_restore_of_its_checkpoint():
    core = ConductorCore("pd", make_routing_policy("least-loaded"))
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")):
        core.add_worker(name, role)
    core.arrive("a", list(range(40)), {"max_tokens": 30}, 0.0)
    core.reserved("a", "a#0", True, "addr-0", 0, 0.1)
    core.prefilled("a", 0.2)
    for i in range(20):
        core.token("a", i, False, 0.3 + i, 100 + i)
    core.checkpointed("a", "decode-1", 48)  # not its worker: ignored
    core.checkpointed("a", "decode-0", 56)
    core.checkpointed("a", "decode-0", 48)  # an older report: the newest stays
    died = core.worker_died("decode-0", 30.0)
    assert Count("requests_migrated", (("reason", "worker_died"), ("source", "checkpoint"))) in died
    (reserve,) = [a for a in died if isinstance(a, Send)]
    assert reserve.worker == "decode-1" and reserve.cmd.restore == {"peer": "decode-0", "tokens": 56}
    assert reserve.cmd.prompt == list(range(40)) + [100 + i for i in range(20)]
    f = core.flights["a"]
    assert f.checkpoint == 0 and f.restore == {"peer": "decode-0", "tokens": 56}
    # the decode worker has every token but the checkpoint's tail: no prefill is dispatched
    assert core.reserved("a", reserve.cmd.xfer, False, "addr-1", 3, 30.1) == []
    assert core.workers["prefill-0"].outstanding == 0
    # without a newer checkpoint, a second move restores from the first dead worker's files again
    core.token("a", 20, False, 31.0, 120)
    core.add_worker("decode-2", "decode")
    (again,) = [a for a in core.worker_died("decode-1", 32.0) if isinstance(a, Send)]
    assert again.worker == "decode-2" and again.cmd.restore == {"peer": "decode-0", "tokens": 56}


def test_with_no_live_worker_a_moved_request_waits_for_the_restarted_one_unless_its_client_left():
    core = ConductorCore("colocated", make_routing_policy("least-loaded"))
    core.add_worker("colocated-0", "colocated")
    for rid in ("a", "b"):
        core.arrive(rid, [1, 2, 3], {"max_tokens": 5}, 0.0)
        core.token(rid, 0, False, 0.1, 7)
    died = core.worker_died("colocated-0", 1.0, restarting=True)
    assert not [a for a in died if isinstance(a, Fail)] and [o.rid for o in core.recovery.orphans] == ["a", "b"]
    assert core.abort("b") == [] and [o.rid for o in core.recovery.orphans] == ["a"]  # its client left meanwhile
    (generate,) = core.worker_ready("colocated-0", Ready("colocated-0", "colocated"))
    assert generate.cmd.prompt == [1, 2, 3, 7] and generate.cmd.params == {"max_tokens": 4}
    assert core.recovery.orphans == [] and core.books.waiting == {"default": 1}
    core.worker_died("colocated-0", 2.0)  # and it stays dead this time: nothing waits for it
    assert core.recovery.orphans == [] and core.flights == {}


def test_a_request_whose_streamed_tokens_are_unknown_fails_explicitly_when_its_worker_dies():
    core = ConductorCore("colocated", make_routing_policy("least-loaded"))
    core.add_worker("colocated-0", "colocated")
    core.add_worker("colocated-1", "colocated")
    core.arrive("a", [1, 2, 3], {"max_tokens": 5}, 0.0)
    core.token("a", 0, False, 0.1)  # a simulator: no token ids
    died = core.worker_died(core.flights["a"].decode, 1.0)
    assert [a.code for a in died if isinstance(a, Fail)] == ["worker_died"] and core.flights == {}


def test_a_tiers_waiting_queue_is_bounded_and_a_first_token_makes_room():
    core = ConductorCore("colocated", make_routing_policy("least-loaded"), max_queue=2)
    core.add_worker("colocated-0", "colocated")
    core.arrive("a", [1, 2], {"max_tokens": 4}, 0.0)
    core.arrive("b", [1, 2], {"max_tokens": 4}, 0.0)
    refused = core.arrive("c", [1, 2], {"max_tokens": 4}, 0.0)
    (fail,) = [a for a in refused if isinstance(a, Fail)]
    assert (fail.status, fail.code, fail.retry_after_s) == (429, "server_overloaded", 1.0)
    assert core.arrive("f", [1, 2], {"max_tokens": 4}, 0.0, tier="flex")[0].cmd.kind == "generate"
    # a sibling of an admitted request (n > 1) is admitted with it, full queue or not, on its workers
    assert core.arrive("b-1", [1, 2], {"max_tokens": 4}, 0.0, follow=("colocated-0",))[0].cmd.kind == "generate"
    core.abort("b-1")
    core.token("a", 0, False, 0.1, 5)  # a is running now: one waits
    assert core.arrive("c", [1, 2], {"max_tokens": 4}, 0.2)[0].cmd.kind == "generate"
    core.abort("b")
    core.token("a", 3, True, 0.3, 6)
    assert core.books.waiting == {"default": 1, "flex": 1}


def test_core_counts_slo_attainment_per_tier():
    tiers = ServiceTiers.from_specs(["default:ttft_ms=100,tpot_ms=10"])
    core = ConductorCore("colocated", make_routing_policy("least-loaded"), tiers)
    core.add_worker("colocated-0", "colocated")
    for rid, first, last in (("fast", 0.05, 0.05 + 3 * 0.009), ("late", 0.2, 0.2 + 3 * 0.009),
                             ("slow", 0.05, 0.05 + 3 * 0.02)):
        core.arrive(rid, [1, 2, 3], {}, 0.0)
        assert core.token(rid, 0, False, first) == []
        ended = core.token(rid, 3, True, last)
        assert ended == ([Count("slo_attained", (("service_tier", "default"),))] if rid == "fast" else [])
    assert core.flights == {} and core.workers["colocated-0"].outstanding == 0


def test_an_abort_reaches_the_prefill_worker_while_it_prefills_and_not_after():
    core = ConductorCore("pd", make_routing_policy("least-loaded"))
    core.add_worker("prefill-0", "prefill")
    core.add_worker("decode-0", "decode")
    for rid in ("a", "b"):
        core.arrive(rid, list(range(40)), {}, 0.0)
        core.reserved(rid, f"{rid}#{'ab'.index(rid)}", True, "addr", 0)
    core.prefilled("b", 0.5)
    assert core.abort("a") == [Send("decode-0", Abort("a")),
                               Send("prefill-0", Abort("a"))]
    assert core.abort("b") == [Send("decode-0", Abort("b"))]
    assert core.abort("b") == [] and all(w.outstanding == 0 for w in core.workers.values())


def test_backlog_counts_uncached_prompt_tokens_until_the_first_token():
    core = ConductorCore("colocated", make_routing_policy("least-loaded"), block_size=16)
    core.add_worker("colocated-0", "colocated")
    core.arrive("a", list(range(64)), {}, 0.0, tier="priority")
    assert core.backlog["colocated-0"].tokens == {0: 64, 1: 0}
    core.arrive("b", list(range(64)) + [7] * 16, {}, 0.0)  # its first 4 blocks were just sent there
    assert core.backlog["colocated-0"].tokens == {0: 64, 1: 16}
    core.token("a", 0, False, 0.1)
    assert core.backlog["colocated-0"].tokens == {0: 0, 1: 16} and core.backlog["colocated-0"].decoding == 1
    core.abort("b")
    core.token("a", 1, True, 0.2)
    assert core.backlog["colocated-0"].tokens == {0: 0, 1: 0} and core.backlog["colocated-0"].decoding == 0


def test_a_dead_prefill_workers_prompts_move_to_another_prefill_worker():
    core = ConductorCore("pd", make_routing_policy("least-loaded"))
    for name, role in (("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")):
        core.add_worker(name, role)
    prompt = list(range(40))
    core.arrive("a", prompt, {}, 0.0)  # reserved and dispatched to prefill-0
    (dispatch,) = core.reserved("a", "a#0", True, "addr", 1, 0.1)
    assert dispatch.worker == "prefill-0" and dispatch.cmd.xfer == "a#0" and dispatch.cmd.first_block == 1
    core.arrive("b", list(range(100, 140)), {}, 0.2)  # routed to prefill-1, not reserved yet
    assert core.flights["b"].prefill == "prefill-1"
    actions = core.worker_died("prefill-0", 0.3)
    # a: a new transfer into the same reserved blocks, from prefill-1; counted
    assert Count("kv_recovery", (("choice", "redispatch"),)) in actions
    redirect = [a for a in actions if isinstance(a, Send) and a.cmd.kind == "redirect"]
    new = core.flights["a"].xfer
    assert redirect == [Send("decode-0", Redirect("a#0", new))]
    # prefill-1 is sent the prompt once the decode worker expects the new transfer (its `reserved`)
    assert not [a for a in actions if isinstance(a, Send) and a.cmd.kind == "prefill"]
    assert core.reserved("a", "a#0", True, "addr", 1, 0.31) == stale("reserved")  # the old transfer's: counted
    (prefill,) = core.reserved("a", new, True, "addr", 1, 0.32)
    assert prefill.worker == "prefill-1" and prefill.cmd.kind == "prefill" and prefill.cmd.xfer == new != "a#0"
    assert prefill.cmd.dest == "addr" and prefill.cmd.first_block == 1
    assert core.backlog["prefill-0"].tokens == {0: 0, 1: 0} and core.workers["prefill-1"].outstanding == 2
    # the last prefill worker dies: nowhere to move them, the decode worker recomputes both
    actions = core.worker_died("prefill-1", 0.4)
    assert actions.count(Count("kv_recovery", (("choice", "recompute"),))) == 2
    assert {a.cmd.xfer for a in actions if isinstance(a, Send)} == {core.flights["a"].xfer, "b#1"}
    assert all(a.cmd.kind == "kv_failed" for a in actions if isinstance(a, Send))


def test_a_lapsed_lease_moves_the_prompt_off_the_stalled_prefill_worker_until_it_reports_again():
    core = ConductorCore("pd", make_routing_policy("least-loaded"))
    for name, role in (("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")):
        core.add_worker(name, role)
    core.arrive("a", list(range(40)), {}, 0.0)
    core.reserved("a", "a#0", True, "addr", 0, 0.1)  # dispatched to prefill-0, which then goes silent
    # not its current transfer: nothing but a count
    assert core.transfer_outcome("a", "held", "stale#9", 2.0) == stale("transfer")
    actions = core.transfer_outcome("a", "held", "a#0", 2.1)
    assert Count("kv_leases_lapsed", (("worker", "prefill-0"),)) in actions
    assert Send("prefill-0", Abort("a")) in actions
    assert Count("kv_recovery", (("choice", "redispatch"),)) in actions
    new = core.flights["a"].xfer
    assert Send("decode-0", Redirect("a#0", new)) in actions
    (prefill,) = core.reserved("a", new, True, "addr", 0, 2.15)  # the decode worker expects it now
    assert prefill.worker == "prefill-1" and prefill.cmd.xfer == new
    # stalled: routing passes prefill-0 by, even when prefill-1 is busier
    core.arrive("b", list(range(100, 140)), {}, 2.2)
    assert core.flights["b"].prefill == "prefill-1"
    core.worker_steps("prefill-0", [])  # it reports again
    core.arrive("c", list(range(200, 240)), {}, 3.0)
    assert core.flights["c"].prefill == "prefill-0"
    # prefilled, yet the KV never arrived whole: only the decode worker can recompute it
    core.prefilled("a", 3.1)
    actions = core.transfer_outcome("a", "held", new, 5.0)
    assert actions == [Count("kv_recovery", (("choice", "recompute"),)),
                       Send("decode-0", KvFailed(new, "failed_timeout"))]


def test_a_lapsed_lease_of_a_sender_heard_lately_is_renewed_for_a_bounded_time():
    """A lease lapses while its sender's process was heard within HEARD_S (heartbeats from a busy worker):
    renewed, not moved, for up to MAX_RENEW_S after the first lapse; a sender not heard (stopped) is stalled."""
    core = ConductorCore("pd", make_routing_policy("least-loaded"))
    for name, role in (("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")):
        core.add_worker(name, role)
    core.arrive("a", list(range(40)), {}, 0.0)
    core.reserved("a", "a#0", True, "addr", 0, 0.1)  # dispatched to prefill-0
    renew = [Count("kv_lease_extensions", (("worker", "prefill-0"),)), Send("decode-0", Renew("a#0"))]
    for t in (2.0, 3.0, 2.0 + MAX_RENEW_S):
        core.workers["prefill-0"].heard_s = t - HEARD_S  # its heartbeat, a moment before the lapse
        assert core.transfer_outcome("a", "held", "a#0", t) == renew
    assert core.flights["a"].xfer == "a#0" and core.workers["prefill-0"].usable
    core.workers["prefill-0"].heard_s = 122.5
    actions = core.transfer_outcome("a", "held", "a#0", 123.0)  # heard, but silent too long: it moves
    assert Count("kv_leases_lapsed", (("worker", "prefill-0"),)) in actions and core.workers["prefill-0"].stalled
    assert Count("kv_recovery", (("choice", "redispatch"),)) in actions
    core.arrive("b", list(range(100, 140)), {}, 124.0)
    core.reserved("b", "b#2", True, "addr", 0, 124.1)
    assert core.flights["b"].prefill == "prefill-1"
    core.workers["prefill-1"].heard_s = 124.0  # stopped since: last heard more than HEARD_S before the lapse
    actions = core.transfer_outcome("b", "held", "b#2", 124.0 + HEARD_S + 0.01)
    assert Count("kv_leases_lapsed", (("worker", "prefill-1"),)) in actions
    core.prefilled("a", 126.0)  # prefilled by prefill-1 (a new transfer: its own bound), its KV late: heard
    core.workers["prefill-1"].heard_s = 126.5
    new = core.flights["a"].xfer
    assert core.transfer_outcome("a", "held", new, 127.0) == [
        Count("kv_lease_extensions", (("worker", "prefill-1"),)), Send("decode-0", Renew(new))]
    core.worker_steps("prefill-1", [])  # it reports again: usable
    core.arrive("c", list(range(200, 240)), {}, 128.0)
    core.reserved("c", "c#3", True, "addr", 0, 128.1)
    assert core.flights["c"].prefill == "prefill-1"
    # its worker gave up sending (heard, yet nothing more will come): the decode worker recomputes at once,
    # not after its lease lapses (issue 40: a transfer that cannot start fails fast, with its reason)
    assert core.prefilled("c", 129.0, failed=True)[:2] == [
        Count("kv_recovery", (("choice", "recompute"),)), Send("decode-0", KvFailed("c#3", "failed_send"))]
    core.workers["prefill-1"].heard_s = 130.5
    assert core.transfer_outcome("c", "held", "c#3", 131.0) == []  # (a lapse crossing that choice: decided)


def test_a_relanded_transfer_is_predicted_again_and_checked_against_each_prediction():
    core = ConductorCore("pd", make_routing_policy("least-loaded"))
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        core.add_worker(name, role)
    core.arrive("a", list(range(64)), {}, 0.0)
    core.reserved("a", "a#0", True, "addr", 0, 0.1)
    core.prefilled("a", 1.0, 0.5)  # its last chunk leaves in 0.5 s: predicted consumed at 1.5
    assert core.relanded("a", 1.2, 0.8) == [Count("kv_prediction_refinements", (("service_tier", "default"),))]
    assert core.relanded("nobody", 1.2, 0.8) == stale("relanded")
    errors = {o.metric: o.value for o in core.consumed("a", 2.003)}
    assert errors == pytest.approx({"kv_consumption_error": 0.003, "kv_consumption_error_at_prefilled": 0.503})


def test_a_renewed_transfer_lapsing_again_is_one_failure_in_the_metrics():
    """The decode worker reports every lapse (the conductor decides each time); `pdserve_kv_transfer_failures`
    counts the transfer's failure once: its later lapses (`lapses` > 1) are not new failures."""
    metrics = Metrics()
    event = {"type": "transfer", "rid": "r", "xfer": "r#0", "outcome": "held", "state": "failed_timeout",
             "bytes": 0, "seconds": 1.0, "worker": "decode-0"}
    for lapses in (1, 2, 3):
        metrics.observe_transfer(from_dict({**event, "lapses": lapses}))
    metrics.observe_transfer(from_dict({**event, "outcome": "recompute", "lapses": 3}))
    got = metrics.registry.get_sample_value
    assert got("pdserve_kv_transfer_failures_total", {"reason": "failed_timeout", "outcome": "held"}) == 1
    assert got("pdserve_kv_transfer_failures_total", {"reason": "failed_timeout", "outcome": "recompute"}) == 1


def test_a_bursts_second_request_waits_for_all_of_the_first_ones_step_and_less_once_it_has_run():
    """The conductor's clock of each prefill worker's step (`Backlog.busy_s`): it starts when an idle worker
    gets a prompt and again at each prompt prefilled there, and admission's prediction counts what is left of it."""
    from tests.test_bite_admission import admission
    adm = admission()
    core = ConductorCore("pd", make_routing_policy("least-loaded"), ServiceTiers.from_specs(("default:ttft_ms=1e6",)),
                         adm, idle_prewarm=False)
    core.add_worker("p", "prefill")
    core.add_worker("d", "decode")
    prompt = lambda k: [k * 1000 + i for i in range(512)]  # noqa: E731
    core.arrive("a", prompt(1), {}, 10.0)
    alone = adm.last_ttft_s
    core.arrive("b", prompt(2), {}, 10.001)  # 1 ms into a's step: all of it is ahead
    step = adm.model("p").prefill_s(512, prompt=512)
    assert adm.last_ttft_s == pytest.approx(alone + step - 0.001, rel=1e-6)
    core.reserved("a", core.flights["a"].xfer, True, "addr", 0, 10.002)
    core.prefilled("a", 10.0 + step)  # a's step ended: b's began
    core.arrive("c", prompt(3), {}, 10.0 + 1.5 * step)  # b's step is half done
    assert adm.last_ttft_s == pytest.approx(alone + 0.5 * step, rel=1e-6)


def test_the_prefill_command_carries_when_its_kv_would_be_read_were_the_link_free():
    """`read_in_s` (what `--kv-wire-dtype auto` weighs the link's backlog against) is the deadline without the
    decode worker's learned delivery tail: on a backed-up link that tail holds the link's past waits."""
    from tests.test_bite_admission import admission
    adm = admission()
    adm.observe_delivery("d", 3.0)  # the link was slow: the tail learnt is ~0.6 s, far over a decode step
    core = ConductorCore("pd", make_routing_policy("least-loaded"), admission=adm, idle_prewarm=False)
    core.add_worker("p", "prefill")
    core.add_worker("d", "decode")
    core.arrive("a", list(range(512)), {}, 0.0)
    [send] = [a for a in core.reserved("a", core.flights["a"].xfer, True, "addr", 0, 0.1) if isinstance(a, Send)]
    cmd = send.cmd
    tail, first_step = adm.model("d").delivery_s, adm.first_step_s("d", 0)
    assert cmd.deadline_in_s - cmd.read_in_s == pytest.approx(tail - first_step, rel=1e-6)
    assert cmd.read_in_s == pytest.approx(adm.predict_prefill_s("p", 512, 0, 0) + first_step, rel=1e-6)
