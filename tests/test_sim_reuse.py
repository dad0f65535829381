"""The simulator runs the real engine loop: same trace, same schedule as LLMEngine + FakeExecutor; and
fast-forwarding decode steps gives exactly the result of stepping one by one.

The first two tests replay the public Mooncake trace from `$PDSERVE_TRACES` (default: `shared/traces` next to
the repository, else /work/shared/traces, where a clone elsewhere on this machine finds it) and skip where
it is absent."""

from __future__ import annotations


import pytest

from pdserve.core.sched.schedule import SchedulerConfig
from pdserve.engine.executor import FakeExecutor
from pdserve.engine.llm_engine import LLMEngine
from pdserve.core.sampling_params import SamplingParams
from pdserve.sim.cluster import ClusterSpec, build, simulate
from pdserve.sim.hardware import get_gpu, get_model
from pdserve.sim.timemodel import RooflineTimeModel, StepShape
from pdserve.workloads import build_prompts, load_workload
from serve_util import TRACES

TRACE = TRACES / "mooncake_conversation_trace.jsonl"
needs_trace = pytest.mark.skipif(not TRACE.is_file(), reason=f"no Mooncake trace at {TRACE} "
                                 "(set PDSERVE_TRACES to the directory of the public traces)")
MODEL, GPU = get_model("llama-3-8b"), get_gpu("h100")
TOKEN = 13  # what SimExecutor samples


class ConstFake(FakeExecutor):
    """The real FakeExecutor (checks every KV read), sampling the simulator's constant token."""

    def next_token(self, context):
        return TOKEN


def _workload(n=24, length_scale=0.03):
    return load_workload(f"mooncake:{TRACE}", max_requests=n, length_scale=length_scale, time_scale=20.0,
                         max_input_len=800, max_output_len=200)


def _reference(workload, prompts, cfg, num_blocks, block_size, tm):
    """LLMEngine + FakeExecutor on a virtual clock (the engine's too: which cached block is evicted first
    depends on time, `kv_meta.StagedPolicy`): arrivals up to now join before each step."""
    executor = ConstFake(block_size=block_size, vocab_size=32000)
    engine = LLMEngine(executor, cfg, num_blocks, clock=lambda: clock)
    reqs, clock, i = workload.requests, 0.0, 0
    while i < len(reqs) or engine.has_unfinished():
        sched = engine.scheduler
        if sched.num_running + sched.num_waiting == 0:
            clock = max(clock, reqs[i].arrival_s)
        while i < len(reqs) and reqs[i].arrival_s <= clock:
            engine.add_request(prompts[i], SamplingParams(temperature=0.0, max_tokens=reqs[i].output_len,
                                                          ignore_eos=True), request_id=f"r{i}")
            i += 1
        if sched.num_running + sched.num_waiting == 0:
            continue
        engine.step()
        clock += tm.step_time(StepShape.of(executor.steps[-1]))
    return executor.steps


def _key(steps):
    return [[(c.request_id, c.start_pos, list(c.token_ids), c.block_ids, c.sample) for c in s.chunks]
            for s in steps if not s.is_empty]


@needs_trace
@pytest.mark.parametrize("num_blocks", [400, 90])  # 90: the pool is tight, the scheduler preempts
def test_colocated_schedule_is_the_real_engines(num_blocks):
    wl = _workload()
    spec = ClusterSpec(mode="colocated", num_instances=1, block_size=16, num_kv_blocks=num_blocks,
                       max_num_seqs=8, decode_budget=256, fast_forward=False,
                       host_kv_gb=0)  # the reference engine has no KV tiers
    tm = RooflineTimeModel(MODEL, GPU, 1)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=MODEL.max_model_len)
    ref = _reference(wl, build_prompts(wl, 32000), cfg, num_blocks, 16, tm)

    loop, conductor, engines = build(spec, MODEL, GPU, tm)
    engines[0].executor.history = []
    import pdserve.sim.cluster as cluster_mod
    orig = cluster_mod.build
    cluster_mod.build = lambda *a, **k: (loop, conductor, engines)
    try:
        run = simulate(wl, spec, MODEL, GPU, tm)
    finally:
        cluster_mod.build = orig
    assert all(r.ok for r in run.records)
    assert _key(engines[0].executor.history) == _key(ref)
    assert len(ref) > 20
    if num_blocks == 90:
        assert engines[0].scheduler.stats.num_preemptions > 0


def _records(run):
    return [(r.start_s, r.first_token_s, r.token_times, r.end_s, r.output_tokens, r.error) for r in run.records]


class WakingRoofline(RooflineTimeModel):
    """The roofline plus a wake-up cost: 1 ms per idle second, at most 4 ms."""

    def wake_time(self, idle_s: float, decode: bool = False) -> float:
        return min(idle_s, 4.0) * (0.5e-3 if decode else 1e-3)


@needs_trace
@pytest.mark.parametrize("mode,blocks,wake", [("colocated", 120, False), ("pd", 160, False), ("pd", None, False),
                                              ("pd", None, True), ("colocated", None, True)])
