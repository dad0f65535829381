"""The step budget: prefill tokens per step capped so the decoding requests of a tier with a TPOT SLO keep it
(`pdserve.core.sched.step_budget`), in the real scheduler and engine and in the simulator."""

from __future__ import annotations

import pytest

from pdserve.core.request import Request, RequestStatus
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.sched.schedule import ExecutorOutput, ScheduledChunk, SchedulerConfig, SchedulerOutput
from pdserve.core.service_tiers import ServiceTiers
from pdserve.core.sched.step_budget import HEADROOM, StepBudget
from pdserve.engine.executor import FakeExecutor
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sim.cluster import ClusterSpec, simulate
from pdserve.sim.hardware import get_gpu, get_model
from pdserve.sim.timemodel import make_time_model
from pdserve.workloads import load_workload

A, PER_TOKEN, PER_SEQ = 0.010, 0.002, 0.005  # the timed executor's step time model


def step_s(scheduled: SchedulerOutput) -> float:
    pt = sum(c.num_tokens for c in scheduled.chunks if c.num_tokens > 1)
    ds = sum(1 for c in scheduled.chunks if c.num_tokens == 1)
    return A + PER_TOKEN * pt + PER_SEQ * ds


class TimedFakeExecutor(FakeExecutor):
    """The fake executor, reporting a modelled duration per step as the simulator's does."""

    def execute(self, scheduled: SchedulerOutput) -> ExecutorOutput:
        out = super().execute(scheduled)
        return ExecutorOutput(out.sampled_token_ids, step_s(scheduled))


def _chunk(rid: str, n: int, start: int = 0) -> ScheduledChunk:
    return ScheduledChunk(rid, tuple(range(n)), start, (), n == 1, SamplingParams())


def _cap(budget: StepBudget, running: list[Request], start_pos: int = 0) -> int:
    budget.begin(running)
    return budget.take(budget.max_tokens, start_pos)


def test_the_cap_solves_the_fitted_step_time_for_the_tightest_decoding_slo():
    budget = StepBudget(ServiceTiers.from_specs(["priority:tpot_ms=100", "default:tpot_ms=400"]), 2048, 16)
    for pt in (32, 64, 128, 256, 512, 96, 200, 300, 48, 400):
        for ds in (0, 2):
            out = SchedulerOutput(tuple([_chunk("p", pt)] + [_chunk(f"d{i}", 1, 10) for i in range(ds)]))
            budget.observe(out, A + PER_TOKEN * pt + PER_SEQ * ds)
    budget.observe(SchedulerOutput((_chunk("d", 1, 5),)), 99.0)  # decode-only steps are not learned from
    decoding = [Request("p", [1] * 10, SamplingParams(), service_tier="priority"),
                Request("d", [1] * 10, SamplingParams(), service_tier="default")]
    for r in decoding:
        r.status = RequestStatus.DECODING
    # 0.85 * 100 ms - a - 2 decoding * 5 ms = 65 ms of prefill at 2 ms a token: 32 tokens
    cap = (HEADROOM * 0.1 - A - 2 * PER_SEQ) / PER_TOKEN
    assert _cap(budget, decoding) == pytest.approx(cap, abs=1) and budget.last_cap == pytest.approx(cap, abs=1)
    assert budget.take(100, 0) == 0  # the allowance is spent: a second chunk gets nothing this step
    assert _cap(budget, decoding[1:]) == pytest.approx((HEADROOM * 0.4 - A - PER_SEQ) / PER_TOKEN, abs=1)
    decoding[0].status = RequestStatus.PREFILLING  # prefilling requests have no TPOT yet
    assert _cap(budget, decoding[:1]) == 2048
    tight = StepBudget(ServiceTiers.from_specs(["priority:tpot_ms=1"]), 2048, 16)
    tight.fit = budget.fit
    decoding[0].status = RequestStatus.DECODING
    assert _cap(tight, decoding[:1]) == 16  # an SLO no step can keep: prompts still move, a block a step
    assert tight.take(16, 0) == 0  # (the first chunk only)
    assert _cap(StepBudget(ServiceTiers(), 2048, 16), decoding) == 2048  # no TPOT SLO: no cap


