"""Routing by predicted TTFT, the KV transfer included (`pdserve.conductor.ttft_routing`), through the real
conductor core: hand-computed predictions, the pair it picks, and the workers' own cache reports.

Every worker's time model is fitted to exact step times: a step costs 10 ms + 0.1 ms per prompt token + 1 ms
per decoding sequence, so a 1,024-token prefill is 112.4 ms and a first decode step with b others decoding
is 11 + b ms. A KV block (16 tokens) is 64 KiB: a 1,024-token prompt's 64 blocks are 4,194,304 bytes.
"""

from __future__ import annotations

import pytest

from pdserve.conductor.admission import Admission
from pdserve.conductor.conductor_core import ConductorCore, Count, Send
from pdserve.conductor.routing import WorkerLoad
from pdserve.conductor.routing_policies import make_routing_policy
from pdserve.conductor.ttft_routing import PairRequest, PredictedTtft
from pdserve.conductor.wire import Ready, Reserve

BLOCK_BYTES = 65536
PROMPT = list(range(1000, 2024))  # 1,024 tokens, 64 blocks
PREFILL_S = 0.01 + 1e-4 * len(PROMPT)  # 0.1124


def step_s(tokens: int = 0, seqs: int = 0) -> float:
    return 0.01 + 1e-4 * tokens + 1e-3 * seqs


STEPS = [(t, t * t, 0, 0, step_s(t)) for t in (100, 300, 700, 1500)] + [
    (0, 0, s, s * ctx, step_s(seqs=s)) for s, ctx in ((1, 50), (2, 400), (4, 90), (8, 300))]


def core(prefills: list[str], decodes: list[str], policy=None) -> ConductorCore:
    c = ConductorCore("pd", policy or PredictedTtft(), admission=Admission(), idle_prewarm=False)
    for name, role in [(p, "prefill") for p in prefills] + [(d, "decode") for d in decodes]:
        c.add_worker(name, role)
        c.worker_ready(name, Ready(name, role, block_size=16, max_num_batched_tokens=2048,
                                   kv_block_bytes=BLOCK_BYTES if role == "prefill" else 0))
        c.worker_steps(name, STEPS)
    return c


def links(c: ConductorCore, rates: dict) -> None:
    """`rates`: (prefill, decode) -> bytes/s, as the prefill workers' stats report them (`kv_links`)."""
    for p in {p for p, _ in rates}:
        c.worker_links(p, {d: {"capacity": r, "bytes": 0, "busy_s": 0.0} for (q, d), r in rates.items() if q == p})


def routed(actions: list) -> str:
    return next(a.worker for a in actions if isinstance(a, Send) and isinstance(a.cmd, Reserve))


def estimates(c: ConductorCore, prompt=PROMPT) -> dict:
    books = c.books
    req = PairRequest(books.affinity(prompt), len(prompt))
    live = lambda role: [w for w in books.role(role) if w.usable]  # noqa: E731
    return {(e.prefill, e.decode): e for e in c.books.policy.estimates(books, req, live("decode"), live("prefill"))}


def test_a_pair_with_a_slow_link_loses_to_one_with_a_fast_link_at_equal_load():
    c = core(["p_slow", "p_fast"], ["d"])
    links(c, {("p_slow", "d"): 1e7, ("p_fast", "d"): 1e9})
    est = estimates(c)
    nbytes = 64 * BLOCK_BYTES
    # the KV streams while the prompt is computed: the longer of the two counts
    assert est["p_fast", "d"].ttft_s == pytest.approx(max(PREFILL_S, nbytes / 1e9) + step_s(seqs=1), rel=1e-6)
    assert est["p_fast", "d"].ttft_s == pytest.approx(0.1124 + 0.011, rel=1e-6)
    assert est["p_slow", "d"].ttft_s == pytest.approx(max(PREFILL_S, nbytes / 1e7) + step_s(seqs=1), rel=1e-6)
    assert est["p_slow", "d"].ttft_s == pytest.approx(0.4194304 + 0.011, rel=1e-6)
    c.arrive("r1", PROMPT, {"max_tokens": 4}, 0.0)
    assert c.flights["r1"].prefill == "p_fast"


