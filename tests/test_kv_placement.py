"""The KV lifecycle's metadata, set and read (`pdserve.core.kvstore.kv_placement`, `prefix_patterns`,
`kv_meta.StagedPolicy`, `kv_meta.servable`): each field is read by a named decision, and each test here fails
without the field being set (or without the decision reading it).

Engines are real `LLMEngine`s on `FakeExecutor` (which raises on any wrong or stale KV it reads) with the
loopback tier I/O of `test_kv_tiers` and a clock the test moves.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.core.kvstore.block_manager import KVBlockManager
from pdserve.core.kvstore.kv_meta import BlockMeta, LifecycleConfig, LRUPolicy, Pattern, StagedPolicy, Tier
from pdserve.core.kvstore.kv_ops import TierCapacity
from pdserve.core.kvstore.kv_tiers import build_tiered_kv
from pdserve.core.kvstore.prefix_patterns import PrefixPatterns
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.sched.schedule import SchedulerConfig
from pdserve.core.settings import KvTierSettings
from pdserve.engine.executor import FakeExecutor
from pdserve.engine.llm_engine import LLMEngine
from pdserve.errors import InvalidRequestError
from test_kv_tiers import BS, VOCAB, LoopbackIO, TierFakeExecutor, drain

T0 = 1000.0


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def make(num_blocks: int = 64, host: int = 0, disk: int = 0, placement: str = "staged", **kw):
    """An engine (tiers when `host`), its loopback I/O (or None) and its clock."""
    clock = Clock()
    executor = TierFakeExecutor(block_size=BS, vocab_size=VOCAB) if host else FakeExecutor(BS, VOCAB)
    io = None
    if host:
        io = executor.kv_io = LoopbackIO(executor, host, disk)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10_000, max_model_len=4096)
    engine = LLMEngine(executor, cfg, num_kv_blocks=num_blocks, clock=clock, kv_placement=placement, **kw)
    if io is not None:
        io.engine = engine
    return engine, io, clock


def serve(engine: LLMEngine, rid: str, prompt: list[int], n: int = 4, tier: str = "default") -> list[int]:
    """Run `rid` to its end (the clock stands still meanwhile); its output tokens."""
    engine.add_request(prompt, greedy(n), rid, service_tier=tier)
    out = []
    for _ in range(200):
        for o in engine.step():
            if o.request_id == rid:
                out = o.token_ids
                if o.finished:
                    return list(out)
    raise AssertionError(f"{rid} did not finish")


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def device_meta(engine: LLMEngine, block_hash: int):
    block_id = engine.block_manager.cached_block(block_hash)
    return None if block_id is None else engine.block_manager.meta(block_id)


def conversation(engine: LLMEngine, clock: Clock, gaps: list[float], first: int = 32, turn: int = 8,
                 seed: int = 1, name: str = "c") -> list[int]:
    """Turns of one conversation: each prompt is the last prompt + its answer + `turn` new tokens, sent
    `gaps[i]` seconds after the previous turn ended. Returns the last turn's whole sequence."""
    prompt = tokens(first, seed)
    for i in range(len(gaps) + 1):
        if i:
            clock.t += gaps[i - 1]
            prompt = prompt + answer + tokens(turn, seed + 100 + i)
        answer = serve(engine, f"{name}{i}", prompt)
    return prompt + answer


# ---- expected use: from think time ----------------------------------------------------------------------
def test_a_turn_end_sets_expected_use_from_its_conversations_think_time():
    engine, _, clock = make()
    seq = conversation(engine, clock, [30.0])  # turn 1 ended at T0, turn 2 came 30 s later and ended then
    hashes = engine.block_manager.sequence_hashes(seq[:-1])  # (the last token's KV is never computed)
    ends = T0 + 30.0
    last = device_meta(engine, hashes[-1])
    assert last.expected_use_at_s == pytest.approx(ends + 30.0)  # its own think time, median of one
    assert last.pattern == Pattern.RECURRING
    assert device_meta(engine, hashes[0]).expected_use_at_s == pytest.approx(ends + 30.0)


def test_a_first_turn_with_no_prior_gets_no_expected_use():
    engine, _, clock = make()
    serve(engine, "a", tokens(32, 5))
    block_hash = engine.block_manager.sequence_hashes(tokens(32, 5))[0]
    meta = device_meta(engine, block_hash)
    assert meta.expected_use_at_s is None and meta.pattern == Pattern.UNKNOWN


