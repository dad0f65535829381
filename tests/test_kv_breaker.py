"""The KV path breaker (`pdserve.core.pd.breaker`): its states and counted transitions, and a one-path sender
that refuses a send at once while its peer's breaker is open (`pdserve.transfer.paths.OnePath`)."""

from __future__ import annotations

import socket
import time

import pytest

from pdserve.core.pd.breaker import CLOSED, HALF_OPEN, OPEN, Breaker, BreakerPolicy, Breakers
from pdserve.transfer import make_sender
from pdserve.transfer.base import TransferError
from pdserve.transfer.paths import PathOpen
from serve_util import wait_for

POLICY = BreakerPolicy(failures_to_open=3, slow_s=1.0, cool_s=2.0, max_cool_s=5.0)


def test_quick_failures_open_after_a_run_and_a_success_resets_the_run():
    b = Breaker(POLICY)
    b.failed(0.0), b.failed(0.0)
    assert b.state == CLOSED and b.allow(0.0)
    b.succeeded()
    b.failed(0.0), b.failed(0.0)
    assert b.state == CLOSED  # the success broke the run
    b.failed(0.0)
    assert b.state == OPEN and not b.allow(1.9)
    assert b.transitions == {OPEN: 1}


def test_a_slow_failure_opens_at_once():
    b = Breaker(POLICY)
    b.failed(10.0, seconds=1.0)
    assert b.state == OPEN and not b.allow(11.9)


def test_half_open_lets_one_probe_and_its_success_closes():
    b = Breaker(POLICY)
    b.failed(0.0, seconds=5.0)
    assert b.allow(2.0) and b.state == HALF_OPEN  # the probe
    assert not b.allow(2.1)  # one probe at a time
    b.succeeded()
    assert b.state == CLOSED and b.allow(2.2) and b.allow(2.3)
    assert b.transitions == {OPEN: 1, HALF_OPEN: 1, CLOSED: 1}


def test_a_failed_probe_reopens_with_a_doubled_cool_down_up_to_the_cap():
    b = Breaker(POLICY)
    b.failed(0.0, seconds=5.0)
    assert b.allow(2.0)
    b.failed(2.0)  # the probe failed: open again, 4 s this time
    assert b.state == OPEN and not b.allow(5.9) and b.allow(6.0)
    b.failed(6.0)  # 8 s capped at 5
    assert not b.allow(10.9) and b.allow(11.0)
    b.succeeded()
    b.failed(20.0, seconds=5.0)  # a fresh spell starts from cool_s again
    assert not b.allow(21.9) and b.allow(22.0)
    assert b.transitions[OPEN] == 4 and b.transitions[HALF_OPEN] == 4 and b.transitions[CLOSED] == 1


def test_breakers_by_peer_and_path_and_open_receivers():
    bs = Breakers(POLICY)
    bs.of("d1", "tcp").failed(0.0, seconds=5.0)
    assert not bs.allow("d1", "tcp", 1.0) and bs.allow("d2", "tcp", 1.0) and bs.allow("d1", "shm", 1.0)
    assert bs.refused == {"tcp": 1}
    assert bs.open_dests(1.0) == set()  # d1's shm path still takes transfers
    bs.of("d1", "shm").failed(0.0, seconds=5.0)
    assert bs.open_dests(1.0) == {"d1"} and bs.open_dests(2.0) == set()  # due for its probe: routable again
    assert bs.report()["d1|tcp"] == {"state": OPEN, "transitions": {OPEN: 1}}


def test_policy_bounds_each_send_below_the_lease():
    assert BreakerPolicy(send_bound_s=10.0).bound(30.0) == 10.0
    assert BreakerPolicy(send_bound_s=10.0).bound(6.0) == 2.0


