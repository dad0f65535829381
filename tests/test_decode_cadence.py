"""`--decode-cadence steady`: a decode worker's step outputs go out at a steady period (pdserve.core.sched.decode_cadence).

The policy's contract on its own (period from the recent steps' quantile, capped by the step's stretch and the
TPOT SLO; nothing held while cold; old steps expire; a trial copy leaves it alone), then in the simulator: a
fast-forwarded run equals stepping one by one, and on a PD cluster whose decode batch changes (long and
short prompts arriving) the pooled P99 inter-token jitter falls while TPOT grows by at most the stretch.
Also: an idle decode engine loads a reservation's host tier hits at once, not in the step after the KV lands.
"""

from __future__ import annotations

import functools
import random

import pytest

from pdserve.bench.metrics import jitter_p99_ms
from pdserve.core.sched.decode_cadence import MIN_SAMPLES, DecodeCadence, check_cadence
from pdserve.core.sched.step_budget import HEADROOM
from pdserve.errors import InvalidRequestError
from pdserve.sim.cluster import ClusterSpec, simulate
from pdserve.sim.engine import SimEngine
from pdserve.sim.hardware import get_gpu, get_model
from pdserve.sim.timemodel import RooflineTimeModel
from pdserve.workloads import RequestSpec, Workload

MODEL, GPU = get_model("llama-3-8b"), get_gpu("h100")
MS = 0.001


def warm(c: DecodeCadence, step_s: float, n: int = 50, t0: float = 0.0) -> float:
    """`n` steps of `step_s` back to back from `t0`; returns when the next one starts."""
    t = t0
    for _ in range(n):
        t += c.pace(t, step_s)
    return t


def test_nothing_is_held_until_the_window_has_enough_steps():
    c = DecodeCadence()
    t = warm(c, 8 * MS, MIN_SAMPLES - 1)
    assert c.pace(t, 6 * MS) == 6 * MS and c.num_held == 0


def test_a_lighter_batch_keeps_the_recent_period_and_the_hold_is_counted():
    c = DecodeCadence()
    t = warm(c, 8 * MS)
    assert c.pace(t, 7 * MS) == pytest.approx(8 * MS)
    assert c.num_held == 1 and c.held_s == pytest.approx(1 * MS) and c.period_s == pytest.approx(8 * MS)


def test_a_step_longer_than_the_period_is_never_held():
    c = DecodeCadence()
    t = warm(c, 8 * MS)
    assert c.pace(t, 9 * MS) == 9 * MS and c.num_held == 0


def test_one_outlier_does_not_set_the_period_at_the_99th_percentile():
    c = DecodeCadence(quantile=0.99)
    t = warm(c, 8 * MS, 150)
    t += c.pace(t, 30 * MS)
    assert c.pace(t, 8 * MS) == 8 * MS  # (151 steps: the 99th percentile is a plain one)


def test_the_period_is_capped_by_the_stretch_and_by_the_tpot_slo():
    c = DecodeCadence(max_stretch=1.25)
    t = warm(c, 10 * MS)
    assert c.pace(t, 4 * MS) == pytest.approx(5 * MS)  # at most 1.25 x the step's own time
    c = DecodeCadence()
    t = warm(c, 10 * MS)
    assert c.pace(t, 8 * MS, tpot_slo_s=10 * MS) == pytest.approx(HEADROOM * 10 * MS)


def test_steps_older_than_the_window_expire():
    c = DecodeCadence(window_s=1.0)
    t = warm(c, 9 * MS)
    assert c.pace(t, 8 * MS) == pytest.approx(9 * MS)
    t = warm(c, 8 * MS, 200, t + 8 * MS)  # 1.6 s of lighter steps: the heavier ones are gone
    assert c.pace(t, 8 * MS) == 8 * MS


def test_steps_with_prefill_are_paced_but_do_not_set_the_period():
    c = DecodeCadence()
    t = warm(c, 8 * MS)
    for _ in range(100):
        t += c.pace(t, 40 * MS, decode_only=False)
    assert c.pace(t, 7 * MS) == pytest.approx(8 * MS)


