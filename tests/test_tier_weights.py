"""Dynamic weights of the elastic service tiers (`pdserve.core.sched.tier_weights`): the documented function, and
the order it gives a real engine's waiting queue against the static weights."""

from __future__ import annotations

import pytest

from pdserve.core.request import Request
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.sched.schedule import SchedulerConfig
from pdserve.core.sched.tier_weights import FACTOR_MAX, TierSignals, TierWeights, weight_factor
from pdserve.core.service_tiers import ServiceTiers
from pdserve.engine.executor import FakeExecutor
from pdserve.engine.llm_engine import LLMEngine
from pdserve.errors import InvalidRequestError


def test_the_factor_of_each_signal():
    calm = TierSignals(slack_s=2.0, queue_age_s=0.0, held_share=0.0, decode_load=0.0)
    assert weight_factor(calm, ttft_s=2.0, horizon_s=2.0) == 1.0  # a whole SLO of slack, nothing waited
    assert weight_factor(TierSignals(0.5, 0.0, 0.0, 0.0), 2.0, 2.0) == pytest.approx(1.75)  # 3/4 of it used up
    assert weight_factor(TierSignals(-1.0, 0.0, 0.0, 0.0), 2.0, 2.0) == 2.0  # late: capped at 2
    assert weight_factor(TierSignals(None, 30.0, 0.0, 0.0), None, 60.0) == 1.5  # waited half its horizon
    assert weight_factor(TierSignals(None, 600.0, 0.0, 0.0), None, 60.0) == 2.0  # age capped at +1
    assert weight_factor(TierSignals(2.0, 0.0, 1.0, 0.0), 2.0, 2.0) == 0.5  # every link held
    assert weight_factor(TierSignals(None, 0.0, 0.0, 1.0), None, 60.0) == 0.5  # best effort, decode full
    assert weight_factor(TierSignals(2.0, 0.0, 0.0, 1.0), 2.0, 2.0) == 1.0  # an SLO-bound tier does not yield
    assert weight_factor(TierSignals(-5.0, 1e9, 0.0, 0.0), 2.0, 2.0) == FACTOR_MAX


def _req(rid: str, tier: str, arrival_s: float) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(), arrival_s=arrival_s, service_tier=tier)


def test_the_weights_follow_the_waiting_requests_and_say_when_to_reorder():
    tiers = ServiceTiers.from_specs(["default:ttft_ms=2000"])
    weights = TierWeights(tiers)
    assert weights.update(50.0, [_req("f", "flex", 0.0), _req("d", "default", 50.0)], 0.0, lambda rid: False)
    assert weights.factor("flex") == pytest.approx(1 + 50 / 60) and weights.factor("default") == 1.0
    report = weights.report()
    assert report["flex"]["weight"] == pytest.approx(0.5 * (1 + 50 / 60)) and report["default"]["slack_s"] == 2.0
    assert not weights.update(50.0, [_req("f", "flex", 0.0), _req("d", "default", 50.0)], 0.0, lambda rid: False)
    static = TierWeights(tiers, "static")
    assert not static.update(50.0, [_req("f", "flex", 0.0)], 0.0, lambda rid: False) and static.factor("flex") == 1
    with pytest.raises(InvalidRequestError, match="dynamic, static"):
        TierWeights(tiers, "adaptive")


@pytest.mark.parametrize("mode,first", [("static", "default"), ("dynamic", "flex")])
def test_a_long_waiting_flex_request_goes_first_only_with_dynamic_weights(mode, first):
    """A flex request queued 50 s (static deadline 0 + 60 s) and a default one just arrived (50 + 2 s): static,
    the default one runs first; dynamic, flex's age scales its weight by 1 + 50/60 (deadline 32.7 s): flex."""
    now = [0.0]
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=4096, max_model_len=4096,
                          service_tiers=("default:ttft_ms=2000",), tier_weights=mode)
    engine = LLMEngine(FakeExecutor(block_size=4, vocab_size=1000), cfg, num_kv_blocks=256, tokenizer=None,
                       clock=lambda: now[0])
    blocker = engine.add_request([5] * 8, SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True),
                                 service_tier="priority")
    engine.step()  # the one slot is taken: the others wait
    flex = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=1), service_tier="flex")
    engine.scheduler.requests[flex].arrival_s = 0.0
    now[0] = 50.0
    default = engine.add_request([4, 5, 6], SamplingParams(temperature=0, max_tokens=1), service_tier="default")
    engine.scheduler.requests[default].arrival_s = 50.0
    engine.abort([blocker])
    engine.step()
    running = [r.request_id for r in engine.scheduler.running] + [
        o for o in (flex, default) if engine.scheduler.requests.get(o) is None]  # (finished in the step)
    assert running[0] == {"flex": flex, "default": default}[first]
