"""Scheduler + engine loop against FakeExecutor, whose KV checks and context-hash sampling make any
batching, chunking, prefix-cache or preemption mistake show up as a raise or as different output tokens."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.core.sampling_params import SamplingParams
from pdserve.core.sched.schedule import SchedulerConfig
from pdserve.engine.executor import FakeExecutor
from pdserve.engine.llm_engine import LLMEngine
from pdserve.errors import ContextLengthExceededError, InvalidRequestError

VOCAB = 50
BIG_BLOCKS = 4096


def greedy(max_tokens: int, **kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def make_engine(block_size=4, num_blocks=BIG_BLOCKS, max_num_seqs=128, max_num_batched_tokens=100_000,
                max_model_len=8192, prefix_caching=True, policy="fcfs", eos=()):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len, queue_policy=policy)
    return LLMEngine(FakeExecutor(block_size=block_size, vocab_size=VOCAB), cfg, num_kv_blocks=num_blocks,
                     tokenizer=None, enable_prefix_caching=prefix_caching, eos_token_ids=eos)


def check_step(engine: LLMEngine, scheduled) -> None:
    cfg = engine.scheduler.config
    assert scheduled.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(scheduled.chunks) <= cfg.max_num_seqs
    assert engine.scheduler.num_running <= cfg.max_num_seqs
    assert len({c.request_id for c in scheduled.chunks}) == len(scheduled.chunks)
    bs = engine.block_manager.block_size
    for c in scheduled.chunks:
        assert c.num_tokens > 0
        assert len(c.block_ids) * bs >= c.start_pos + c.num_tokens
    bm = engine.block_manager
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks


def step(engine: LLMEngine, final: dict) -> None:
    """One engine step; record finished outputs in `final` and check the step's shape."""
    running_before = {r.request_id for r in engine.scheduler.running}
    for o in engine.step():
        assert o.request_id not in final, "output after finishing"
        if o.finished:
            final[o.request_id] = o
    s = engine.executor.steps[-1]
    check_step(engine, s)
    if s.preempted_request_ids:  # a step that had to preempt admits nothing (it would only thrash)
        assert {c.request_id for c in s.chunks} <= running_before - set(s.preempted_request_ids)


def run(engine: LLMEngine, final: dict | None = None, max_steps: int = 20_000) -> dict:
    """Step until idle; return request_id -> final RequestOutput. Checks budgets on every step."""
    final = {} if final is None else final
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        step(engine, final)
    else:
        raise AssertionError("engine did not finish (livelock?)")
    assert engine.block_manager.num_used_blocks == 0
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0
    return final


def reference(prompt: list[int], max_tokens: int, block_size: int = 4, max_model_len: int = 8192) -> list[int]:
    """The request served alone: big pool, no prefix cache, one-step prefill."""
    eng = make_engine(block_size=block_size, prefix_caching=False, max_model_len=max_model_len)
    eng.add_request(prompt, greedy(max_tokens), request_id="solo")
    out = run(eng)["solo"]
    assert len(out.token_ids) == max_tokens or max_model_len < 8192
    return out.token_ids


def first_chunks(engine: LLMEngine) -> dict:
    """request_id -> its first scheduled chunk."""
    first = {}
    for step in engine.executor.steps:
        for c in step.chunks:
            first.setdefault(c.request_id, c)
    return first


def admission_order(engine: LLMEngine) -> list[str]:
    order = []
    for step in engine.executor.steps:
        for c in step.chunks:
            if c.request_id not in order:
                order.append(c.request_id)
    return order


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


# ---- correctness against the solo reference -----------------------------------------------------------
def test_fake_executor_detects_missing_kv():
    eng = make_engine()
    eng.add_request([1, 2, 3], greedy(2), request_id="a")
    eng.step()
    eng.executor._slots.clear()  # lose the KV: the next decode must notice
    with pytest.raises(AssertionError, match="missing or stale"):
        eng.step()


def test_outputs_are_context_dependent():
    # Guard for the reference tests below: different prompts give different continuations.
    assert reference([1, 2, 3, 4, 5], 8) != reference([1, 2, 3, 4, 6], 8)