def test_a_trial_copy_plans_ahead_and_leaves_the_cadence_alone():
    c = DecodeCadence()
    t = warm(c, 8 * MS)
    trial = c.trial()
    warm(trial, 12 * MS, 500, t)
    assert trial.pace(t + 6, 8 * MS) == pytest.approx(10 * MS)  # its own history: 12 ms, stretch-capped
    assert c.pace(t, 7 * MS) == pytest.approx(8 * MS) and c.num_held == 1


def test_bad_settings_are_refused():
    for kw in ({"window_s": 0}, {"quantile": 0}, {"quantile": 1.5}, {"max_stretch": 0.9}):
        with pytest.raises(ValueError):
            DecodeCadence(**kw)
    with pytest.raises(InvalidRequestError, match="decode cadence"):
        check_cadence("smooth")
    with pytest.raises(InvalidRequestError):
        ClusterSpec(decode_cadence="smooth")


# ---- in the simulator ------------------------------------------------------------------------------------------
def mixed(n=150, seed=3) -> Workload:
    """Long and short prompts arriving over ~30 s: the decode batches' context (so their step time) moves."""
    rng = random.Random(seed)
    reqs, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(5.0)
        reqs.append(RequestSpec(t, rng.choice((200, 600, 4000, 7000)), rng.randint(60, 180)))
    return Workload(reqs, "mixed")


def run(cadence: str, fast_forward: bool = True, wl: Workload | None = None, **kw):
    spec = ClusterSpec(mode="pd", num_prefill=2, num_decode=2, decode_cadence=cadence, fast_forward=fast_forward,
                       **kw)
    return simulate(wl or mixed(), spec, MODEL, GPU, RooflineTimeModel(MODEL, GPU, 1))


@functools.lru_cache(maxsize=None)
def default_run(cadence: str):
    """`run(cadence)` on the default workload, simulated once for the tests that read it (nothing mutates it)."""
    return run(cadence)


def tpot(run_) -> float:
    vals = [r.tpot_s for r in run_.records if r.ok and r.tpot_s is not None]
    return sum(vals) / len(vals)


def test_a_fast_forwarded_run_paces_exactly_as_stepping_one_by_one():
    a, b = default_run("steady"), run("steady", fast_forward=False)
    assert [r.token_times for r in a.records] == [r.token_times for r in b.records]
    assert a.records[0].token_times  # (something ran)


def test_steady_cadence_lowers_the_jitter_at_a_bounded_tpot_cost():
    off, steady = run("off"), default_run("steady")
    assert all(r.ok for r in off.records + steady.records)
    j_off, j_steady = jitter_p99_ms(off.records), jitter_p99_ms(steady.records)
    assert j_steady < 0.7 * j_off, (j_off, j_steady)  # (-44% to -49% over seeds 1-3)
    assert tpot(off) < tpot(steady) <= 1.25 * tpot(off)


def test_an_idle_decode_engine_loads_a_reservations_host_hits_before_its_kv_lands(monkeypatch):
    """Each turn of a conversation extends the last, alone in the cluster; the decode pool is too small to
    keep them, its host tier keeps them: each later turn's reservation has host hits to load. They are loaded
    ahead, by steps of their own while the prompt's tail is prefilled, never by the step that first decodes."""
    decoders: list[SimEngine] = []
    init = SimEngine.__init__

    def recording(self, name, role, *a, **kw):
        init(self, name, role, *a, **kw)
        if role == "decode":
            self.executor.history = []
            decoders.append(self)
    monkeypatch.setattr(SimEngine, "__init__", recording)
    reqs = [RequestSpec(i * 1.0, (t + 1) * 512, 4, tuple(1000 * c + k for k in range(t + 1)))
            for i, (t, c) in enumerate((t, c) for t in range(3) for c in range(4))]
    run_ = run("off", wl=Workload(reqs, "turns"), num_kv_blocks=160, host_kv_gb=4.0)
    assert all(r.ok for r in run_.records)
    history = [s for e in decoders for s in e.executor.history]
    assert any(s.kv_loads_ahead for s in history), "no host hit was loaded: the workload misses the path"
    assert all(not s.chunks for s in history if s.kv_loads_ahead)  # loaded by steps of their own
    assert not any(s.kv_loads for s in history)  # nothing was left for the step that reads them