def test_the_heat_policys_expected_back_rule_fires_from_a_think_time():
    """--kv-eviction-policy heat (write-through placement): a conversation's blocks, expected back within the
    policy's 60 s, outlive blocks used as often but expected by nobody (before: the rule never fired)."""
    engine, _, clock = make(num_blocks=24, placement="write-through", kv_eviction_policy="heat")
    seq = conversation(engine, clock, [20.0], first=24, turn=4, seed=3)  # ends expecting a turn 20 s later
    conv = engine.block_manager.sequence_hashes(seq)
    serve(engine, "other", tokens(24, 40))  # used once, later: the LRU order would evict the conversation
    clock.t += 1.0
    serve(engine, "big", tokens(60, 41), n=1)  # needs blocks: 5 cached ones go
    assert all(engine.block_manager.cached_block(h) is not None for h in conv[:6])
    assert engine.block_manager.find_prefix(tokens(24, 40) + [0]).num_tokens < 24


# ---- class --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("placement", ["staged", "write-through"])
def test_a_guaranteed_tiers_prefix_outlives_a_flex_one_at_equal_heat(placement):
    engine, _, clock = make(num_blocks=12, placement=placement)
    a, b = tokens(16, 7), tokens(16, 8)
    serve(engine, "a", a, n=1, tier="priority")  # older, same heat
    serve(engine, "b", b, n=1, tier="flex")
    bm = engine.block_manager
    assert device_meta(engine, bm.sequence_hashes(a)[0]).sla_class == "priority"
    assert device_meta(engine, bm.sequence_hashes(b)[0]).sla_class == "flex"
    serve(engine, "c", tokens(32, 9), n=1)  # 8 blocks: the 4 empty ones and 4 cached ones
    kept_a = bm.find_prefix(a + [0]).num_tokens == 16
    kept_b = bm.find_prefix(b + [0]).num_tokens == 16
    if placement == "staged":
        assert kept_a and not kept_b
    else:  # least recently used first, class or not
        assert kept_b and not kept_a


def test_a_hit_by_a_better_class_upgrades_the_blocks_class():
    engine, _, _ = make()
    a = tokens(16, 7)
    serve(engine, "a", a, n=1, tier="flex")
    serve(engine, "a2", a + [1, 2, 3, 4], n=1, tier="priority")
    assert device_meta(engine, engine.block_manager.sequence_hashes(a)[0]).sla_class == "priority"


# ---- codec --------------------------------------------------------------------------------------------------
def test_blocks_record_the_real_codec_of_each_tier():
    engine, io, _ = make(host=64, disk=64, kv_format="int8")
    a = tokens(16, 3)
    serve(engine, "a", a)
    drain(engine, io)
    h = engine.block_manager.sequence_hashes(a)[0]
    assert device_meta(engine, h).codec == "int8"
    assert engine.tiers.host.get(h).codec == "int8" and engine.tiers.disk.get(h).codec == "int8"
    bm = KVBlockManager(4, 4, clock=lambda: 0.0, codec="bfloat16")  # tiers of their own codecs
    tiers = build_tiered_kv(bm, TierCapacity(4, 4, 64, host_codec="int8", disk_codec="int4"), LRUPolicy(),
                            LifecycleConfig())
    assert (tiers.host.codec, tiers.disk.codec) == ("int8", "int4")
    tiers.host.reserve(7, 0.0, bm.cols.view(0))  # a copy down takes the tier's codec, not the block's above
    assert tiers.host.get(7).codec == "int8"


def test_a_host_block_in_another_codec_is_never_loaded():
    engine, io, clock = make(num_blocks=8, host=64)
    a = tokens(17, 3)
    serve(engine, "a", a)
    drain(engine, io)
    serve(engine, "b", tokens(30, 4), n=1)  # pushes `a` off the device
    h = engine.block_manager.sequence_hashes(a)[0]
    assert engine.block_manager.cached_block(h) is None and engine.tiers.host.ready(h) is not None
    engine.tiers.host.get(h).codec = "fp8_e4m3"  # (bytes in a format this tier does not hold, e.g. an old run's)
    engine.step()
    hits = engine.tiers.stats.hit_tokens[Tier.HOST]
    serve(engine, "a2", a)
    assert engine.tiers.stats.hit_tokens[Tier.HOST] == hits  # recomputed, not loaded
    assert engine.tiers.stats.unservable["codec"] == 1  # dropped; the recomputed block took its place
    assert engine.tiers.host.get(h).codec == "float32"


