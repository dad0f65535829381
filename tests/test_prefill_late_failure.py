"""A prefill worker whose sends fail after its request was reported prefilled (a connect or a `done` that fails
once the prompt is computed: a slow-to-fail peer, a link that broke) says so again (`late_failures`, reported
by the worker as a failed `prefilled`), so the conductor has the waiting decode worker recompute at once rather
than renew its lease while the prefill worker is heard (issue 40 item 5). Real engines (a tiny Llama) and the
real tcp sender, its sends held until the prompt is prefilled and then failing."""

from __future__ import annotations

import threading
import time

from pdserve.transfer.base import TransferError
from test_pd_engine import GREEDY, _prompts, pair_factory  # noqa: F401  (the fixture)


def _prefill(pair, rid: str, prompt: list[int]) -> list:
    """Reserve and compute `prompt` whole; what each `finish` returned (the failure known by then)."""
    pair.decode.reserve(rid, prompt, GREEDY, f"{rid}#0")
    (grant,) = pair.decode.try_reserve()
    pair.prefill.add(rid, prompt, GREEDY, pair.decode.receiver.address, f"{rid}#0", grant.first_block)
    finished = []
    while pair.p_engine.scheduler.num_running + pair.p_engine.scheduler.num_waiting:
        for o in pair.p_engine.step():
            finished.append(pair.prefill.finish(o.request_id, prefilled=True, first_token=o.token_ids[-1]))
    return finished


def _late(pair, within_s: float = 10.0) -> list:
    deadline = time.monotonic() + within_s
    while not pair.prefill.late_failures and time.monotonic() < deadline:
        pair.prefill.pump()
        time.sleep(0.001)
    return pair.prefill.late_failures


def test_sends_that_fail_after_the_prompt_was_reported_prefilled_are_a_late_failure(pair_factory):
    pair = pair_factory("tcp")
    gate = threading.Event()

    def fails_late(dest, header, pieces=()):
        gate.wait(10)
        raise TransferError(f"tcp connect to {dest} failed: timed out")

    pair.prefill.sender.send_chunk = fails_late
    pair.prefill.sender.send_control = lambda dest, header: fails_late(dest, header)
    (prompt,) = _prompts(1)
    assert _prefill(pair, "a", prompt) == [None]  # reported prefilled: nothing had failed yet
    assert pair.prefill.late_failures == []
    gate.set()
    late = _late(pair)
    assert [rid for rid, _ in late] == ["a"] and "connect" in late[0][1]
    assert pair.prefill.reported_ok == set()


def test_a_transfer_delivered_whole_is_no_late_failure(pair_factory):
    pair = pair_factory("tcp")
    (prompt,) = _prompts(1)
    assert _prefill(pair, "a", prompt) == [None]
    pair.wait_sent()
    assert pair.prefill.late_failures == [] and pair.prefill.reported_ok == set()