def test_a_decode_worker_holding_the_prefix_wins_when_the_transfer_would_dominate():
    c = core(["p"], ["d_holds", "d_idle"])
    links(c, {("p", "d_holds"): 1e7, ("p", "d_idle"): 1e7})
    hashes = c.books.affinity(PROMPT)
    c.worker_cache("d_holds", {"device": hashes[:48]}, {})  # its own report: the first 768 tokens
    c.workers["d_holds"].outstanding = 3  # and busier: 3 decoding, 3 outstanding
    c.backlog["d_holds"].decoding = 3
    est = estimates(c)
    # 16 blocks to send (0.105 s) hide behind the 0.112 s prefill; 64 blocks (0.419 s) do not
    assert est["p", "d_holds"].ttft_s == pytest.approx(PREFILL_S + step_s(seqs=4), rel=1e-6)
    assert est["p", "d_idle"].ttft_s == pytest.approx(64 * BLOCK_BYTES / 1e7 + step_s(seqs=1), rel=1e-6)
    assert routed(c.arrive("r1", PROMPT, {"max_tokens": 4}, 0.0)) == "d_holds"
    # prefix affinity, blind to the transfer, sends it to the idle one
    old = core(["p"], ["d_holds", "d_idle"], make_routing_policy("prefix-affinity"))
    old.worker_cache("d_holds", {"device": hashes[:48]}, {})
    old.workers["d_holds"].outstanding = 3
    assert routed(old.arrive("r1", PROMPT, {"max_tokens": 4}, 0.0)) == "d_idle"


def test_a_decode_worker_holding_the_whole_prompt_needs_no_prefill_and_no_transfer():
    c = core(["p"], ["d_holds", "d_idle"])
    links(c, {("p", "d_holds"): 1e9, ("p", "d_idle"): 1e9})
    c.worker_cache("d_holds", {"device": c.books.affinity(PROMPT)}, {})
    assert estimates(c)["p", "d_holds"].ttft_s == pytest.approx(step_s(seqs=1), rel=1e-6)


def test_reports_not_what_was_sent_decide_and_disagreements_are_counted():
    load = WorkerLoad("d", "decode")
    load.remember([1, 2, 3, 4])
    assert load.prefix_blocks([1, 2, 3, 4]) == 4  # no report yet: the gateway's guess
    load.reported.apply({"device": [1, 2]}, {})
    assert load.prefix_blocks([1, 2, 3, 4]) == 4  # sent since its report before last: maybe not computed yet
    load.reported.apply({}, {"device": [2]})
    assert load.prefix_blocks([1, 2, 3, 4]) == 1  # two reports later: what it says it holds
    assert load.guessed_blocks([1, 2, 3, 4]) == 4

    c = core(["p"], ["d"])
    links(c, {("p", "d"): 1e9})
    hashes = c.books.affinity(PROMPT)
    c.workers["d"].remember(hashes)  # the gateway sent it there...
    for _ in range(2):
        c.worker_cache("d", {}, {})  # ...but it never reported holding it
    actions = c.arrive("r1", PROMPT, {"max_tokens": 4}, 0.0)
    assert Count("routing_prefix_disagreements", (("role", "decode"),)) in actions


def test_queueing_counts_before_the_prompt_and_the_transfer_overlaps_only_its_prefill():
    c = core(["p_busy", "p_idle"], ["d"])
    links(c, {("p_busy", "d"): 1e7, ("p_idle", "d"): 1e7})
    c.backlog["p_busy"].tokens[c.tiers["default"].rank] += 3000  # 3,000 prompt tokens queued there
    est = estimates(c)
    # admission's model: the step under way holds 2,048 of them, half done; the other 952 go before the prompt,
    # topped up with it in one 1,976-token chunk: 0.5 x 0.2148 + 0.2076 = 0.3150 s in all, 0.2026 s of it queueing
    assert est["p_busy", "d"].queue_s == pytest.approx(0.5 * step_s(2048) + step_s(952 + 1024) - PREFILL_S, rel=1e-6)
    assert est["p_busy", "d"].ttft_s == pytest.approx(0.2026 + 0.4194304 + 0.011, rel=1e-6)
    assert est["p_idle", "d"].ttft_s == pytest.approx(0.4194304 + 0.011, rel=1e-6)
    c.arrive("r1", PROMPT, {"max_tokens": 4}, 0.0)
    assert c.flights["r1"].prefill == "p_idle"