def test_a_chunk_deep_into_its_prompt_costs_more_and_gets_fewer_tokens():
    budget = StepBudget(ServiceTiers.from_specs(["priority:tpot_ms=100"]), 2048, 4)
    attend = 1e-6  # seconds per (token, prefix token) pair
    for i, (pt, start) in enumerate([(64, 0), (64, 512), (128, 1024), (32, 2048), (256, 0), (100, 300),
                                     (200, 3000), (50, 100), (80, 4000), (300, 700), (120, 0), (60, 1500)]):
        out = SchedulerOutput((_chunk("p", pt, start), _chunk("d", 1, 10)))
        budget.observe(out, A + PER_TOKEN * pt + attend * pt * start + PER_SEQ)
    decoding = [Request("d", [1] * 10, SamplingParams(), service_tier="priority")]
    decoding[0].status = RequestStatus.DECODING
    fresh, deep = _cap(budget, decoding, 0), _cap(budget, decoding, 4000)
    left = HEADROOM * 0.1 - A - PER_SEQ
    assert fresh == pytest.approx(left / PER_TOKEN, abs=1)
    assert deep == pytest.approx(left / (PER_TOKEN + attend * 4000), abs=1)


def _run(specs: tuple[str, ...]) -> tuple[LLMEngine, list[float], dict]:
    """A priority request decodes while 16 flex requests with long prompts arrive, one every third step."""
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4096, max_model_len=4096, service_tiers=specs)
    engine = LLMEngine(TimedFakeExecutor(block_size=4, vocab_size=1000), cfg, num_kv_blocks=4096)
    greedy = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    engine.add_request(list(range(5, 25)), greedy, "p", service_tier="priority")
    decode_steps: list[float] = []  # the priority request's steps, once the fit has enough (no SLO: all)
    final, step = {}, 0
    while engine.has_unfinished():
        warm = engine.scheduler.step_budget.fit.coefficients() is not None or not specs
        if step % 3 == 0 and step < 48:
            prompt = [(step * 7 + i) % 900 + 1 for i in range(150 + 20 * (step % 5))]
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), f"f{step}",
                               service_tier="flex")
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        scheduled = engine.executor.steps[-1]
        if warm and any(c.request_id == "p" and c.num_tokens == 1 for c in scheduled.chunks):
            decode_steps.append(step_s(scheduled))
        step += 1
    return engine, decode_steps, final


def test_a_priority_request_keeps_its_tpot_while_long_prompts_arrive():
    engine, decode_steps, final = _run(("priority:tpot_ms=60",))
    assert decode_steps and max(decode_steps) <= 0.060  # the cap aims at 0.85 x; the fit is close, not exact
    assert engine.scheduler.step_budget.num_capped_steps > 0
    assert len(final) == 17 and len(final["p"].token_ids) == 120  # every token right (the fake executor checks KV)
    # Without the SLO, the same arrivals put whole prompts into the steps it decodes in
    _, uncapped, final_uncapped = _run(())
    assert max(uncapped) > 0.3
    assert {r: o.token_ids for r, o in final.items()} == {r: o.token_ids for r, o in final_uncapped.items()}


def test_the_simulator_caps_steps_by_the_same_code():
    model, gpu = get_model("llama-3-8b"), get_gpu("a100-80g")
    workload = load_workload("fixed:4096,64", num_requests=24, rate=8.0, seed=1)
    tiers = ["priority" if i % 4 == 0 else "flex" for i in range(len(workload))]

    def priority_itls(specs: tuple[str, ...]) -> list[list[float]]:
        spec = ClusterSpec(mode="colocated", num_prefill=0, num_decode=1, tp=1, service_tiers=specs,
                           admission="off", host_kv_gb=0)
        run = simulate(workload, spec, model, gpu, make_time_model("roofline", model, gpu, 1), tiers=tiers)
        prio = [r for r, t in zip(run.records, tiers) if t == "priority" and r.ok]
        assert len(prio) == 6
        return [[b - a for a, b in zip(r.token_times, r.token_times[1:])] for r in prio]

    # The first two priority requests decode before the fit has its 8 prefill steps; every later one keeps
    # each inter-token time within the 40 ms, while without the SLO long prompts join its steps
    capped = priority_itls(("priority:tpot_ms=40",))
    assert all(max(itl) <= 0.040 for itl in capped[2:])
    assert all(max(itl) > 0.1 for itl in priority_itls(()))


