"""Role switching (issue 17): the planner's split, forecast and hysteresis (`pdserve.core.role_planner`), and the
simulator moving engines between prefill and decode as a load shifts from prompt-heavy to output-heavy — the
conductor core's decision (`plan_roles`), the same code the gateway drives."""

from __future__ import annotations

from pdserve.conductor.wire import Ready
from pdserve.core.role_planner import RoleLoad, RolePlanner, best_split, utilization
from pdserve.sim.cluster import ClusterSpec, simulate
from pdserve.sim.hardware import get_gpu, get_model
from pdserve.sim.timemodel import RooflineTimeModel
from pdserve.workloads import RequestSpec, Workload


def test_best_split_balances_the_busier_role():
    load = RoleLoad(prefill_tokens_s=30_000, decode_tokens_s=1_000, prefill_capacity=10_000, decode_capacity=2_000)
    assert best_split(4, load) == 3  # 1.0 vs 0.5 per decode worker: prefill needs the workers
    assert best_split(4, RoleLoad(1_000, 6_000, 10_000, 2_000)) == 1
    assert utilization(load, 3, 1) == 1.0 and utilization(load, 1, 3) == 3.0


def test_the_forecast_follows_a_trend_and_a_move_needs_load_hold_and_cooldown():
    planner = RolePlanner(interval_s=10, horizon_s=30, hold_s=20, cooldown_s=100)

    def feed(until: int) -> None:  # prompt tokens/s growing 100/s each second; few outputs
        for t in range(feed.t, until):
            planner.arrived(float(t), 1000 + 100 * t, 1)
        feed.t = until
    feed.t = 0
    feed(60)
    prompt_s, _ = planner.forecast(60.0)
    # ahead of the last bucket's mean rate (1000 + 100 x 54.5): the trend carried forward (damped)
    assert prompt_s > 1000 + 100 * 54.5
    # a light load moves nothing, however unbalanced the split
    assert RolePlanner(hold_s=0).decide(0.0, 1, 3, 1e9, 1e9) is None
    caps = (2_000.0, 100_000.0)  # prefill the bottleneck
    assert planner.decide(60.0, 1, 3, *caps) is None  # wanted, not yet held
    feed(75)
    assert planner.decide(75.0, 1, 3, *caps) is None
    feed(81)
    assert planner.decide(81.0, 1, 3, *caps) == "prefill"  # held 21 s
    assert planner.decide(82.0, 1, 3, *caps) == "prefill"  # the driver could not move one: still wanted
    planner.started("prefill")
    feed(90)
    planner.moved(90.0)  # the moved worker serves as prefill
    feed(105)
    assert planner.decide(105.0, 2, 2, *caps) is None  # a second move the same way is held again from scratch
    feed(126)
    assert planner.decide(126.0, 2, 2, *caps) == "prefill"  # ... but waits for no cooldown
    planner.finished(100, 25)
    assert 0.9 < planner.output_share < 1.0  # requests use less than they ask for: the demand follows


def test_a_move_back_waits_for_the_cooldown_after_the_last_one_completed():
    planner = RolePlanner(interval_s=10, horizon_s=30, hold_s=10, cooldown_s=100)
    caps = (100_000.0, 2_000.0)

    def at(t: int) -> str | None:
        for s in range(at.t, t):
            planner.arrived(float(s), 100, 5000)  # outputs are the load
        at.t = t
        return planner.decide(float(t), 2, 2, *caps)
    at.t = 0
    planner.started("prefill")  # the last move went the other way
    planner.moved(50.0)
    assert at(60) is None
    assert at(75) is None  # held, but within the cooldown of a reversal
    assert at(151) == "decode"


def _shifting(rate: float = 8.0, half_s: float = 60.0) -> Workload:
    """Prompt-heavy (6,000-token prompts, 40 tokens out), then output-heavy (300 in, 1,200 out)."""
    n = int(2 * half_s * rate)
    return Workload([RequestSpec(i / rate, 6000 if i / rate < half_s else 300, 40 if i / rate < half_s else 1200,
                                 None) for i in range(n)], "shift")


def test_the_simulator_moves_engines_toward_the_shifting_load():
    model, gpu = get_model("llama-3-8b"), get_gpu("h100")
    spec = ClusterSpec(mode="pd", num_prefill=3, num_decode=1, host_kv_gb=0, max_num_seqs=64,
                       role_switching="auto", role_switch_s=10.0)
    run = simulate(_shifting(), spec, model, gpu, RooflineTimeModel(model, gpu, 1))
    assert all(r.error is None for r in run.records)  # nothing lost while engines moved
    moves = run.role_switches
    assert moves and moves[0]["left"].startswith("prefill") and moves[0]["joined"].startswith("decode")
    assert moves[0]["at_s"] > 60.0  # after the shift to outputs, not before
    # a far shift is followed by a second move the same way without the cooldown (30 s here) a reversal waits
    assert len(moves) >= 2 and all(m["joined"].startswith("decode") for m in moves[:2])
    assert moves[1]["at_s"] - moves[0]["at_s"] < 30.0
    names = {e["name"] for e in run.engines}
    assert {m["joined"] for m in moves} <= names  # the new engines ran (their stats are in the run)
    fixed = simulate(_shifting(), ClusterSpec(mode="pd", num_prefill=3, num_decode=1, host_kv_gb=0, max_num_seqs=64),
                     model, gpu, RooflineTimeModel(model, gpu, 1))
    assert run.duration_s < fixed.duration_s  # the moved decode engines cleared the outputs sooner