# ---- produced-at: the retention limit -----------------------------------------------------------------------
@pytest.mark.parametrize("age_s,served", [(50.0, True), (150.0, False)])
def test_a_lower_tier_block_older_than_the_retention_limit_is_not_served(age_s, served):
    engine, io, clock = make(num_blocks=8, host=64, kv_max_age_s=100.0)
    a = tokens(17, 3)
    serve(engine, "a", a)
    drain(engine, io)
    serve(engine, "b", tokens(30, 4), n=1)  # pushes `a` off the device
    clock.t += age_s
    serve(engine, "a2", a)
    assert (engine.tiers.stats.hit_tokens[Tier.HOST] > 0) == served
    assert engine.tiers.stats.unservable["stale"] == (0 if served else 4)  # each of `a`'s blocks, dropped


def test_restored_disk_blocks_past_the_retention_limit_are_deleted_not_indexed():
    bm = KVBlockManager(4, 4, clock=lambda: 0.0)
    restored = [(1, 900.0, 950.0), (2, 100.0, 950.0)]  # produced 100 s and 900 s before wall_now
    tiers = build_tiered_kv(bm, TierCapacity(4, 4, 64), LRUPolicy(), LifecycleConfig(), restored,
                            wall_now=1000.0, max_age_s=500.0)
    assert 1 in tiers.disk.entries and 2 not in tiers.disk.entries and tiers.stale == [2]


# ---- access patterns, read by retention ------------------------------------------------------------------
def test_patterns_from_reuse_history():
    p = PrefixPatterns()
    conv = list(range(1, 9))
    p.ended("t1", conv, 8, 0.0)
    assert p.arrived("t2", conv + [9, 10], 30.0) is not None  # extends it: a turn
    e = p.ended("t2", conv + [9, 10], 10, 31.0)
    assert e.pattern == Pattern.RECURRING and e.expected_s == pytest.approx(61.0)
    doc = [100, 101, 102, 103]  # the same prompt, every 60 s
    t = 0.0
    p.ended("d0", doc, 4, t)
    for i in range(1, 4):
        t += 60.0
        p.arrived(f"d{i}", doc, t)
        e = p.ended(f"d{i}", doc, 4, t + 1.0)
        t += 1.0
    assert e.pattern == Pattern.PERIODIC and e.expected_s == pytest.approx(t + 60.0)
    once = [200, 201, 202, 203]
    p.prior.extend([20.0] * 8)
    e = p.ended("o", once, 4, 500.0)  # a first turn: expected from the prior, then it lapses
    assert e.pattern == Pattern.UNKNOWN and e.late_s is not None
    assert p.lapsed(e.key, e.ended_s).pattern == Pattern.ONE_OFF
    assert p.reuse_p(Pattern.UNKNOWN) < p.reuse_p(Pattern.RECURRING)


def test_a_shared_system_prompt_is_not_taken_for_a_turn():
    p = PrefixPatterns()
    system = list(range(1, 33))
    p.ended("u1", system + list(range(100, 164)), 96, 0.0)  # another user's long prompt, same system prompt
    assert p.arrived("u2", system + list(range(300, 364)), 5.0) is None


def test_retention_lets_a_one_off_prefix_go_first():
    policy = StagedPolicy()
    plain = BlockMeta(1, Tier.HOST, 0, 0.0, 10.0, use_count=1, heat=1.0, heat_at_s=10.0)
    once = BlockMeta(2, Tier.HOST, 1, 0.0, 11.0, use_count=1, heat=1.0, heat_at_s=11.0, pattern="one_off")
    assert policy.score(once, 20.0) < policy.score(plain, 20.0)