def test_admission_predicts_tpot_within_the_step_budget():
    from pdserve.conductor.admission import WorkerModel
    model = WorkerModel()
    for i in range(32):  # a colocated worker busy with prefill: most of its time goes to prompt chunks
        pt = 200 + 10 * (i % 7)
        model.observe(pt, pt * pt, 4, 4 * 300, A + PER_TOKEN * pt + PER_SEQ * 4)
        model.observe(0, 0, 2 + i % 5, (2 + i % 5) * 300, A + PER_SEQ * (2 + i % 5))
    stretched = model.tpot_s(5)
    assert stretched > 0.1  # the decode step (~35 ms) stretched by the prefill share
    assert model.tpot_s(5, slo_s=0.1) == pytest.approx(HEADROOM * 0.1)  # the worker caps its steps at 0.85 x the SLO
    assert model.tpot_s(5, slo_s=0.01) == pytest.approx(model.decode_s(5))  # a decode step alone misses it


def test_a_waiting_priority_request_takes_the_capped_allowance_before_running_default_prefills():
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4096, max_model_len=8192,
                          service_tiers=("priority:tpot_ms=60", "default:tpot_ms=60"))
    engine = LLMEngine(TimedFakeExecutor(block_size=4, vocab_size=1000), cfg, num_kv_blocks=8192)
    engine.add_request(list(range(5, 25)), SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), "d0")
    for i in range(10):  # warm the fit: short default prompts, prefilled while d0 decodes
        engine.add_request([(i * 13 + k) % 900 + 1 for k in range(40 + 8 * i)],
                           SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), f"w{i}")
        engine.step()
        engine.step()
    assert engine.scheduler.step_budget.fit.coefficients() is not None
    while len(engine.scheduler.requests) > 1:  # (capped, they take a while) until d0 decodes alone
        engine.step()
    engine.add_request([k % 900 + 1 for k in range(3000)], SamplingParams(max_tokens=2, ignore_eos=True), "long")
    engine.step()
    engine.step()  # "long" is mid-prefill, a capped chunk a step
    assert engine.scheduler.requests["long"].status is RequestStatus.PREFILLING
    engine.add_request(list(range(300, 400)), SamplingParams(max_tokens=2, ignore_eos=True), "p",
                       service_tier="priority")
    engine.step()
    chunks = {c.request_id: c.num_tokens for c in engine.executor.steps[-1].chunks}
    assert chunks.get("p", 0) > 1 and "long" not in chunks and chunks["d0"] == 1
    while engine.has_unfinished():
        engine.step()


def test_a_ttft_slo_bounds_every_step_and_the_cold_start_uses_seconds_per_token():
    from pdserve.core.sched.step_budget import TTFT_SHARE
    budget = StepBudget(ServiceTiers.from_specs(["priority:ttft_ms=1000"]), 4096, 16)
    assert _cap(budget, []) == 4096  # no prefill step seen yet: nothing to predict with
    budget.observe(SchedulerOutput((_chunk("p", 400),)), A + PER_TOKEN * 400)
    # cold start: 0.25 x 1 s at the seconds per token seen (the fixed cost included), with nothing decoding
    cold = _cap(budget, [])
    assert cold == pytest.approx(TTFT_SHARE * 1.0 / (A / 400 + PER_TOKEN), abs=1)
    assert budget.num_cold_start_steps == 1  # counted: a fallback, shown in pdserve_fallbacks_total
    for _ in range(8):  # steps of what was granted, as the scheduler would run them
        budget.observe(SchedulerOutput((_chunk("p", cold),)), A + PER_TOKEN * cold)
        cold = _cap(budget, []) + (_ % 3) * 7  # (varied sizes, so the fit can separate a from b)
    assert _cap(budget, []) == pytest.approx((TTFT_SHARE * 1.0 - A) / PER_TOKEN, rel=0.05)  # the fit, warm
    assert StepBudget(ServiceTiers.from_specs(["flex"]), 4096, 16).active is False


def test_admission_never_predicts_a_step_faster_than_the_fastest_one_seen():
    # steps whose time the context explains better than a fixed cost: the fit's intercept comes out negative
    # and is dropped, so a tiny prompt alone would be predicted at next to nothing
    from pdserve.conductor.admission import WorkerModel
    model = WorkerModel()
    for i in range(32):
        model.observe(0, 0, 1, 100 + 50 * i, 0.010 + 0.0001 * (50 * i) - 0.004)
        model.observe(6, 36, 0, 0, 0.012)
    assert model.fit.coefficients()[0] == 0  # the intercept was dropped
    assert model.prefill_s(3) >= 0.006  # at least the fastest step seen (the first decode step: 6 ms)
    assert model.decode_s(1) >= 0.006
