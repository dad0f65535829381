"""The conductor core's part of workers joining and leaving (`pdserve.conductor.membership`), sans I/O: a worker
that joins is routed to; one that is leaving is passed by, released only once nothing routed there is left;
one that leaves early hands what it had to the others."""

from __future__ import annotations

from pdserve.conductor.conductor_core import ConductorCore, Count, Send
from pdserve.conductor.routing_policies import make_routing_policy
from pdserve.conductor.wire import Ready

PARAMS = {"max_tokens": 8}


def _core() -> ConductorCore:
    core = ConductorCore("pd", make_routing_policy("least-loaded"), idle_prewarm=False)
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        core.add_worker(name, role)
        core.worker_ready(name, Ready(name, role, block_size=16))
    return core


def _decode_of(actions: list) -> str:
    return next(a.worker for a in actions if isinstance(a, Send) and a.cmd.kind == "reserve")


def test_a_joined_worker_is_routed_to_and_a_leaving_one_is_passed_by_until_released():
    core = _core()
    assert core.worker_joined("decode-j", "decode") == [Count("workers_joined", (("role", "decode"),))]
    core.worker_ready("decode-j", Ready("decode-j", "decode", block_size=16))
    first = _decode_of(core.arrive("r0", list(range(40)), PARAMS, 0.0))
    second = _decode_of(core.arrive("r1", list(range(100, 140)), PARAMS, 0.1))
    assert {first, second} == {"decode-0", "decode-j"}  # least-loaded spreads over both
    j_rid = "r0" if first == "decode-j" else "r1"
    core.worker_leaving("decode-j")
    assert all(_decode_of(core.arrive(f"n{i}", list(range(200 + 50 * i, 240 + 50 * i)), PARAMS, 0.2)) == "decode-0"
               for i in range(3))
    assert core.drained() == []  # its request is still there
    core.token(j_rid, 0, False, 0.5, 7)
    assert core.drained() == []
    core.token(j_rid, 1, True, 0.6, 8)
    assert core.drained() == ["decode-j"]
    actions = core.worker_left("decode-j", 0.7, drained=True)
    assert Count("workers_left", (("role", "decode"), ("how", "drained"))) in actions
    assert not [a for a in actions if isinstance(a, Send)]  # nothing to move
    assert not core.workers["decode-j"].alive and core.drained() == []


def test_a_worker_that_leaves_early_hands_its_requests_to_the_others():
    core = _core()
    core.worker_joined("decode-j", "decode")
    core.worker_ready("decode-j", Ready("decode-j", "decode", block_size=16))
    core.workers["decode-0"].outstanding = 100  # least-loaded sends the next request to decode-j
    assert _decode_of(core.arrive("r0", list(range(40)), PARAMS, 0.0)) == "decode-j"
    core.token("r0", 0, False, 0.5, 7)
    core.worker_leaving("decode-j")
    actions = core.worker_left("decode-j", 1.0, drained=False)
    assert Count("workers_left", (("role", "decode"), ("how", "handed_off"))) in actions
    moved = [a for a in actions if isinstance(a, Send) and a.worker == "decode-0"]
    assert moved and core.flights["r0"].decode == "decode-0"  # it goes on where it can: not lost
    assert Count("worker_deaths", (("worker", "decode-j"),)) not in actions  # it left; it did not die
