"""Prediction-based admission (`pdserve.conductor.admission`) as a pure object: workers' step times with known
coefficients go in, and its TTFT and TPOT predictions, hand-computed from those coefficients, come out; each
rejection reason (slo_ttft, slo_tpot, queue_full) and the margin that changes a decision."""

from __future__ import annotations

import pytest

from pdserve.conductor.admission import Admission
from pdserve.core.service_tiers import ServiceTier

# prefill worker "p": a step of n prompt tokens made of prompts of about m tokens takes
#   P_A + P_B * n + P_C * n * m seconds (the quadratic term is per prompt)
P_A, P_B, P_C = 0.01, 1e-5, 1e-9
# decode worker "d": a step of b sequences of mean context c takes D_A + D_CTX * b * c + D_SEQ * b seconds
D_A, D_CTX, D_SEQ = 0.005, 1e-6, 2e-4
CONTEXT = 100  # every decode step's context per sequence
DELIVERY_S = 0.02


def admission(margin: float = 0.1, max_outstanding: int = 4096) -> Admission:
    """An admission whose two workers reported noise-free steps of the coefficients above."""
    adm = Admission(margin, max_outstanding)
    prefill = []
    for n, m in ((16, 16), (256, 64), (512, 512), (1024, 256), (2048, 1024), (2048, 2048), (300, 100),
                 (700, 700), (1500, 300), (64, 8)):
        prefill.append((n, n * m, 0, 0, P_A + P_B * n + P_C * n * m))
    adm.observe_steps("p", prefill)
    # 300 steps at the same context per sequence: the moving mean context is CONTEXT (to within 0.95 ** 300)
    decode = [(0, 0, b, b * CONTEXT, D_A + D_CTX * b * CONTEXT + D_SEQ * b) for b in (1, 2, 4, 8, 16, 3) * 50]
    adm.observe_steps("d", decode)
    adm.observe_delivery("d", DELIVERY_S)
    return adm


def ttft_tier(ms: float) -> ServiceTier:
    return ServiceTier("default", ttft_ms=ms)


def test_ttft_prediction_is_the_backlog_in_budget_chunks_plus_half_a_step_plus_delivery():
    adm = admission()
    # a 1,000-token prompt with 3,000 tokens of its tier or better ahead and 500 behind, budget 2,048:
    # - the current step holds 2,048 of the backlog (ahead first) and is half done: 0.5 * step(2048, m=1000)
    # - left ahead: 952 tokens; with the prompt's 1,000 that is one chunk of 1,952, topped up to 2,048 by the
    #   500 behind: step(2048, m=1000)
    # - then delivery to the decode worker
    step = P_A + P_B * 2048 + P_C * 2048 * 1000  # 0.032528 s
    expected = 0.5 * step + step + DELIVERY_S  # 0.068792 s
    assert adm.predict_ttft_s("p", "d", 1000, 3000, 500, 0) == pytest.approx(expected, rel=1e-6)
    # an idle worker: just the prompt's own chunk (no top-up, no half step) and the delivery
    assert adm.predict_ttft_s("p", "d", 1000, 0, 0, 0) == pytest.approx(
        P_A + P_B * 1000 + P_C * 1000 * 1000 + DELIVERY_S, rel=1e-6)
    # a prompt over the budget: whole chunks of 2,048 then the rest
    assert adm.predict_ttft_s("p", "d", 5000, 0, 0, 0) == pytest.approx(
        2 * (P_A + P_B * 2048 + P_C * 2048 * 2048) + P_A + P_B * 904 + P_C * 904 * 904 + DELIVERY_S, rel=1e-6)


def test_ttft_rejection_and_the_margin_that_changes_it():
    tier = ttft_tier(60)  # the prediction above is 68.8 ms
    args = ("p", "d", 1000, 3000, 500, 0, 0, 0.0)
    rejected = admission(margin=0.1).check(tier, *args)  # 68.8 > 60 * 1.1 = 66
    assert rejected is not None and rejected.reason == "slo_ttft" and rejected.code == "slo_unattainable"
    assert "predicted time to first token 69 ms exceeds the default tier's 60 ms SLO" in rejected.message
    assert rejected.retry_after_s == 1.0
    loose = admission(margin=0.2)
    assert loose.check(tier, *args) is None  # 68.8 <= 60 * 1.2 = 72
    assert loose.last_ttft_s == pytest.approx(0.068792, rel=1e-6)
    assert admission(margin=0.1).check(ttft_tier(63), *args) is None  # 68.8 <= 63 * 1.1 = 69.3


def test_tpot_rejection_is_one_decode_step_with_the_request_in_the_batch():
    # 9 decoding, this one the 10th: D_A + D_CTX * 10 * 100 + D_SEQ * 10 = 0.005 + 0.001 + 0.002 = 8 ms
    assert admission().model("d").tpot_s(10) == pytest.approx(0.008, rel=1e-5)
    tight = ServiceTier("default", tpot_ms=7)  # 8 > 7 * 1.1 = 7.7
    rejected = admission().check(tight, "p", "d", 100, 0, 0, 9, 0, 0.0)
    assert rejected is not None and rejected.reason == "slo_tpot"
    assert "predicted time per output token 8 ms exceeds the default tier's 7 ms SLO (9 decoding)" in rejected.message
    assert admission(margin=0.2).check(tight, "p", "d", 100, 0, 0, 9, 0, 0.0) is None  # 8 <= 8.4
    assert admission().check(tight, "p", "d", 100, 0, 0, 4, 0, 0.0) is None  # a batch of 5: 6.5 ms