def test_fast_forward_equals_stepping(mode, blocks, wake):
    wl = _workload(n=30, length_scale=0.05)
    tm = (WakingRoofline if wake else RooflineTimeModel)(MODEL, GPU, 1)
    runs = []
    for ff in (False, True):
        spec = ClusterSpec(mode=mode, num_prefill=1, num_decode=2, num_instances=2, block_size=16,
                           num_kv_blocks=blocks, max_num_seqs=16, prefill_budget=512, decode_budget=512,
                           fast_forward=ff)
        runs.append(simulate(wl, spec, MODEL, GPU, tm))
    step, ff = runs
    assert _records(step) == _records(ff)
    # consumption errors are recorded when a fast-forward run closes, so in another order: same values
    # The consumption tail the conductor learns (`pdserve.conductor.consumption`) hears of a fast-forward
    # window's consumptions when the window closes, so its later refined predictions may differ slightly
    # (they order nothing: a prefilled transfer's rest is due now either way); everything else is identical.
    learnt = ("errors_s", "dispatch_errors_s", "checks")  # checks: each prediction's, on time or not
    life = [{k: v for k, v in vars(run.life).items() if k not in learnt} for run in (step, ff)]
    assert life[0] == life[1]
    assert sorted(step.life.dispatch_errors_s) == sorted(ff.life.dispatch_errors_s)
    assert step.life.checks.blocks_checked(0.0, "at_dispatch") == ff.life.checks.blocks_checked(0.0, "at_dispatch")
    assert len(step.life.errors_s) == len(ff.life.errors_s)
    (on_time, checked), (ff_on_time, ff_checked) = (run.life.checks.blocks_checked(0.0) for run in (step, ff))
    assert checked == ff_checked == step.life.blocks_consumed and abs(on_time - ff_on_time) <= 0.1 * checked
    assert [e["steps"] for e in step.engines] == [e["steps"] for e in ff.engines]
    assert [e["device_kv"] for e in step.engines] == [e["device_kv"] for e in ff.engines]
    assert sum(e["fast_forward_steps"] for e in ff.engines) > 0.2 * sum(e["steps"] for e in ff.engines
                                                                        if e["role"] != "prefill")
    assert all(r.ok for r in ff.records)


@pytest.mark.parametrize("mode,hops", [("pd", 4), ("colocated", 2)])
def test_control_latency_adds_its_message_hops_to_ttft_only(mode, hops):
    """PD: request -> decode worker, its reply -> gateway, prefill command, first token -> gateway; colocated:
    request and token. The decode steps themselves do not move, so TPOT stays."""
    wl = load_workload("fixed:200,8", num_requests=1)
    tm = RooflineTimeModel(MODEL, GPU, 1)
    recs = []
    for control_s in (0.0, 0.005):
        spec = ClusterSpec(mode=mode, num_prefill=1, num_decode=1, num_instances=1, control_latency_s=control_s)
        (rec,) = simulate(wl, spec, MODEL, GPU, tm).records
        recs.append(rec)
    base, slow = recs
    assert slow.first_token_s - slow.start_s == pytest.approx(base.first_token_s - base.start_s + hops * 0.005)
    gaps = [[b - a for a, b in zip(r.token_times, r.token_times[1:])] for r in recs]
    assert gaps[0] == pytest.approx(gaps[1]) and len(gaps[0]) == 7


@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_wake_up_time_lands_on_the_first_step_after_idle(mode):
    """Two requests 10 s apart: the second one's first step (its prefill) and, in PD, the decode worker's first
    step after its idle wait (a pure decode step: the decode table) pay `wake_time(idle)`; the first request
    (engines fresh at t=0) pays nothing."""
    from dataclasses import replace
    base_wl = load_workload("fixed:200,8", num_requests=2)
    wl = replace(base_wl, requests=[base_wl.requests[0], replace(base_wl.requests[1], arrival_s=10.0)])
    spec = ClusterSpec(mode=mode, num_prefill=1, num_decode=1, num_instances=1)
    plain = simulate(wl, spec, MODEL, GPU, RooflineTimeModel(MODEL, GPU, 1)).records
    woken = simulate(wl, spec, MODEL, GPU, WakingRoofline(MODEL, GPU, 1)).records
    ttft = [[r.first_token_s - r.start_s for r in recs] for recs in (plain, woken)]
    assert ttft[1][0] == pytest.approx(ttft[0][0], abs=1e-6)  # engines start awake (idle microseconds: ns)
    assert ttft[1][1] == pytest.approx(ttft[0][1] + 4e-3, abs=1e-6)  # idle ~10 s: the capped 4 ms
    gaps = [[b - a for a, b in zip(r.token_times, r.token_times[1:])] for r in (plain[1], woken[1])]
    if mode == "pd":  # the decode worker idled too: its first step for this request is 4 ms longer
        assert gaps[1][0] == pytest.approx(gaps[0][0] + 2e-3, abs=1e-6)  # (the woken prefill step's KV flows
        # over its whole, longer step: its landing moves by float rounding)
        assert gaps[1][1:] == pytest.approx(gaps[0][1:])
    else:
        assert gaps[1] == pytest.approx(gaps[0])


def test_the_event_loop_quiets_the_collector_only_while_it_runs():
    import gc

    from pdserve.sim.events import GC_YOUNG, EventLoop
    before, initial, seen = gc.get_threshold(), gc.get_freeze_count(), []
    loop = EventLoop()
    loop.at(1.0, lambda: seen.append((gc.get_threshold()[0], gc.get_freeze_count() > 0)))
    loop.run()
    assert seen == [(max(before[0], GC_YOUNG), True)]
    assert gc.get_threshold() == before and gc.get_freeze_count() == initial
    gc.freeze()  # a caller's own frozen objects stay frozen
    try:
        frozen = gc.get_freeze_count()
        EventLoop().run()
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_the_event_loop_does_not_keep_dead_cycles_through_its_run():
    """Dead cycles from before a run (an earlier candidate's simulation) are collected, not frozen with the
    set-up and left in the oldest generation (`pdserve plan` grew by each candidate's garbage)."""
    import gc
    import weakref

    from pdserve.sim.events import EventLoop

    class Node:
        pass

    def dead_cycle() -> weakref.ref:
        node = Node()
        node.self = node
        return weakref.ref(node)

    ref = dead_cycle()
    EventLoop().run()
    gc.collect(0)
    gc.collect(1)
    assert ref() is None