def test_chunked_prefill_all_at_once_matches_reference():
    rng = random.Random(1)
    prompts = {f"r{i}": rand_prompt(rng, n) for i, n in enumerate([1, 5, 13, 29, 40, 7])}
    refs = {rid: reference(p, 6) for rid, p in prompts.items()}
    budget = 8
    eng = make_engine(max_num_batched_tokens=budget, prefix_caching=False)
    for rid, p in prompts.items():
        eng.add_request(p, greedy(6), request_id=rid)
    final = run(eng)
    assert {rid: o.token_ids for rid, o in final.items()} == refs
    assert all(o.finish_reason == "length" for o in final.values())
    chunks = [c for s in eng.executor.steps for c in s.chunks]
    assert any(0 < c.start_pos < len(prompts[c.request_id]) for c in chunks)  # a prompt continued mid-way
    # A 40-token prompt with an 8-token budget is split into several prefill chunks.
    prefill_40 = [c for c in chunks if c.request_id == "r4" and c.start_pos < 40]
    assert len(prefill_40) >= 5
    assert [c.start_pos for c in prefill_40] == sorted(c.start_pos for c in prefill_40)
    assert all(s.num_batched_tokens <= budget for s in eng.executor.steps)
    assert max(s.num_batched_tokens for s in eng.executor.steps) == budget  # the budget is used fully


def test_shared_prefixes_and_second_turn_hit_the_cache():
    rng = random.Random(2)
    system = rand_prompt(rng, 16)
    first = {f"u{i}": system + rand_prompt(rng, 3 + i) for i in range(3)}
    refs = {rid: reference(p, 5) for rid, p in first.items()}
    eng = make_engine(max_num_batched_tokens=12)
    for rid, p in first.items():
        eng.add_request(p, greedy(5), request_id=rid)
    final = run(eng)
    assert {rid: o.token_ids for rid, o in final.items()} == refs

    # Second turn: the previous prompt, its answer, and a new user message.
    turn2 = first["u1"] + final["u1"].token_ids + rand_prompt(rng, 6)
    hits_before = eng.scheduler.stats.num_prefix_hit_tokens
    n_steps = len(eng.executor.steps)
    eng.add_request(turn2, greedy(5), request_id="t2")
    out = run(eng)["t2"]
    assert out.token_ids == reference(turn2, 5)
    assert eng.scheduler.stats.num_prefix_hit_tokens > hits_before
    assert out.num_cached_tokens >= len(first["u1"]) // 4 * 4
    new_chunks = [c for s in eng.executor.steps[n_steps:] for c in s.chunks if c.request_id == "t2"]
    assert new_chunks[0].start_pos == out.num_cached_tokens > 0
    assert eng.scheduler.stats.num_prefix_hit_tokens > 0


def test_prefix_hit_on_blocks_of_a_running_request():
    rng = random.Random(3)
    shared = rand_prompt(rng, 20)
    a, b = shared + [1, 2], shared + [3]
    ref_a, ref_b = reference(a, 12), reference(b, 4)
    eng = make_engine()
    eng.add_request(a, greedy(12), request_id="a")
    eng.step()
    eng.step()  # "a" is decoding: its prompt blocks are cached and in use
    eng.add_request(b, greedy(4), request_id="b")
    final = run(eng)
    assert final["a"].token_ids == ref_a and final["b"].token_ids == ref_b
    assert final["b"].num_cached_tokens == 20
    assert first_chunks(eng)["b"].start_pos == 20


def test_small_pool_preempts_and_matches_reference():
    rng = random.Random(4)
    prompts = {f"r{i}": rand_prompt(rng, 6 + 2 * i) for i in range(6)}
    refs = {rid: reference(p, 20) for rid, p in prompts.items()}
    eng = make_engine(num_blocks=14, max_num_batched_tokens=16)
    for rid, p in prompts.items():
        eng.add_request(p, greedy(20), request_id=rid)
    final = run(eng)
    assert eng.scheduler.stats.num_preemptions > 0
    assert any(s.preempted_request_ids for s in eng.executor.steps)
    assert {rid: o.token_ids for rid, o in final.items()} == refs
    assert eng.block_manager.num_used_blocks == 0


