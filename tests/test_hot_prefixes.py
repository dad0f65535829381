"""Idle prewarm: hot prefixes counted by the conductor core and computed ahead on an idle prefill worker
(`pdserve.conductor.hot_prefixes`, `pdserve.conductor.staging.Staging`), and the same in the simulator."""

from __future__ import annotations

from array import array

import numpy as np
import pytest

from pdserve.bench.metrics import RequestRecord
from pdserve.conductor.actions import stale
from pdserve.conductor.conductor_core import ConductorCore, Count, Send
from pdserve.conductor.hot_prefixes import HALF_LIFE_S, MAX_HOT, DecayedCounts, HotPrefixes
from pdserve.conductor.routing import WorkerLoad
from pdserve.conductor.routing_policies import make_routing_policy
from pdserve.conductor.wire import Ready
from pdserve.core.kvstore.block_hash import hash_blocks
from pdserve.sim.cluster import ClusterSpec, build
from pdserve.sim.events import MESSAGE
from pdserve.sim.hardware import get_gpu, get_model
from pdserve.sim.timemodel import RooflineTimeModel

BS = 16
SHARED = list(range(1000, 1000 + 4 * BS))  # a 4-block prefix


def _prompt(tail: int) -> list[int]:
    return SHARED + [50_000 + 100 * tail + k for k in range(20)]


def _observe(hot: HotPrefixes, prompt: list[int], now: float) -> tuple:
    hashes = hash_blocks(prompt, BS)
    hot.observe(hashes, prompt, BS, now)
    return hashes


def test_a_prefix_shared_by_recent_requests_is_hot_and_goes_to_a_worker_that_lacks_it():
    hot = HotPrefixes()
    _observe(hot, _prompt(1), 0.0)
    lacking, having = WorkerLoad("prefill-1", "prefill"), WorkerLoad("prefill-0", "prefill")
    assert hot.pick(lacking, 1000, 0.0) is None  # one request is not a pattern
    hashes = _observe(hot, _prompt(2), 1.0)
    having.remember(hashes)
    p = hot.pick(lacking, 1000, 1.0)
    assert p is not None and p.tokens == SHARED and p.hashes == tuple(hashes[:4])  # the shared blocks only
    assert hot.pick(having, 1000, 1.0) is None  # it has the prefix already
    assert hot.pick(WorkerLoad("prefill-2", "prefill"), 3, 1.0) is None  # it would not fit its staging room
    # nothing new turned hot since it looked: it does not look again; a new hot prefix makes it look
    assert hot.pick(having, 1000, 1.5) is None
    other = list(range(7000, 7000 + 3 * BS))
    for t in (2.0, 3.0):
        _observe(hot, other + [t], t)
    assert hot.pick(having, 1000, 3.0).tokens == other
    # a prefix no one asked for in many half-lives cools down
    assert hot.pick(lacking, 1000, 1.0 + 10 * HALF_LIFE_S) is None and not hot.hot


def test_hot_prefixes_kept_are_bounded():
    hot = HotPrefixes()
    for i in range(MAX_HOT + 10):
        prefix = [10_000 * (i + 1) + k for k in range(2 * BS)]
        _observe(hot, prefix + [1], 0.0)
        _observe(hot, prefix + [2], 0.0)
    assert len(hot.hot) == MAX_HOT


def _core() -> ConductorCore:
    core = ConductorCore("pd", make_routing_policy("prefix-affinity"))
    for name, role in (("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")):
        core.add_worker(name, role)
        core.worker_ready(name, Ready(name, role, block_size=BS, stage_blocks=64 if role == "prefill" else 0,
                                      stage_max_blocks=64))
    return core


def _serve(core: ConductorCore, rid: str, now: float) -> None:
    """`rid` reserved, prefilled and finished: its prefill worker is idle again."""
    core.reserved(rid, core.flights[rid].xfer, True, "addr", 0, now)
    core.prefilled(rid, now)
    core.token(rid, 0, True, now)