def test_a_peer_that_refuses_opens_its_breaker_and_later_sends_fail_at_once():
    """A real tcp sender to a port nobody listens on: connects refused, then refused without trying."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dest = f"tcp://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: connects are refused
        sender = make_sender("tcp", timeout_s=3.0)
        for _ in range(sender.breakers.policy.failures_to_open):
            with pytest.raises(TransferError) as e:
                sender.send_control(dest, {"kind": "alive", "xfer": "x"})
            assert not isinstance(e.value, PathOpen)
        start = time.monotonic()
        with pytest.raises(PathOpen):
            sender.send_control(dest, {"kind": "alive", "xfer": "x"})
        assert time.monotonic() - start < 0.1
        assert sender.breakers.report()[f"{dest}|tcp"]["state"] == OPEN
        sender.close()


def _books(policy=None):
    from pdserve.conductor.books import Books
    from pdserve.conductor.routing import PrefixAffinity
    from pdserve.core.service_tiers import ServiceTiers
    books = Books("pd", policy or PrefixAffinity(), ServiceTiers(), 4, lambda prefill, rid: None)
    for name, role in (("d1", "decode"), ("d2", "decode"), ("p1", "prefill"), ("p2", "prefill")):
        books.add_worker(name, role)
    return books


def test_routing_avoids_a_pair_whose_path_is_open_keeping_the_prefill_worker():
    books = _books()
    books.workers["d2"].outstanding = 5  # d1 is preferred by load
    books.workers["p2"].outstanding = 5  # p1 too
    assert [w.name for w in books.route(())] == ["d1", "p1"] and books.notes == []
    books.open_paths["p1"] = {"d1"}
    assert [w.name for w in books.route(())] == ["d2", "p1"]  # p1 kept: its cache may hold the prompt
    assert books.notes == ["kv_path_open_rerouted"]
    books.notes.clear()
    books.open_paths["p1"] = {"d1", "d2"}
    assert [w.name for w in books.route(())] == ["d1", "p2"]  # no decode worker p1 reaches: another prefill
    books.notes.clear()
    books.open_paths["p2"] = {"d1"}
    assert [w.name for w in books.route(())] == ["d1", "p1"]  # no pair at all: as chosen, counted
    assert books.notes == ["kv_path_open_no_pair"]


def test_the_ttft_pair_policy_is_routed_around_open_paths_too():
    from pdserve.conductor.ttft_routing import PredictedTtft
    books = _books(PredictedTtft())
    books.workers["d2"].outstanding = books.workers["p2"].outstanding = 5
    books.open_paths["p1"] = {"d1"}
    assert [w.name for w in books.route((), tokens=8)] == ["d2", "p1"]


def _run(engine, prompt, rid):
    from pdserve.core.sampling_params import SamplingParams
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), request_id=rid)
    while engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("keep", [True, False])
def test_a_failed_delivery_keeps_its_computed_kv_pinned_for_a_reroute(tiny_llama_dir, tmp_path, keep):
    """Real engines, a real tcp sender whose path to the decode worker is open: the prompt's first chunk is
    refused at once (`path_open`), the worker aborts it; what it computed stays pinned (`PrefillSide.keep`)
    through other prompts that need the pool, and the same prompt sent again through this worker hits it.
    (`keep=False`: as without the pin: the other prompts evict it, no hit.)"""
    from test_pd_engine import GREEDY, Pair
    pair = Pair(tiny_llama_dir, "tcp", tmp_path, prefill_kw=dict(max_num_batched_tokens=32, num_kv_blocks=24))
    try:
        engine, side = pair.p_engine, pair.prefill
        dest = pair.decode.receiver.address
        side.sender.breakers.of(dest, "tcp").failed(time.monotonic(), seconds=60.0)  # open
        prompt = [(31 * j) % 4000 + 10 for j in range(64)]
        side.add("r0", prompt, GREEDY, dest, "r0#0", 0)
        deadline, steps = time.monotonic() + 30, 0
        # (the link's thread may refuse the chunk before the first step: step at least once, so a chunk of
        # 32 tokens = 8 blocks is computed whichever thread is first, as a worker's step would be)
        while (not side.failed_requests() or steps == 0) and time.monotonic() < deadline:
            if engine.has_unfinished():
                engine.step()
                steps += 1
            side.pump()
        assert side.failed_requests() == ["r0"]
        pinned = side.keep("r0") if keep else 0  # as `WorkerReports.cancel_failed_deliveries` does
        engine.abort(["r0"])
        side.finish("r0", prefilled=False)
        # its closing record went (refused) and what it lent is back: only a pin holds its blocks now
        assert wait_for(lambda: (side.pump(), side.release_lent(), side.outbox.idle() and not side.lent)[2],
                        timeout_s=10)
        assert side.failures["path_open"] >= 1
        assert (pinned >= 8 and side.grace_pins == 1) if keep else side.grace_pins == 0
        assert engine.block_manager.num_pinned_blocks == pinned
        for i in range(4):  # other prompts that need the pool's free blocks
            _run(engine, [(17 * j + 101 * i) % 3000 + 1000 for j in range(60)], f"other{i}")
        before = engine.scheduler.stats.num_prefix_hit_tokens
        _run(engine, prompt, "again")
        hits = engine.scheduler.stats.num_prefix_hit_tokens - before
        assert hits >= pinned * 4 if keep else hits == 0, (hits, pinned)
    finally:
        pair.close()


def test_the_breaker_flags_reach_a_started_and_a_joined_prefill_workers_sender(monkeypatch):
    """`--kv-send-timeout-s`, `--kv-breaker-failures`, `--kv-breaker-cool-s`, `--kv-stage-grace-s` on `pdserve serve`
    and `pdserve worker`: each worker spec carries them and the worker's sender is built with that policy, its
    transports' deadline the policy's bound."""
    from pdserve.cli import build_parser
    from pdserve.server.launch import ServeConfig, worker_specs
    from pdserve.transfer import peer_auth
    from pdserve.worker.joined import worker_spec
    from pdserve.core.settings import SupervisionSettings, pick
    flags = ["--kv-send-timeout-s", "2.5", "--kv-breaker-failures", "5", "--kv-breaker-cool-s", "7",
             "--kv-stage-grace-s", "11"]
    want = BreakerPolicy(failures_to_open=5, cool_s=7.0, send_bound_s=2.5, grace_s=11.0)
    args = build_parser().parse_args(["serve", "--transport", "tcp", *flags])
    cfg = ServeConfig(transport="tcp", **{n: getattr(args, n) for n in BreakerPolicy.SETTINGS})
    specs = worker_specs(cfg, "/nowhere", {}, "/tmp")
    assert {BreakerPolicy.of(s) for s in specs} == {want}
    monkeypatch.setenv(peer_auth.ENV, peer_auth.new_secret())
    args = build_parser().parse_args(["worker", "--role", "prefill", "--join", "tcp://127.0.0.1:9", *flags])
    joined = worker_spec("prefill", args.join, {}, data_host="127.0.0.1", supervision=pick(SupervisionSettings, args))
    assert BreakerPolicy.of(joined) == want
    sender = make_sender("tcp", timeout_s=joined.kv_timeout_s, policy=BreakerPolicy.of(joined))
    assert sender.breakers.policy == want and sender.sender._timeout_s == 2.5
    sender.close()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-breaker-failures", "x"])
    with pytest.raises(Exception, match="--kv-breaker-failures must be an integer >= 1"):
        SupervisionSettings(kv_breaker_failures=0)