def test_a_noisy_low_rate_is_not_multiplied_by_the_horizon():
    """A few arrivals per bucket (0, then 3 prompts of 1,500 tokens, in turn, in 10 s buckets: 225 tokens/s on
    average): with the trend damped, every forecast 60 s ahead stays within a bounded share of the mean; carried
    undamped over the horizon, each quiet bucket's trend drives the forecast to zero (no move could be held)."""
    from pdserve.core.role_planner import Holt

    def forecasts(planner: RolePlanner) -> list[float]:
        out = []
        for bucket in range(12):
            for k in range(3 if bucket % 2 else 0):
                planner.arrived(bucket * 10.0 + k, 1500, 8)
            out.append(planner.forecast(bucket * 10.0 + 10.0)[0])
        return out[4:]
    damped = forecasts(RolePlanner(interval_s=10, horizon_s=60))
    assert all(0.2 * 225 < f < 2 * 225 for f in damped), damped
    undamped = forecasts(RolePlanner(interval_s=10, horizon_s=60, prompt=Holt(phi=1.0)))
    assert min(undamped) == 0.0, undamped


def test_a_prefill_worker_without_a_fit_counts_for_its_observed_rate():
    from pdserve.conductor.admission import Admission
    from pdserve.conductor.conductor_core import ConductorCore
    from pdserve.conductor.routing import LeastLoaded
    core = ConductorCore("pd", LeastLoaded(), admission=Admission(), role_planner=RolePlanner())
    core.add_worker("prefill-0", "prefill")
    core.add_worker("decode-0", "decode")
    m = core.admission.model("prefill-0")
    for tokens, seconds in ((1500, 6.0), (2048, 8.0), (548, 2.0)):  # 3 steps: no fit (it needs 8)
        m.observe(tokens, tokens * tokens, 0, 0, seconds)
    assert m.prefill_s(2048) is None
    prefill, _ = core.membership.role_capacity([core.workers["prefill-0"]], [core.workers["decode-0"]])
    assert prefill == (1500 + 2048 + 548) / 16.0
    m.observe(1500, 1500 * 1500, 0, 0, 6.0)  # ... and none from a single step
    assert core.admission.model("other").observed_prefill_rate() is None


def test_a_move_is_weighed_with_what_it_costs_and_its_cost_is_measured():
    """Outputs the load on 2P2D (decode at 1.5x its capacity, prefill idle): moving a prefill worker to decode
    brings decode to 1.0. Counting the move's cost over the 300 s it must pay for itself in (decode stays at
    1.5 while the worker drains and reloads), a 20 s move is worth it (mean 1.03 <= 0.75 x 1.5 = 1.125), a
    150 s one is not (1.25)."""
    load = RoleLoad(prefill_tokens_s=100, decode_tokens_s=6_000, prefill_capacity=100_000, decode_capacity=2_000)
    quick, slow = RolePlanner(move_s=20.0), RolePlanner(move_s=150.0)
    assert abs(quick.weighed(load, 2, 2, -1) - (20 * 1.5 + 280 * 1.0) / 300) < 1e-9
    assert abs(slow.weighed(load, 2, 2, -1) - 1.25) < 1e-9

    def decide(planner: RolePlanner) -> str | None:
        for t in range(60):
            planner.arrived(float(t), 100, 6000)  # 100 prompt tokens/s, 6,000 output tokens/s
        return planner.decide(60.0, 2, 2, 100_000.0, 2_000.0)
    assert decide(RolePlanner(hold_s=0, move_s=20.0)) == "decode"
    assert decide(RolePlanner(hold_s=0, move_s=150.0)) is None  # the forecast would not repay it
    # what a move takes is measured from its start to its end, and the planner's estimate follows it
    planner = RolePlanner(move_s=20.0)
    planner.started("decode", 100.0)
    assert planner.moved(160.0) == 60.0 and planner.move_s == 40.0
    planner.started("decode")  # a driver that gives no clock: nothing measured
    assert planner.moved(200.0) is None and planner.move_s == 40.0


def test_the_core_reports_each_completed_move_as_it_measured_it():
    from pdserve.conductor.actions import Observe
    from pdserve.conductor.admission import Admission
    from pdserve.conductor.conductor_core import ConductorCore
    from pdserve.conductor.routing import LeastLoaded
    core = ConductorCore("pd", LeastLoaded(), admission=Admission(), role_planner=RolePlanner())
    core.membership.switching.append("decode")
    core.roles.started("decode", 10.0)
    actions = core.worker_joined("decode-1", "decode", 42.5)  # a worker that joins is loaded: the move is done
    assert Observe("role_move_seconds", (("role", "decode"),), 32.5) in actions
    assert core.membership.switching == [] and core.roles.move_s == 26.25
    # a replacement the gateway starts is still loading its model: the move completes at its `ready`
    core.membership.switching.append("prefill")
    core.roles.started("prefill", 100.0)
    started = core.worker_joined("prefill-1", "prefill", 104.0, loaded=False)
    assert not any(isinstance(a, Observe) for a in started) and core.membership.switching == ["prefill"]
    ready = core.worker_ready("prefill-1", Ready("prefill-1", "prefill"), 118.0)
    assert Observe("role_move_seconds", (("role", "prefill"),), 18.0) in ready and core.membership.switching == []
    # one that dies for good before it serves calls its move off (a reversal need not wait for it)
    core.membership.switching.append("decode")
    core.worker_joined("decode-2", "decode", 200.0, loaded=False)
    core.worker_died("decode-2", 205.0, "exited", restarting=False)
    assert core.membership.switching == [] and core.membership.arriving == {}