def test_ports_still_carrying_routed_kv_lose_to_free_ones():
    c = core(["p_a", "p_b"], ["d_a", "d_b"])
    links(c, {(p, d): 1e7 for p in ("p_a", "p_b") for d in ("d_a", "d_b")})  # slow: the ports' waits dominate
    c.arrive("r0", PROMPT, {"max_tokens": 4}, 0.0)  # all equal: the first listed pair
    assert (c.flights["r0"].prefill, c.flights["r0"].decode) == ("p_a", "d_a")
    assert c.books.port_bytes == {"p_a": 64 * BLOCK_BYTES, "d_a": 64 * BLOCK_BYTES}
    for w in c.workers.values():  # equal loads: only the ports (and r0's prompt queued at p_a) differ
        w.outstanding = 0
    prompt = list(range(5000, 6024))
    est = estimates(c, prompt)
    s = 64 * BLOCK_BYTES / 1e7  # one prompt's KV over the link: 0.419 s
    assert est["p_a", "d_b"].link_wait_s == pytest.approx(2 * s, rel=1e-6)  # behind r0's at p_a's port
    assert est["p_b", "d_a"].link_wait_s == pytest.approx(2 * s, rel=1e-6)  # behind r0's at d_a's port
    assert est["p_b", "d_b"].ttft_s == pytest.approx(s + step_s(seqs=1), rel=1e-6)
    assert est["p_b", "d_a"].ttft_s == pytest.approx(2 * s + step_s(seqs=1), rel=1e-6)
    c.arrive("r1", prompt, {"max_tokens": 4}, 0.0)
    assert (c.flights["r1"].prefill, c.flights["r1"].decode) == ("p_b", "d_b")
    c.token("r0", 0, False, 0.5, 7)  # r0's KV is delivered: its bytes leave the ports
    assert c.books.port_bytes["p_a"] == c.books.port_bytes["d_a"] == 0


def test_unmeasured_links_and_unfitted_workers_are_counted_fallbacks():
    c = core(["p"], ["d"])
    actions = c.arrive("r1", PROMPT, {"max_tokens": 4}, 0.0)
    assert Count("fallbacks", (("kind", "routing_link_unmeasured"),)) in actions
    fresh = ConductorCore("pd", PredictedTtft(), admission=Admission(), idle_prewarm=False)
    for name, role in (("p", "prefill"), ("d", "decode")):
        fresh.add_worker(name, role)
    actions = fresh.arrive("r1", PROMPT, {"max_tokens": 4}, 0.0)
    assert Count("fallbacks", (("kind", "routing_unpredicted"),)) in actions
    assert routed(actions) == "d"


def test_cache_events_report_what_came_and_left_each_slot_and_replay_to_the_same_contents():
    import numpy as np

    from pdserve.core.kvstore.cache_events import CacheEvents
    events, seen = CacheEvents(), WorkerLoad("w", "decode")
    for slots in ([0, 5, 6, 0], [7, 5, 0, 8], [7, 6, 0, 5]):  # 6 evicted, then stored again elsewhere; 5 moves
        stored, evicted = events.take({"device": np.array(slots, np.uint64)})
        seen.reported.apply(stored, evicted)
        held = {h for h in slots if h}
        assert {h for h in range(10) if seen.reported.held["device"].prefix_len(np.array([h], np.uint64))} == held
    assert events.take({"device": np.array([7, 6, 0, 5], np.uint64)}) == ({}, {})  # nothing changed


def test_a_reported_prefix_runs_on_across_tiers():
    load = WorkerLoad("w", "decode")
    load.reported.apply({"device": [1, 2], "host": [3], "disk": [5]}, {})
    load.reported.apply({}, {})
    load.reported.apply({}, {})
    assert load.prefix_blocks([1, 2, 3, 4, 5]) == 3  # device then host; 4 is nowhere
    load.reported.apply({}, {"host": [3]})
    assert load.prefix_blocks([1, 2, 3, 4, 5]) == 2