def test_queue_full_refuses_every_tier_and_no_slo_is_never_predicted():
    adm = admission(max_outstanding=3)
    best_effort = ServiceTier("flex")
    assert adm.check(best_effort, "p", "d", 10**6, 10**6, 0, 500, 2, 0.0) is None  # no SLO: whatever it predicts
    full = adm.check(best_effort, "p", "d", 10, 0, 0, 0, 3, 0.0)
    assert full is not None and full.reason == "queue_full" and full.code == "queue_full"
    assert "worker d has 3 requests queued" in full.message
    assert adm.check(ttft_tier(10**6), "p", "d", 10, 0, 0, 0, 3, 0.0).reason == "queue_full"


def test_nothing_is_predicted_before_enough_steps():
    adm = Admission(0.1)
    adm.observe_steps("p", [(100, 10000, 0, 0, 1.0)] * 7)  # one short of online_fit.MIN_SAMPLES
    assert adm.predict_ttft_s("p", "p", 100, 0, 0, 0) is None
    assert adm.check(ttft_tier(1), "p", "p", 100, 0, 0, 0, 0, 0.0) is None  # unpredicted: admitted
    adm.observe_steps("p", [(100, 10000, 0, 0, 1.0)])
    assert adm.check(ttft_tier(1), "p", "p", 100, 0, 0, 0, 0, 0.0).reason == "slo_ttft"


def test_the_current_step_counts_what_is_left_of_it_by_how_long_it_has_run():
    """A burst's second request arrives a few ms after the first one's step began: all of that step is ahead
    of it (not half). The longer the step has run, the less of it is left; past its predicted time, none."""
    adm = admission()
    step = P_A + P_B * 1000 + P_C * 1000 * 1000  # the 1,000 tokens in the current step, prompts of ~1,000
    own = P_A + P_B * 1000 + P_C * 1000 * 1000
    assert adm.predict_ttft_s("p", "d", 1000, 1000, 0, 0, busy_s=0.0) == pytest.approx(
        step + own + DELIVERY_S, rel=1e-6)
    assert adm.predict_ttft_s("p", "d", 1000, 1000, 0, 0, busy_s=0.25 * step) == pytest.approx(
        0.75 * step + own + DELIVERY_S, rel=1e-6)
    assert adm.predict_ttft_s("p", "d", 1000, 1000, 0, 0, busy_s=10.0) == pytest.approx(own + DELIVERY_S, rel=1e-6)
    assert adm.predict_ttft_s("p", "d", 1000, 1000, 0, 0) == pytest.approx(0.5 * step + own + DELIVERY_S, rel=1e-6)


def test_before_any_delivery_the_tail_is_the_decode_workers_first_step_and_the_read_time_never_has_it():
    adm = admission()
    own = P_A + P_B * 500 + P_C * 500 * 500
    first_step = D_A + D_CTX * 4 * CONTEXT + D_SEQ * 4  # 3 decoding, this one the fourth
    fresh = Admission(0.1, 4096)
    fresh.models = {"p": adm.models["p"], "d": adm.models["d"]}
    adm.models["d"].delivery_s = None  # (the decode worker has delivered nothing yet)
    assert fresh.predict_ttft_s("p", "d", 500, 0, 0, 3) == pytest.approx(own + first_step, rel=1e-6)
    fresh.observe_delivery("d", 2.0)  # a backed-up link's tail, learnt
    assert fresh.predict_ttft_s("p", "d", 500, 0, 0, 3) == pytest.approx(own + 2.0, rel=1e-6)
    assert fresh.predict_read_s("p", "d", 500, 0, 0, 3) == pytest.approx(own + first_step, rel=1e-6)


def test_a_busy_worker_whose_steps_an_slo_caps_has_its_last_step_taken_whole():
    """Its scheduler fills a capped step with whatever is queued when the step starts, and in a burst prompts
    that come meanwhile: with others queued, a prompt's last chunk is predicted as a whole capped step; alone on
    an idle worker (or uncapped), as its own tokens."""
    adm = admission()
    chunk = lambda n, m=1000: P_A + P_B * n + P_C * n * min(n, m)  # noqa: E731 - a step of n tokens, prompts of m
    assert adm.predict_prefill_s("p", 1000, 0, 0) == pytest.approx(chunk(1000), rel=1e-6)  # budget 2,048
    adm.model("p").budget = 400  # its step budget's cap, reported in its stats
    assert adm.predict_prefill_s("p", 1000, 0, 0) == pytest.approx(2 * chunk(400) + chunk(200), rel=1e-6)
    # 100 tokens queued ahead: the step in progress holds them (100 tokens, not a whole step: it has begun),
    # then the prompt's 1,000 in chunks of 400, its last one whole
    assert adm.predict_prefill_s("p", 1000, 100, 0, busy_s=0.0) == pytest.approx(
        chunk(100) + 3 * chunk(400), rel=1e-6)