def test_an_idle_prefill_worker_warms_the_hot_prefix_and_routing_then_spreads_its_requests():
    core = _core()
    core.arrive("a", _prompt(1), {}, 0.0)
    assert core.flights["a"].prefill == "prefill-0"
    _serve(core, "a", 0.5)
    actions = core.arrive("b", _prompt(2), {}, 1.0)  # affinity: prefill-0 again; the prefix is hot now
    assert core.flights["b"].prefill == "prefill-0"
    (warm,) = [a for a in actions if isinstance(a, Send) and a.cmd.kind == "warm"]
    assert warm.worker == "prefill-1" and warm.cmd.prompt == SHARED
    # one pass at a time: the next arrival does not start another
    assert not [a for a in core.arrive("c", _prompt(3), {}, 1.1) if isinstance(a, Send) and a.cmd.kind == "warm"]
    done = core.staged(warm.cmd.rid, True, 2.0)
    assert Count("kv_idle_prewarms", (("worker", "prefill-1"), ("outcome", "done"))) in done
    assert core.workers["prefill-1"].prefix_blocks(hash_blocks(_prompt(4), BS)) == 4
    # with prefill-0 busy (b and c), the next request sharing the prefix goes to prefill-1, cache and all
    core.arrive("d", _prompt(4), {}, 2.1)
    assert core.flights["d"].prefill == "prefill-1"
    assert core.flights["d"].queued_tokens == len(_prompt(4)) - len(SHARED)


def test_no_warm_pass_while_work_is_routed_there_without_staging_room_or_when_off():
    core = ConductorCore("pd", make_routing_policy("prefix-affinity"), idle_prewarm=False)
    for name, role in (("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")):
        core.add_worker(name, role)
        core.worker_ready(name, Ready(name, "prefill", block_size=BS, stage_blocks=64, stage_max_blocks=64))
    for i in range(4):
        actions = core.arrive(f"r{i}", _prompt(i), {}, float(i))
        assert not [a for a in actions if isinstance(a, Send) and a.cmd.kind == "warm"]
    core = _core()
    # --delivery fifo: no staging room
    core.worker_ready("prefill-1", Ready("prefill-1", "prefill", block_size=BS, stage_blocks=0))
    for i in range(4):
        actions = core.arrive(f"r{i}", _prompt(i), {}, float(i))
        assert not [a for a in actions if isinstance(a, Send) and a.cmd.kind == "warm"]


def test_a_warm_pass_on_a_dying_worker_is_forgotten():
    core = _core()
    core.arrive("a", _prompt(1), {}, 0.0)
    _serve(core, "a", 0.5)
    (warm,) = [a for a in core.arrive("b", _prompt(2), {}, 1.0) if isinstance(a, Send) and a.cmd.kind == "warm"]
    core.worker_died("prefill-1", 1.5)
    assert not core.staging.hot.warming and "prefill-1" not in core.staging.plan.staging
    assert core.staged(warm.cmd.rid, True, 2.0) == stale("staged")  # a late report changes nothing: counted


def test_the_simulator_warms_hot_prefixes_with_the_same_core():
    model, gpu = get_model("llama-3-8b"), get_gpu("h100")
    spec = ClusterSpec(mode="pd", num_prefill=2, num_decode=1, num_kv_blocks=2000, host_kv_gb=0)
    loop, conductor, engines = build(spec, model, gpu, RooflineTimeModel(model, gpu, 1))
    doc = [3000 + k for k in range(2048)]  # a shared 2,048-token document, then a question each

    def arrive(i: int) -> None:
        prompt = array("q", doc + [60_000 + 50 * i + k for k in range(50)])
        conductor.submit(f"q{i}", prompt, 8, RequestRecord(start_s=loop.now, prompt_tokens=len(prompt)))

    for i in range(6):
        loop.at(i * 1.0, arrive, i, prio=MESSAGE)
    loop.run()
    assert conductor.life.idle_prewarms == 1
    warmed = {labels: c for (metric, labels), c in conductor.counts.items() if metric == "kv_idle_prewarms"}
    assert warmed == {(("worker", "prefill-1"), ("outcome", "done")): 1}
    prefill = {e.name: e for e in engines if e.role == "prefill"}
    cached = {name: e.engine.block_manager.find_prefix(doc, "probe").num_tokens for name, e in prefill.items()}
    assert cached == {"prefill-0": 2048 - 16, "prefill-1": 2048 - 16}  # (a hit leaves the last block to compute)
    assert prefill["prefill-1"].scheduler.stats.num_prompt_tokens == 2048  # the warm pass: the document alone