def test_no_admission_in_a_step_that_preempted():
    # One-token blocks, a 6-token pool: "late" is admitted while "early" decodes, then gets preempted when
    # "early" grows; the freed blocks must not re-admit it in the same step.
    eng = make_engine(block_size=1, num_blocks=6, max_num_seqs=2, max_num_batched_tokens=2, prefix_caching=False)
    eng.add_request([0], greedy(5), request_id="early")
    final: dict = {}
    for _ in range(3):
        step(eng, final)
    eng.add_request([0, 0], greedy(1), request_id="late")
    run(eng, final)  # step() asserts that no preempting step schedules a request that was not running
    assert eng.scheduler.stats.num_preemptions > 0
    assert final["early"].token_ids == reference([0], 5, block_size=1)
    assert final["late"].token_ids == reference([0, 0], 1, block_size=1)


def test_small_pool_preemption_without_prefix_cache():
    rng = random.Random(5)
    prompts = {f"r{i}": rand_prompt(rng, 10) for i in range(5)}
    refs = {rid: reference(p, 15) for rid, p in prompts.items()}
    eng = make_engine(num_blocks=10, prefix_caching=False)
    for rid, p in prompts.items():
        eng.add_request(p, greedy(15), request_id=rid)
    final = run(eng)
    assert eng.scheduler.stats.num_preemptions > 0
    assert {rid: o.token_ids for rid, o in final.items()} == refs


@settings(deadline=None, max_examples=30, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4]), budget=st.integers(1, 24),
       max_num_seqs=st.integers(1, 4), prefix_caching=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]),
       slack=st.integers(0, 12))
