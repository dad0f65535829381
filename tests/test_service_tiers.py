"""Service tiers: spec parsing, queue order, and the guaranteed tier's share (lent while idle, taken back)."""

from __future__ import annotations

import pytest

from pdserve.core.sched.policy import TieredPolicy
from pdserve.core.request import Request
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.sched.schedule import SchedulerConfig
from pdserve.core.service_tiers import ServiceTier, ServiceTiers, parse_service_tier
from pdserve.engine.executor import FakeExecutor
from pdserve.engine.llm_engine import LLMEngine
from pdserve.errors import InvalidRequestError


def test_parse_a_full_spec_and_defaults():
    t = parse_service_tier("priority:ttft_ms=500,tpot_ms=80,share=0.3")
    assert t == ServiceTier("priority", 500.0, 80.0, 0.3, 1.0)
    assert parse_service_tier("flex").weight == 0.5 and not parse_service_tier("flex").has_slo
    tiers = ServiceTiers.from_specs(["default:ttft_ms=2000", "priority:ttft_ms=300,share=0.2"])
    assert tiers["default"].ttft_ms == 2000 and tiers.reserved_share == 0.2 and tiers.any_slo
    assert ServiceTiers.from_specs(tiers.specs()) == tiers  # specs round-trip (workers get them this way)
    assert not ServiceTiers().any_slo


@pytest.mark.parametrize("spec, fragment", [
    ("gold:ttft_ms=1", "unknown tier 'gold'"),
    ("default:ttft=1", "expected NAME:ttft_ms=X"),
    ("default:ttft_ms=fast", "ttft_ms must be a number"),
    ("default:ttft_ms=-5", "ttft_ms must be positive"),
    ("default:share=0.2", "only the priority tier"),
    ("priority:share=1", "share must be in [0, 1)"),
    ("priority:ttft_ms=1,ttft_ms=2", "expected NAME:ttft_ms=X"),
])
def test_bad_specs_name_the_fault(spec, fragment):
    with pytest.raises(InvalidRequestError, match=None) as e:
        parse_service_tier(spec)
    assert fragment in e.value.message


def test_a_tier_given_twice_and_unknown_request_tiers_are_errors():
    with pytest.raises(InvalidRequestError, match="given twice"):
        ServiceTiers.from_specs(["flex:ttft_ms=1", "flex:ttft_ms=2"])
    tiers = ServiceTiers()
    assert tiers.resolve(None) == tiers.resolve("auto") == "default"
    assert tiers.resolve("auto", key_default="flex") == "flex"
    with pytest.raises(InvalidRequestError, match="allowed: auto, priority, default, flex"):
        tiers.resolve("scale")


def _req(rid: str, tier: str, arrival_s: float) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(), arrival_s=arrival_s, service_tier=tier)


def test_tiered_order_priority_first_then_earliest_virtual_deadline():
    policy = TieredPolicy(ServiceTiers.from_specs(["default:ttft_ms=1000", "flex:ttft_ms=1000"]))
    reqs = [_req("flex-early", "flex", 0.0), _req("default-late", "default", 0.5), _req("prio-late", "priority", 5.0),
            _req("default-early", "default", 0.0)]
    order = [r.request_id for r in sorted(reqs, key=policy.sort_key)]
    # flex's weight 0.5 doubles its horizon: its deadline (2.0 s) is after the late default request's (1.5 s)
    assert order == ["prio-late", "default-early", "default-late", "flex-early"]
    one_tier = [_req(f"d{i}", "default", float(10 - i)) for i in range(5)]
    assert [r.request_id for r in sorted(one_tier, key=policy.sort_key)] == ["d4", "d3", "d2", "d1", "d0"]  # FCFS