def test_counts_that_decayed_to_nothing_are_forgotten_so_steady_load_keeps_the_table_flat():
    # a stream of distinct prompts, one every second: the table holds the last few half-lives' hashes,
    # not every hash seen (the gateway's memory under steady load: `benchmarks/soak.py`)
    hot = HotPrefixes()
    sizes = []
    for t in range(int(12 * HALF_LIFE_S)):
        _observe(hot, [t * 1000 + k for k in range(3 * BS)], float(t))
        sizes.append(len(hot._counts))
    per_prompt, sweep = 3, HALF_LIFE_S / 4  # (decayed hashes are dropped every quarter half-life)
    assert max(sizes) <= per_prompt * (4 * HALF_LIFE_S + sweep + 2)  # 1/16 of a count: four half-lives
    late = sizes[int(6 * HALF_LIFE_S):]
    assert max(late) - min(late) <= per_prompt * (sweep + 1)  # flat, but for the sweeps
    # a shared prefix seen within the window is kept, and still turns hot
    _observe(hot, _prompt(1), 1000.0)
    _observe(hot, _prompt(2), 1000.0 + HALF_LIFE_S / 2)
    assert hot.pick(WorkerLoad("prefill-1", "prefill"), 1000, 1000.0 + HALF_LIFE_S / 2) is not None


def test_a_worker_remembers_no_more_block_hashes_than_its_kv_capacity():
    core = ConductorCore("pd", make_routing_policy("prefix-affinity"))
    load = core.add_worker("decode-0", "decode")
    core.worker_ready("decode-0", Ready("decode-0", "decode", block_size=BS, kv_capacity_blocks=8))
    assert load.max_recent_blocks == 8
    for t in range(20):
        load.remember(hash_blocks([t * 1000 + k for k in range(2 * BS)], BS))
    assert len(load.recent_blocks) == 8


def test_decayed_counts_halve_per_half_life_and_a_full_table_drops_the_least_recently_seen():
    counts = DecayedCounts(capacity=64)
    first, second = np.arange(1, 41, dtype=np.uint64), np.arange(100, 130, dtype=np.uint64)
    assert counts.add(first, 0.0)[0].tolist() == [1.0] * 40
    got, labels = counts.add(first[:2], HALF_LIFE_S, 2)  # one request, a half-life ago, + this one (secret)
    assert got.tolist() == [1.5, 1.5] and labels.tolist() == [2, 2]
    counts.add(second, HALF_LIFE_S + 1)  # 70 hashes in 64 places: the oldest go (of `first`, not its two)
    assert len(counts) <= 64
    again, labels = counts.add(np.concatenate((first[:2], second)), HALF_LIFE_S + 2)
    assert (again > 1.9).all()  # all still counted
    assert labels.tolist() == [2, 2] + [0] * 30  # the strictest label seen with each stays
    rest, labels = counts.add(first[2:], HALF_LIFE_S + 3)
    assert rest.min() == 1.0 and labels.max() == 0  # some of the rest had been dropped


@pytest.mark.parametrize("labels", [("secret", "internal"), ("internal", "secret"), ("public", "public")])
def test_a_warm_pass_carries_the_strictest_label_its_prefix_was_seen_with(labels):
    """A hot prefix a `secret` request shared is prewarmed as `secret` whichever came first (its KV then stays
    off an unsealed disk and is encrypted on any path, `pdserve.core.pd.sensitivity`)."""
    core = _core()
    core.arrive("a", _prompt(1), {}, 0.0, sensitivity=labels[0])
    _serve(core, "a", 0.5)
    actions = core.arrive("b", _prompt(2), {}, 1.0, sensitivity=labels[1])
    (warm,) = [a for a in actions if isinstance(a, Send) and a.cmd.kind == "warm"]
    assert warm.cmd.sensitivity == max(labels, key=("public", "internal", "secret").index)
