"""Production paced per link (`pdserve.core.pd.production_pace`): the pace's arithmetic, and the scheduler
honouring it on a prefill engine (FakeExecutor): a backed-up link's prompts wait while other links' prompts
run, chunks shrink to the link's headroom, the queue order survives."""

from __future__ import annotations

from collections import Counter

import pytest

from pdserve.core.pd.delivery import WaterLevel
from pdserve.core.pd.production_pace import ProductionPace
from pdserve.core.request import RequestStatus
from pdserve.core.sampling_params import SamplingParams
from tests.test_scheduler import make_engine

BPT = 100.0  # KV bytes per prompt token
RATE = 1000.0  # link bytes/s: 10 tokens/s
WATER = WaterLevel(2.0)  # 2 s of queued delivery: 2,000 bytes, 20 tokens


class Req:
    def __init__(self, rid: str, tier: str = "default") -> None:
        self.request_id, self.service_tier = rid, tier


def pace_for(queued: dict[str, float], links: dict[str, str | None], counts=None) -> ProductionPace:
    return ProductionPace.build([Req(r) for r in links], links.get, lambda link, tiers: [(queued[link], RATE)],
                                WATER, BPT, 4, counts)


def test_held_link_headroom_and_whole_worker_hold():
    pace = pace_for({"a": 2500.0, "b": 1500.0}, {"r1": "a", "r2": "b", "r3": "b"})
    assert pace.hold_s == 0  # b still has room: the worker steps
    assert pace.blocked("r1") and pace.cap("r1", 100) == 0
    assert pace.cap("r2", 100) == 5  # (2,000 - 1,500) bytes of headroom / 100 bytes per token
    pace.spend("r2", 5)
    assert pace.blocked("r3") and pace.cap("r3", 100) == 0  # b's headroom went to r2's chunk
    assert pace.counts == Counter(held=1, capped=2)
    roomy = pace_for({"b": 0.0}, {"r2": "b"})
    assert roomy.cap("r2", 3) == 3 and not roomy.counts  # a chunk within the headroom is not cut


def test_first_chunk_gets_a_block_and_all_held_holds_the_worker():
    pace = pace_for({"a": 1990.0}, {"r1": "a"})
    assert pace.cap("r1", 100) == 4  # 10 bytes of room: still one block (min_tokens), never stuck
    held = pace_for({"a": 2500.0, "b": 3000.0}, {"r1": "a", "r2": "b"})
    assert held.hold_s == pytest.approx(0.5)  # the soonest link to drain: a, 2.5 s - 2 s
    stage = pace_for({"a": 2500.0}, {"r1": "a", "s@stage": None})
    assert stage.hold_s == 0 and stage.cap("s@stage", 100) == 100  # no link: not paced


def test_no_rate_or_no_water_level_is_not_paced():
    pace = ProductionPace.build([Req("r1")], {"r1": "a"}.get, lambda link, tiers: [(1e9, None)], WATER, BPT, 4)
    assert pace.cap("r1", 100) == 100 and pace.hold_s == 0
    off = ProductionPace.build([Req("r1")], {"r1": "a"}.get, lambda link, tiers: [(1e9, RATE)], WaterLevel(0), BPT, 4)
    assert off.cap("r1", 100) == 100 and off.hold_s == 0


def test_tiers_counted_per_link():
    """A priority prompt bound for a link counts only priority KV queued there, not the flex backlog."""
    seen = {}

    def backlog(link, tiers):
        seen[link] = tiers
        return [(0.0, RATE)]
    ProductionPace.build([Req("p", "priority"), Req("f", "flex"), Req("d", "default")],
                         {"p": "a", "f": "a", "d": "b"}.get, backlog, WATER, BPT, 4)
    assert seen == {"a": {"priority"}, "b": {"priority", "default"}}


def _prefill_engine():
    eng = make_engine(block_size=4)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for rid in ("r1", "r2", "r3"):  # r1 and r3 bound for link a, r2 for link b
        eng.scheduler.add_request(eng.make_request(rid, list(range(1, 41)), params, prefill_only=True))
    return eng


def test_scheduler_skips_held_link_and_keeps_queue_order():
    eng = _prefill_engine()
    links = {"r1": "a", "r2": "b", "r3": "a"}
    eng.scheduler.pace = pace_for({"a": 2500.0, "b": 1200.0}, links)
    eng.step()
    chunks = {c.request_id: c.num_tokens for c in eng.executor.steps[-1].chunks}
    assert chunks == {"r2": 8}  # a is held; b's 800 bytes of headroom = 8 tokens
    assert eng.scheduler.num_waiting == 2 and eng.scheduler.requests["r1"].status is RequestStatus.WAITING
    eng.scheduler.pace = None  # the links drained: all go, in their arrival order (r2 yields to r1)
    eng.step()
    order = [c.request_id for c in eng.executor.steps[-1].chunks]
    assert order == ["r1", "r2", "r3"]


def test_running_prefill_pauses_at_chunk_boundary_on_held_link():
    eng = _prefill_engine()
    links = {"r1": "a", "r2": "b", "r3": "a"}
    eng.scheduler.pace = pace_for({"a": 1600.0, "b": 0.0}, links)
    eng.step()
    first = {c.request_id: c.num_tokens for c in eng.executor.steps[-1].chunks}
    assert first == {"r1": 4, "r2": 20}  # a: 400 bytes = 4 tokens to r1, r3 blocked; b: 20 tokens
    held = list(eng.block_manager.block_ids("r1"))
    eng.scheduler.pace = pace_for({"a": 2100.0, "b": 0.0}, links)  # a went over the water level
    eng.step()
    second = {c.request_id: c.num_tokens for c in eng.executor.steps[-1].chunks}
    assert second == {"r2": 20}  # r1 keeps its blocks, computes nothing
    assert eng.scheduler.requests["r1"].num_computed_tokens == 4
    assert list(eng.block_manager.block_ids("r1")) == held