def _engine(share: float, max_num_seqs: int = 4, num_blocks: int = 4096) -> LLMEngine:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096, max_model_len=4096,
                          service_tiers=(f"priority:share={share}",) if share else ())
    return LLMEngine(FakeExecutor(block_size=4, vocab_size=1000), cfg, num_kv_blocks=num_blocks, tokenizer=None)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_elastic_tiers_borrow_the_idle_share_and_give_it_back_at_the_next_step():
    engine = _engine(share=0.5)
    for i, tier in enumerate(["default", "flex", "default", "flex"]):
        engine.add_request(list(range(10 + i, 18 + i)), _greedy(50), f"e{i}", service_tier=tier)
    engine.step()
    assert engine.scheduler.num_running == 4  # every slot lent out while no priority request waits
    engine.add_request(list(range(100, 108)), _greedy(3), "p", service_tier="priority")
    engine.step()
    sched = engine.scheduler
    preempted = engine.executor.steps[-1].preempted_request_ids
    assert len(preempted) == 1 and preempted[0] in ("e1", "e3")  # flex yields first
    assert "p" in {c.request_id for c in engine.executor.steps[-1].chunks}  # admitted in the same step
    assert sched.stats.num_share_preemptions == 1 and sched.stats.preemptions_by_tier == {"flex": 1}
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert len(final) == 5 and all(len(o.token_ids) == (3 if r == "p" else 50) for r, o in final.items())


def test_no_share_means_priority_waits_its_turn():
    engine = _engine(share=0.0)
    for i in range(4):
        engine.add_request(list(range(10 + i, 18 + i)), _greedy(5), f"e{i}")
    engine.step()
    engine.add_request(list(range(100, 108)), _greedy(3), "p", service_tier="priority")
    engine.step()
    assert engine.executor.steps[-1].preempted_request_ids == ()
    assert engine.scheduler.stats.num_share_preemptions == 0


def test_elastic_requests_within_their_part_are_not_preempted():
    engine = _engine(share=0.5, max_num_seqs=4)
    for i in range(2):  # two elastic requests: within (1 - 0.5) x 4 slots
        engine.add_request(list(range(10 + i, 18 + i)), _greedy(20), f"e{i}")
    for i in range(2):
        engine.add_request(list(range(50 + i, 58 + i)), _greedy(20), f"p{i}", service_tier="priority")
    engine.step()
    engine.add_request(list(range(100, 108)), _greedy(3), "p-late", service_tier="priority")
    engine.step()
    assert engine.executor.steps[-1].preempted_request_ids == ()  # priority's own slots are full: it waits


def test_a_priority_reservation_takes_blocks_back_from_elastic_requests():
    engine = _engine(share=0.5, max_num_seqs=8, num_blocks=16)
    engine.add_request(list(range(0, 40)), _greedy(8), "e0", service_tier="flex")  # 10+ of 16 blocks
    engine.step()
    res = Request("p", list(range(200, 232)), _greedy(4), service_tier="priority")
    assert engine.scheduler.reserve_kv(res) is not None  # 8 blocks: e0 preempted for them
    scheduled = engine.scheduler.schedule()
    assert scheduled.preempted_request_ids == ("e0",)
    assert engine.scheduler.stats.preemptions_by_tier == {"flex": 1}


@pytest.mark.parametrize("argv, fragment", [
    (["serve", "--service-tier", "gold:ttft_ms=1"], "unknown tier 'gold'"),
    (["serve", "--service-tier", "flex:ttft_ms=1", "--service-tier", "flex:ttft_ms=2"], "given twice"),
    (["serve", "--api-key-tier", "gold"], "--api-key-tier must be"),
    (["serve", "--admission", "sometimes"], "--admission must be predict or off"),
    (["simulate", "--workload", "fixed:10,2", "--num-requests", "1", "--model", "llama-3-8b",
      "--service-tier", "priority:share=2"], "share must be in [0, 1)"),
])
def test_bad_tier_flags_are_one_line_cli_errors(argv, fragment, capsys):
    from pdserve.cli import main
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and "Traceback" not in err
