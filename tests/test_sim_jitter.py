"""The simulated engines' steps scatter as the served steps did (`pdserve.sim.jitter`): the spread a fit to a
server's own steps keeps, drawn by a hash of each step's shape."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.errors import InvalidRequestError
from pdserve.sim.cluster import ClusterSpec, simulate
from pdserve.sim.from_server import fit_from_steps
from pdserve.sim.hardware import get_gpu, get_model
from pdserve.sim.jitter import SPREAD_POINTS, Jittered, jittered, spread_of
from pdserve.sim.timemodel import Coefficients, FittedTimeModel, StepShape
from pdserve.workloads import load_workload

FIXTURE = Path(__file__).parent / "data" / "server_steps.json"
MODEL, GPU = get_model("llama-3-8b"), get_gpu("h100")
SPREAD = {"decode": spread_of(np.linspace(0.85, 1.3, 101)), "prefill": spread_of(np.linspace(0.9, 1.2, 101))}


def _fitted(spread=None) -> FittedTimeModel:
    return FittedTimeModel(Coefficients(0.01, 2e-5, 0), Coefficients(0.008, 3e-7, 1e-4), spread=spread)


def test_the_spread_keeps_the_mean_and_the_order():
    s = spread_of([1.0] * 50 + [2.0] * 50)
    assert len(s) == SPREAD_POINTS and s == sorted(s) and np.mean(s) == pytest.approx(1.0)
    assert s[0] == pytest.approx(2 / 3) and s[-1] == pytest.approx(4 / 3)


def test_a_run_of_decode_steps_draws_what_stepping_draws():
    tm = Jittered(_fitted(), SPREAD)
    for n, ctx, k in ((1, 100, 50), (7, 3000, 40), (16, 123456, 9)):
        one_by_one = [tm.step_time(StepShape.decode(n, ctx + n * i)) for i in range(1, k + 1)]
        assert tm.decode_times(n, ctx, k).tolist() == one_by_one  # bit for bit
        assert len(set(one_by_one)) > k // 3  # they scatter
    steps = [tm.step_time(StepShape.decode(4, c)) / _fitted().step_time(StepShape.decode(4, c)) for c in range(2000)]
    assert np.mean(steps) == pytest.approx(1.0, abs=0.02) and min(steps) < 0.9 and max(steps) > 1.2
    assert jittered(_fitted()).__class__ is FittedTimeModel  # no spread: the mean model itself


def test_a_fit_to_served_steps_keeps_their_spread_and_it_round_trips(tmp_path):
    model = fit_from_steps(json.loads(FIXTURE.read_text())["data"])
    assert set(model.spread) == {"prefill", "decode"} and all(len(v) == SPREAD_POINTS for v in model.spread.values())
    assert model.spread["decode"][0] < 1 < model.spread["decode"][-1]
    again = FittedTimeModel.from_json(model.to_json())
    assert again.spread == model.spread
    bad = json.loads(model.to_json())
    for spread in ([1.0], {"decode": [1.0, -0.5]}):
        with pytest.raises(InvalidRequestError, match="spread"):
            FittedTimeModel.from_json(json.dumps({**bad, "spread": spread}))


def _run(tm, fast_forward=True):
    wl = load_workload("fixed:200,40", num_requests=24, rate=4.0, seed=0)
    spec = ClusterSpec(mode="pd", num_prefill=1, num_decode=1, fast_forward=fast_forward)
    return simulate(wl, spec, MODEL, GPU, tm)


def test_the_simulated_server_jitters_as_measured_and_replays_exactly():
    plain, spread = _run(_fitted()), _run(_fitted(SPREAD))
    tpot = [np.mean([(r.end_s - r.first_token_s) / (r.output_tokens - 1) for r in run.records])
            for run in (plain, spread)]
    assert tpot[1] == pytest.approx(tpot[0], rel=0.03)  # the mean step stays the fit's
    gaps = [np.concatenate([np.diff(r.token_times) for r in run.records]) for run in (plain, spread)]
    assert np.std(gaps[1]) > 2 * np.std(gaps[0]), (np.std(gaps[0]), np.std(gaps[1]))
    stepped = _run(_fitted(SPREAD), fast_forward=False)
    assert sum(e["fast_forward_steps"] for e in spread.engines) > 0 == sum(e["fast_forward_steps"]
                                                                             for e in stepped.engines)
    assert [r.token_times for r in stepped.records] == [r.token_times for r in spread.records]