def test_a_lapsed_expectation_marks_the_prefix_one_off_and_it_is_evicted_first():
    engine, _, clock = make(num_blocks=40)
    engine.kv_lifecycle.patterns.prior.extend([10.0] * 8)  # a prior: first turns get an expected use and a lapse
    a, b = tokens(32, 11), tokens(32, 12)
    serve(engine, "a", a, n=1)
    clock.t += 5.0
    serve(engine, "b", b, n=1)
    bm = engine.block_manager
    ha, hb = bm.sequence_hashes(a), bm.sequence_hashes(b)
    assert device_meta(engine, ha[0]).pattern == Pattern.UNKNOWN
    clock.t += 25.0  # past `a`'s and `b`'s lapse (2 x 10 s after each end)
    b2 = b + [1, 2, 3, 4]
    serve(engine, "b2", b2, n=1)  # `b` came back in time? no: too late, but it is used again now
    assert device_meta(engine, ha[0]).pattern == Pattern.ONE_OFF
    assert device_meta(engine, ha[0]).expected_use_at_s is None
    serve(engine, "big", tokens(100, 13), n=1)  # needs the room of 2 cached blocks
    assert bm.find_prefix(b + [0]).num_tokens == 32 and bm.find_prefix(a + [0]).num_tokens < 32


# ---- stages drive placement: prefetch ahead of an expected use -------------------------------------------
def _steady_conversation(placement: str, come_back: bool = True):
    """A conversation whose turns come 60 s apart; between turns another prompt as large as the device pool
    and the host tier pushes its blocks down to disk. Returns (engine, io, clock, the last turn's prefix hit
    tokens by tier)."""
    engine, io, clock = make(num_blocks=160, host=160, disk=1600, placement=placement)
    prompt, answer = tokens(48, 1), None
    for i in range(5):
        if i:
            clock.t += 40.0
            serve(engine, f"x{i}", tokens(636, 1000 + i), n=1)  # 159 blocks: nothing else stays above disk
            drain(engine, io)
            for dt in (5.0, 5.0, 5.0, 4.0, 1.0):  # an idle worker's loop, up to the next turn
                clock.t += dt
                engine.poll_kv()
                drain(engine, io)
                while engine.scheduler.has_pending_loads:  # (it steps for them)
                    engine.step()
            if i == 4 and not come_back:
                return engine, io, clock, None
            prompt = prompt + answer + tokens(4, 500 + i)
        before = dict(engine.tiers.stats.hit_tokens), engine.scheduler.stats.num_prefix_hit_tokens
        answer = serve(engine, f"c{i}", prompt)
        drain(engine, io)
    lower = {t: engine.tiers.stats.hit_tokens[t] - before[0].get(t, 0) for t in (Tier.HOST, Tier.DISK)}
    total = engine.scheduler.stats.num_prefix_hit_tokens - before[1]
    return engine, io, clock, {"device": total - sum(lower.values()), "host": lower[Tier.HOST],
                               "disk": lower[Tier.DISK]}


def test_prefetch_brings_an_expected_prefix_back_to_the_device_ahead_of_its_turn():
    staged, _, _, staged_hits = _steady_conversation("staged")
    plain, _, _, plain_hits = _steady_conversation("write-through")
    moves = {(m["kind"], m["stage"], m["src"], m["dst"]): m["blocks"]
             for m in staged.kv_report()["placement"]["moves"]}
    assert moves.get(("promotion", "decay", "disk", "host"), 0) > 0  # disk -> host ahead of the turn
    assert moves.get(("promotion", "decay", "host", "device"), 0) > 0  # then host -> device
    prefetch = staged.kv_report()["placement"]["prefetch"]
    assert prefetch["used"] > 0
    assert staged_hits == {"device": 48 + 8 * 3, "host": 0, "disk": 0}  # all the last turn left, on the device
    assert plain_hits["device"] <= 4 and plain_hits["disk"] > 0  # write-through: read from disk on arrival
    assert plain.kv_report()["placement"]["prefetch"]["issued"] == 0


def test_a_prefetch_whose_turn_never_comes_is_counted_wasted():
    engine, io, clock, _ = _steady_conversation("staged", come_back=False)
    issued = engine.kv_report()["placement"]["prefetch"]["issued"]
    assert issued > 0
    clock.t += 600.0  # past the lapse
    engine.poll_kv()
    prefetch = engine.kv_report()["placement"]["prefetch"]
    assert prefetch["wasted"] > 0 and prefetch["used"] + prefetch["wasted"] <= prefetch["issued"]