def test_random_mixes_match_reference(data, block_size, budget, max_num_seqs, prefix_caching, policy, slack):
    bases = data.draw(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=12), min_size=1, max_size=3))
    reqs = data.draw(st.lists(st.tuples(st.integers(0, len(bases) - 1),
                                        st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=8),
                                        st.integers(1, 8), st.integers(0, 3), st.booleans()),
                              min_size=1, max_size=6))
    prompts, maxes, prios, late = {}, {}, {}, {}
    for i, (base, tail, max_tokens, prio, is_late) in enumerate(reqs):
        p = bases[base] + tail or [0]
        prompts[f"q{i}"], maxes[f"q{i}"], prios[f"q{i}"], late[f"q{i}"] = p, max_tokens, prio, is_late
    longest = max(len(p) + maxes[r] for r, p in prompts.items())
    num_blocks = -(-longest // block_size) + slack  # every request fits alone, maybe not together
    refs = {r: reference(p, maxes[r], block_size) for r, p in prompts.items()}
    eng = make_engine(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=budget, prefix_caching=prefix_caching, policy=policy)
    for r, p in prompts.items():
        if not late[r]:
            eng.add_request(p, greedy(maxes[r]), request_id=r, priority=prios[r])
    final: dict = {}
    for _ in range(3):  # let the first ones run a little, then add the rest mid-flight
        if eng.has_unfinished():
            step(eng, final)
    for r, p in prompts.items():
        if late[r]:
            eng.add_request(p, greedy(maxes[r]), request_id=r, priority=prios[r])
    run(eng, final)
    assert {r: o.token_ids for r, o in final.items()} == refs
    assert all(o.finish_reason == "length" for o in final.values())
    assert eng.block_manager.num_used_blocks == 0


def test_all_outputs_match_when_collected_from_every_step():
    """Streaming view: the token list grows by exactly one token per output and ends at the reference."""
    rng = random.Random(6)
    prompts = {f"s{i}": rand_prompt(rng, 3 + 4 * i) for i in range(4)}
    refs = {rid: reference(p, 7) for rid, p in prompts.items()}
    eng = make_engine(num_blocks=12, max_num_batched_tokens=5, max_num_seqs=3)
    for rid, p in prompts.items():
        eng.add_request(p, greedy(7), request_id=rid)
    streams: dict[str, list[list[int]]] = {rid: [] for rid in prompts}
    while eng.has_unfinished():
        for o in eng.step():
            streams[o.request_id].append(list(o.token_ids))
        check_step(eng, eng.executor.steps[-1])
    for rid, seq in streams.items():
        assert [len(t) for t in seq] == list(range(1, 8))
        assert seq[-1] == refs[rid]
        assert all(seq[i] == seq[-1][:i + 1] for i in range(len(seq)))


# ---- batch shape and ordering ---------------------------------------------------------------------------
def test_max_num_seqs_respected_every_step():
    eng = make_engine(max_num_seqs=2)
    for i in range(5):
        eng.add_request([i + 1] * 3, greedy(4), request_id=f"r{i}")
    run(eng)
    assert max(len(s.chunks) for s in eng.executor.steps) == 2
    assert all(len(s.chunks) <= 2 for s in eng.executor.steps)


def test_fcfs_admission_order():
    eng = make_engine(max_num_seqs=1)
    ids = ["c", "a", "e", "b", "d"]
    for i, rid in enumerate(ids):
        eng.add_request([i + 1, 7, 7], greedy(2), request_id=rid)
    run(eng)
    assert admission_order(eng) == ids
    # With room for all, they are admitted in one step in the same order.
    eng = make_engine(max_num_seqs=8)
    for i, rid in enumerate(ids):
        eng.add_request([i + 1, 7, 7], greedy(2), request_id=rid)
    eng.step()
    assert [c.request_id for c in eng.executor.steps[0].chunks] == ids


def test_waiting_head_is_not_overtaken_when_blocks_are_short():
    eng = make_engine(num_blocks=6, block_size=4)
    eng.add_request([1] * 12, greedy(8), request_id="a")  # 3 blocks, grows to 5
    eng.add_request([2] * 16, greedy(2), request_id="big")  # needs 5 blocks: cannot fit next to "a"
    eng.add_request([3], greedy(2), request_id="small")  # would fit, but must not overtake "big"
    run(eng)
    order = admission_order(eng)
    assert order.index("big") < order.index("small")


def test_priority_policy_orders_admission_and_preemption():
    eng = make_engine(max_num_seqs=1, policy="priority")
    eng.add_request([1, 2], greedy(2), request_id="low", priority=5)
    eng.add_request([3, 4], greedy(2), request_id="high", priority=0)
    eng.add_request([5, 6], greedy(2), request_id="mid", priority=2)
    eng.add_request([7, 8], greedy(2), request_id="high2", priority=0)
    run(eng)
    assert admission_order(eng) == ["high", "high2", "mid", "low"]

    # Preemption takes the lowest-priority running request, whatever the arrival order.
    eng = make_engine(num_blocks=8, block_size=4, policy="priority", max_num_batched_tokens=64)
    eng.add_request([1] * 7, greedy(14), request_id="bg", priority=9)  # arrives first, least important
    eng.add_request([2] * 7, greedy(14), request_id="fg", priority=1)
    final = run(eng)
    preempted = [rid for s in eng.executor.steps for rid in s.preempted_request_ids]
    assert preempted and set(preempted) == {"bg"}
    assert final["fg"].token_ids == reference([2] * 7, 14)
    assert final["bg"].token_ids == reference([1] * 7, 14)


def test_a_running_prefill_yields_its_chunk_to_a_higher_ranked_arrival_and_resumes():
    eng = make_engine(max_num_batched_tokens=16, policy="priority")
    long_prompt = [(7 * k) % VOCAB for k in range(200)]
    eng.add_request(long_prompt, greedy(4), request_id="low", priority=5)
    final: dict = {}
    for _ in range(3):
        step(eng, final)  # "low" is mid-prefill, 16 tokens a step
    eng.add_request([3] * 40, greedy(4), request_id="high", priority=0)
    step(eng, final)
    chunks = {c.request_id: c.num_tokens for c in eng.executor.steps[-1].chunks}
    assert chunks == {"high": 16}  # paused at the chunk boundary, not preempted: it keeps its blocks
    assert eng.block_manager.block_ids("low") and eng.scheduler.stats.num_preemptions == 0
    step(eng, final)
    step(eng, final)
    chunks = {c.request_id: c.num_tokens for c in eng.executor.steps[-1].chunks}
    assert chunks == {"high": 8, "low": 8}  # what the arrival leaves goes to the paused prefill
    assert eng.scheduler.stats.prefill_yields_by_tier == {"default": 1}  # then "high" runs first in order
    run(eng, final)
    assert final["low"].token_ids == reference(long_prompt, 4)
    assert final["high"].token_ids == reference([3] * 40, 4)

    # Under FCFS nothing that arrives later outranks a running prefill: it waits for the budget.
    eng = make_engine(max_num_batched_tokens=16)
    eng.add_request(long_prompt, greedy(4), request_id="first")
    step(eng, {})
    eng.add_request([3] * 40, greedy(4), request_id="second")
    step(eng, {})
    assert {c.request_id for c in eng.executor.steps[-1].chunks} == {"first"}


def test_fcfs_preempts_the_latest_arrival():
    eng = make_engine(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    eng.add_request([1] * 7, greedy(14), request_id="first")
    eng.add_request([2] * 7, greedy(14), request_id="second")
    run(eng)
    preempted = [rid for s in eng.executor.steps for rid in s.preempted_request_ids]
    assert preempted and set(preempted) == {"second"}


def test_unknown_queue_policy():
    with pytest.raises(ValueError):
        make_engine(policy="lifo")


# ---- aborts -------------------------------------------------------------------------------------------
def test_abort_waiting_request():
    eng = make_engine(max_num_seqs=1)
    eng.add_request([1, 2, 3], greedy(5), request_id="run")
    eng.add_request([4, 5, 6], greedy(5), request_id="wait")
    eng.step()
    assert eng.scheduler.num_running == 1 and eng.scheduler.num_waiting == 1
    eng.abort(["wait"])
    assert eng.scheduler.num_waiting == 0
    assert "wait" not in eng.scheduler.requests
    final = run(eng)
    assert "wait" not in {c.request_id for s in eng.executor.steps for c in s.chunks}
    assert any("wait" in s.finished_request_ids for s in eng.executor.steps)
    assert final["run"].token_ids == reference([1, 2, 3], 5)
    eng.abort(["wait", "nope"])  # unknown / already finished ids are ignored


def test_abort_running_request_frees_blocks():
    eng = make_engine(num_blocks=16, block_size=4)
    eng.add_request(list(range(1, 11)), greedy(50), request_id="a")
    eng.add_request(list(range(11, 21)), greedy(6), request_id="b")
    for _ in range(3):
        eng.step()
    used = eng.block_manager.num_used_blocks
    held_a = len(eng.block_manager.block_ids("a"))
    assert held_a >= 3
    eng.abort(["a"])
    assert eng.block_manager.block_ids("a") == ()
    assert eng.block_manager.num_used_blocks == used - held_a
    assert "a" not in eng.scheduler.requests and eng.scheduler.num_running <= 1
    final = run(eng)
    assert "a" not in final
    assert "a" not in {c.request_id for s in eng.executor.steps[3:] for c in s.chunks}
    assert final["b"].token_ids == reference(list(range(11, 21)), 6)
    # The id can be reused after the request ended.
    eng.add_request([1, 2], greedy(1), request_id="a")
    assert run(eng)["a"].finish_reason == "length"


def test_abort_preempted_request():
    eng = make_engine(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    eng.add_request([1] * 7, greedy(14), request_id="first")
    eng.add_request([2] * 7, greedy(14), request_id="second")
    for _ in range(40):
        eng.step()
        if eng.executor.steps[-1].preempted_request_ids:
            break
    else:
        pytest.fail("no preemption")
    eng.abort(["second"])
    assert eng.scheduler.num_waiting == 0
    final = run(eng)
    assert set(final) == {"first"}


# ---- stopping -------------------------------------------------------------------------------------------
def test_max_tokens_finish_reason_length():
    eng = make_engine()
    eng.add_request([1, 2, 3], greedy(4), request_id="a")
    out = run(eng)["a"]
    assert len(out.token_ids) == 4 and out.finish_reason == "length" and out.finished


def test_stop_token_ids():
    prompt = [3, 1, 4, 1, 5]
    ref = reference(prompt, 12)
    k = 5
    stop_tok = ref[k]
    cut = ref.index(stop_tok)  # first occurrence
    eng = make_engine()
    eng.add_request(prompt, greedy(12, stop_token_ids=(stop_tok,)), request_id="a")
    out = run(eng)["a"]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[:cut + 1]  # the stop token is the last output token


def test_eos_stops_unless_ignored():
    prompt = [2, 7, 1, 8, 2, 8]
    ref = reference(prompt, 12)
    eos = ref[4]
    cut = ref.index(eos)
    eng = make_engine(eos=(eos,))
    eng.add_request(prompt, greedy(12, ignore_eos=False), request_id="stop")
    eng.add_request(prompt, greedy(12, ignore_eos=True), request_id="ignore")
    final = run(eng)
    assert final["stop"].finish_reason == "stop"
    assert final["stop"].token_ids == ref[:cut + 1]
    assert final["ignore"].finish_reason == "length"
    assert final["ignore"].token_ids == ref
    # stop_token_ids apply even with ignore_eos
    eng = make_engine(eos=(eos,))
    eng.add_request(prompt, greedy(12, ignore_eos=True, stop_token_ids=(eos,)), request_id="s")
    assert run(eng)["s"].token_ids == ref[:cut + 1]


def test_output_stops_at_max_model_len():
    eng = make_engine(max_model_len=16)
    eng.add_request(list(range(1, 11)), greedy(100), request_id="a")
    out = run(eng)["a"]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 6  # prompt 10 + 6 = max_model_len
    assert out.token_ids == reference(list(range(1, 11)), 6)


# ---- rejection ------------------------------------------------------------------------------------------
def test_prompt_too_long():
    eng = make_engine(max_model_len=16)
    with pytest.raises(ContextLengthExceededError) as e:
        eng.add_request([1] * 16, greedy(1), request_id="a")
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    assert not eng.has_unfinished()
    eng.add_request([1] * 15, greedy(5), request_id="b")
    out = run(eng)["b"]
    assert out.token_ids == reference([1] * 15, 1) and out.finish_reason == "length"


def test_duplicate_request_id():
    eng = make_engine()
    eng.add_request([1, 2], greedy(3), request_id="x")
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request([3, 4], greedy(3), request_id="x")
    assert not isinstance(e.value, ContextLengthExceededError)
    final = run(eng)
    assert final["x"].prompt_token_ids == [1, 2]


def test_prompt_larger_than_pool_is_rejected():
    eng = make_engine(num_blocks=4, block_size=4)  # 16 tokens of KV, model limit 8192
    assert eng.scheduler.max_model_len == 16
    with pytest.raises(ContextLengthExceededError):
        eng.add_request([1] * 16, greedy(1))
    with pytest.raises(ContextLengthExceededError):
        eng.add_request([1] * 40, greedy(1))
    eng.add_request([1] * 15, greedy(4), request_id="fits")
    out = run(eng)["fits"]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_bad_prompts_rejected():
    eng = make_engine()
    with pytest.raises(InvalidRequestError):
        eng.add_request([], greedy(1))
    with pytest.raises(InvalidRequestError):
        eng.add_request([VOCAB], greedy(1))
    with pytest.raises(InvalidRequestError):
        eng.add_request([-1], greedy(1))
    with pytest.raises(InvalidRequestError):
        eng.add_request("text needs a tokenizer", greedy(1))
    assert not eng.has_unfinished()


@pytest.mark.parametrize("kw", [dict(max_num_batched_tokens=0), dict(max_num_seqs=0)])
def test_config_that_can_never_schedule_is_rejected(kw):
    try:
        eng = make_engine(**kw)
    except (ValueError, InvalidRequestError):
        return
    eng.add_request([1, 2], greedy(1))
    for _ in range(50):
        eng.step()
    assert not eng.has_unfinished(), "accepted a config under which no request can ever run"


def test_a_stage_pass_not_started_gives_way_and_one_under_way_is_promoted():
    eng = make_engine(max_num_batched_tokens=8, policy="priority")
    prompt = [(3 * k) % VOCAB for k in range(40)]
    stage = eng.make_request("s@stage", prompt, greedy(1), prefill_only=True)
    stage.arrival_s = float("inf")
    eng.scheduler.add_request(eng.make_request("busy", [1] * 30, greedy(1)))
    eng.scheduler.add_request(stage)
    assert eng.scheduler.claim_stage("s@stage", 1.0)  # still waiting: dropped, the real prefill goes now
    assert "s@stage" not in eng.scheduler.requests
    assert eng.scheduler.claim_stage("none@stage", 1.0)  # no stage pass at all
    stage = eng.make_request("t@stage", prompt, greedy(1), prefill_only=True)
    stage.arrival_s = float("inf")
    eng.scheduler.add_request(stage)
    for _ in range(6):  # "busy" prefills first, then the stage pass starts
        eng.step()
    assert eng.scheduler.requests["t@stage"].num_computed_tokens > 0
    eng.add_request([2] * 30, greedy(1), request_id="later")
    assert not eng.scheduler.claim_stage("t@stage", 0.0)  # under way: ranks as arrived at 0 now
    eng.step()
    assert {c.request_id for c in eng.executor.steps[-1].chunks} == {"t@stage"}  # ahead of "later"
