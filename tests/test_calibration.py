"""A worker's time model calibrated at load (`pdserve.engine.calibration`), on a real engine with the default
model: the profile's steps and their cache.

* a first start profiles (timed engine steps: at least a fit's worth, prefill shapes for a prefill worker),
  writes the cache and leaves the engine as it found it (no request, no block used, its executor's hooks);
* a second start with the same key reads the cache and runs no step at all;
* a changed key (another CPU, here) profiles again into a file of its own; `fresh` profiles again whatever the
  cache holds; a cache that does not parse is profiled again and counted; a profile waits for another one on
  the host (the cache folder's lock), at most `LOCK_WAIT_S`, then counts it; no step starts past `LIMIT_S`;
  `off` runs nothing;
* the step budget of a worker whose profile it learned caps its very first step (no cold start), and reports
  that cap before it (what admission chunks prefill in).
"""

from __future__ import annotations

import json

import pytest

from pdserve.core.sched.online_fit import MIN_SAMPLES
from pdserve.engine import calibration
from pdserve.engine.calibration import calibrate, cache_key, cache_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built():
    from pdserve.engine.worker_engine import build_worker_engine
    from pdserve.model.loader import resolve_model_dir
    model_dir = str(resolve_model_dir(None))
    engine, _ = build_worker_engine(model_dir, {"num_threads": 1, "service_tiers": ("default:ttft_ms=2000",)},
                                    worker="calibration-test")
    return engine, model_dir


@pytest.fixture
def engine(built, tmp_path, monkeypatch):
    """The engine, its calibration cache in `tmp_path`, its executor's steps counted in `engine.steps_run`."""
    engine, _ = built
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    run = engine.executor.execute
    engine.steps_run = 0

    def counted(scheduled):
        engine.steps_run += 0 if scheduled.is_empty else 1
        return run(scheduled)

    monkeypatch.setattr(engine.executor, "execute", counted)
    return engine


def test_a_first_start_profiles_and_a_second_reads_the_cache_without_a_step(engine, built, tmp_path):
    model_dir = built[1]
    first = calibrate(engine, "prefill", "cached", model_dir)
    assert first.source == "profiled" and first.fallbacks == 0
    assert len(first.steps) >= MIN_SAMPLES and all(s.prefill_tokens and not s.decode_seqs for s in first.steps)
    assert all(s.seconds > 0 for s in first.steps) and engine.steps_run > len(first.steps)  # (warm-up too)
    assert first.path == cache_path(cache_key(engine, "prefill", model_dir)) and first.path.parent == tmp_path
    assert json.loads(first.path.read_text())["key"]["role"] == "prefill"
    assert "profile steps" in first.describe() and "profiled in" in first.describe()
    # the probe left nothing behind: no request, no block, the executor's hook back on the worker's engine
    assert engine.block_manager.num_used_blocks == 0 and not engine.scheduler.requests
    assert engine.executor.outputs_of == engine._outputs_of  # noqa: SLF001

    engine.steps_run = 0
    second = calibrate(engine, "prefill", "cached", model_dir)
    assert second.source == "cached" and engine.steps_run == 0
    assert second.steps == first.steps and "read from the cache" in second.describe()


def test_a_changed_key_fresh_a_bad_cache_and_off(engine, built, tmp_path, monkeypatch):
    model_dir = built[1]
    first = calibrate(engine, "decode", "cached", model_dir)
    assert first.source == "profiled" and len(first.steps) >= MIN_SAMPLES
    assert all(s.decode_seqs and not s.prefill_tokens for s in first.steps)  # a decode worker's steps
    assert {s.decode_seqs for s in first.steps} >= {16, 4, 2}

    monkeypatch.setattr("pdserve.cbuild.cpu_signature", lambda: "vendor_id: another\nmodel name: CPU")
    engine.steps_run = 0
    other = calibrate(engine, "decode", "cached", model_dir)
    assert other.source == "profiled" and engine.steps_run > 0 and other.path != first.path
    assert len(list(tmp_path.glob("decode-*.json"))) == 2

    engine.steps_run = 0
    again = calibrate(engine, "decode", "fresh", model_dir)
    assert again.source == "profiled" and engine.steps_run > 0 and again.path == other.path

    other.path.write_text("{not json")
    engine.steps_run = 0
    mended = calibrate(engine, "decode", "cached", model_dir)
    assert mended.source == "profiled" and engine.steps_run > 0 and mended.fallbacks == 1
    assert "unreadable" in mended.describe()
    assert calibrate(engine, "decode", "cached", model_dir).source == "cached"  # rewritten

    import fcntl  # another worker's profile holds the host's lock: this one waits, then profiles beside it
    monkeypatch.setattr(calibration, "LOCK_WAIT_S", 0.5)
    with open(tmp_path / ".profile.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        beside = calibrate(engine, "decode", "fresh", model_dir)
    assert beside.source == "profiled" and beside.fallbacks == 1 and "held its lock" in beside.describe()

    monkeypatch.setattr(calibration, "LIMIT_S", 0.0)  # a host too slow for a fit's worth: bounded all the same
    engine.steps_run = 0
    bounded = calibrate(engine, "prefill", "fresh", model_dir)
    assert bounded.steps == () and "only 0 profile steps" in bounded.describe()
    assert not bounded.path.exists()  # too few to cache: the next start profiles again
    assert engine.steps_run <= 3  # the warm-up (a prompt and its token) and the release

    engine.steps_run = 0
    off = calibrate(engine, "decode", "off", model_dir)
    assert off.source == "off" and off.steps == () and engine.steps_run == 0


def test_a_small_batch_and_token_budget_still_make_a_fit(built, tmp_path, monkeypatch):
    """Shapes beyond the engine's batch or token budget are left out, the batches cut to its batch, and the
    shapes that fit timed again: still a fit's worth of rows of each kind."""
    from pdserve.engine.worker_engine import build_worker_engine
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    small, _ = build_worker_engine(built[1], {"num_threads": 1, "max_num_seqs": 2, "max_num_batched_tokens": 64,
                                              "kv_cache_gb": 0.05}, worker="calibration-small")
    got = calibrate(small, "colocated", "fresh", built[1])
    prefill = [s for s in got.steps if s.prefill_tokens]
    decode = [s for s in got.steps if not s.prefill_tokens]
    assert len(prefill) >= MIN_SAMPLES and max(s.prefill_tokens for s in prefill) <= 64
    assert len(decode) >= MIN_SAMPLES and {s.decode_seqs for s in decode} == {1, 2}
    assert got.path.exists()


def test_a_step_budget_that_learned_the_profile_caps_the_first_step(engine, built):
    from pdserve.core.sched.step_budget import StepBudget
    from pdserve.core.service_tiers import ServiceTiers
    steps = calibrate(engine, "prefill", "cached", built[1]).steps
    tiers = ServiceTiers.from_specs(["default:ttft_ms=200"])  # each step within 50 ms: a few tokens at most

    def first_cap(learned) -> int:
        budget = StepBudget(tiers, max_tokens=2048, min_tokens=16)
        for row in learned:
            budget.learn(row)
        budget.begin([])
        return budget.take(2048, 0)

    assert first_cap(()) == 2048  # cold: nothing known, the first step takes what it asks
    assert 16 <= first_cap(steps) < 2048
    budget = StepBudget(tiers, max_tokens=2048, min_tokens=16)
    for row in steps:
        budget.learn(row)
    budget.refresh_cap()  # what the worker reports before its first step (admission's prefill chunk)
    assert budget.last_cap == first_cap(steps) and budget.num_capped_steps == budget.num_cold_start_steps == 0