def test_evictions_are_counted_as_demotions_or_drops_by_stage():
    engine, io, _, _ = _steady_conversation("write-through")
    moves = engine.kv_report()["placement"]["moves"]
    kinds = {(m["kind"], m["src"], m["dst"]) for m in moves}
    assert ("demotion", "device", "host") in kinds and ("demotion", "host", "disk") in kinds
    assert {m["stage"] for m in moves if m["kind"] == "demotion"} <= {"active", "decay", "reclaim"}


# ---- expected use from the consumption prediction (decode side) -----------------------------------------
def test_a_delivery_expected_sooner_loads_its_host_hits_first():
    engine, io, clock = make(num_blocks=48, host=64)
    a, b = tokens(16, 21), tokens(16, 22)
    for rid, p in (("a", a), ("b", b)):
        serve(engine, rid, p, n=1)
    drain(engine, io)
    serve(engine, "push", tokens(190, 23), n=1)  # takes the whole pool: both leave the device (not host)
    drain(engine, io)
    bm = engine.block_manager
    assert bm.find_prefix(a + [0]).num_tokens == 0 and bm.find_prefix(b + [0]).num_tokens == 0
    engine.scheduler.ahead_load_blocks = 1
    reqs = [engine.make_request(rid, p + [1, 2], greedy(2)) for rid, p in (("ra", a), ("rb", b))]
    for r in reqs:
        assert engine.scheduler.reserve_kv(r) == 16  # host hits, loaded ahead of the KV
    engine.scheduler.expect_kv("rb", clock.t + 0.5)  # rb's KV is predicted to be consumed first
    assert bm.cols.expected_use_at_s[bm.block_ids("rb")[0]] == pytest.approx(clock.t + 0.5)
    out = engine.scheduler.schedule()
    assert [ld.block_id for ld in out.kv_loads_ahead] == [bm.block_ids("rb")[0]]


# ---- settings --------------------------------------------------------------------------------------------------
def test_bad_placement_and_retention_are_one_line_errors():
    with pytest.raises(InvalidRequestError, match="unknown kv_placement 'fast'; choose from write-through, staged"):
        KvTierSettings(kv_placement="fast")
    with pytest.raises(InvalidRequestError, match="kv_max_age_s must be positive"):
        KvTierSettings(kv_max_age_s=0)
    assert math.isfinite(KvTierSettings().kv_max_age_s)


# ---- the simulator runs the same decisions ----------------------------------------------------------------
def test_the_simulator_keeps_conversations_on_the_device_and_serves_later_turns_sooner():
    from test_sim_tiers import SMALL_HOST, conversations, kv, later_turn_ttft, run
    wl = conversations(n_conv=6, turns=5, gap_s=3.0, stagger_s=0.4, output_len=8)
    plain, staged = (run(wl, host_kv_gb=SMALL_HOST, disk_kv_gb=1, kv_placement=p) for p in ("write-through", "staged"))
    hits = {name: kv(r)["colocated"]["hit_tokens"] for name, r in (("plain", plain), ("staged", staged))}
    assert hits["staged"]["device"] > 2 * hits["plain"]["device"]
    assert later_turn_ttft(staged) < later_turn_ttft(plain)
    moves = staged.engines[0]["kv_tiers"]["placement"]
    assert moves["prefetch"]["issued"] > 0 and plain.engines[0]["kv_tiers"]["placement"]["prefetch"]["issued"] == 0


def test_the_simulators_tiers_record_their_own_codecs():
    from pdserve.sim.cluster import ClusterSpec, build
    from pdserve.sim.hardware import get_gpu, get_model
    from pdserve.sim.timemodel import RooflineTimeModel
    model, gpu = get_model("llama-3-8b"), get_gpu("h100")
    spec = ClusterSpec(mode="colocated", num_kv_blocks=64, host_kv_gb=1, disk_kv_gb=2, kv_host_cache_dtype="int8")
    _, _, engines = build(spec, model, gpu, RooflineTimeModel(model, gpu, 1))
    tiers = engines[0].tiers
    assert engines[0].engine.block_manager.codec == "bfloat16"
    assert (tiers.host.codec, tiers.disk.codec) == ("int8", "int8")
