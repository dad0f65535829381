"""Prefill and decode halves wired in one process over the real transports: same tokens as one engine.

Two real engines (a tiny random Llama), a `PrefillSide` pushing KV layer by layer and a `DecodeSide`
receiving it, over shm and tcp. Faults (corrupted chunks, a sender that gives up, a lease that runs out)
must end in recompute on the decode side with the same tokens, and no block may leak on either side.
"""

from __future__ import annotations

import time
import uuid

import pytest

from conftest import assert_no_blocks_held
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.kvstore.kv_meta import Tier
from pdserve.core.pd.delivery import DeliveryPolicy
from pdserve.engine.config import EngineConfig
from pdserve.engine.pd import DecodeSide, PrefillSide
from pdserve.engine.worker_engine import build_engine_at
from pdserve.transfer import capabilities, make_receiver, make_sender
from pdserve.transfer.base import FaultInjector

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _engine(model_dir, shared_kv=False, **kw):
    # No host tier unless a test asks for one: its copies hold blocks for a while, which the block
    # accounting of the delivery tests would see.
    cfg = dict(block_size=4, num_kv_blocks=256, num_threads=1, max_num_batched_tokens=64, kv_host_gb=0)
    cfg.update(kw)
    return build_engine_at(model_dir, EngineConfig(**cfg), detokenize=False, shared_kv=shared_kv)


def _prompts(n=4, base=37):
    return [[(base * (i + 1) + 7 * j) % 4000 + 10 for j in range(9 + 11 * i)] for i in range(n)]


def _reference(model_dir, prompts, params=GREEDY):
    engine = _engine(model_dir)
    ids = [engine.add_request(p, params) for p in prompts]
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
    return [outs[i] for i in ids]


class Pair:
    def __init__(self, model_dir, transport, tmp_path, prefill_kw=None, decode_kw=None, timeout_s=10.0,
                 faults=None, by_reference=True, policy=None):
        # Like the workers: a prefill pool in shared memory, so shm chunks go by reference.
        self.p_engine = _engine(model_dir, shared_kv=by_reference and capabilities(transport).zero_copy,
                                **(prefill_kw or {}))
        self.d_engine = _engine(model_dir, **(decode_kw or {}))
        sender = make_sender(transport, ring_mb=1, timeout_s=2.0)
        if faults is not None:
            sender.faults = faults
        addr = f"ipc://{tmp_path}/kv-{uuid.uuid4().hex[:8]}"
        receiver = make_receiver(transport, addr)
        self.prefill = PrefillSide(self.p_engine, sender, self.p_engine.executor.kv_pool.layers, policy=policy)
        self.p_engine.executor.layer_observer = self.prefill.on_layer
        self.decode = DecodeSide(self.d_engine, receiver, self.d_engine.executor.kv_pool.layers, timeout_s)
        self.outcomes = []

    def run(self, prompts, params=GREEDY, max_steps=2000):
        rids = [f"r{i}" for i in range(len(prompts))]
        for rid, p in zip(rids, prompts):
            self.decode.reserve(rid, p, params, xfer=rid + "#0")
        outs = {}
        for _ in range(max_steps):
            for g in self.decode.try_reserve():
                if g.needs_prefill:
                    res = g.reservation
                    self.prefill.add(res.request.request_id, res.request.prompt_token_ids, params,
                                     self.decode.receiver.address, res.xfer, g.first_block)
            if self.p_engine.scheduler.num_running + self.p_engine.scheduler.num_waiting:
                for o in self.p_engine.step():
                    self.prefill.finish(o.request_id, prefilled=o.finish_reason == "prefilled",
                                        first_token=o.token_ids[-1] if o.token_ids else None)
            for rid in self.prefill.failed_requests():
                self.p_engine.abort([rid])
                self.prefill.finish(rid, prefilled=False)
            self.decode.receive(timeout_ms=1)
            self.prefill.release_lent()
            for _, outcome, req in self.decode.settle():
                self.outcomes.append(outcome)
                if req is not None and req.is_finished:  # ended by the prefill worker's first token
                    outs[req.request_id] = req.output_token_ids
            if self.d_engine.scheduler.num_running + self.d_engine.scheduler.num_waiting:
                for o in self.d_engine.step():
                    if o.finished:
                        outs[o.request_id] = o.token_ids
            if len(outs) == len(rids):
                return [outs[r] for r in rids]
        raise AssertionError(f"not finished: {len(outs)}/{len(rids)}")

    def prefill_one(self, rid, prompt, params=GREEDY):
        """Reserve on the decode side and run the whole prefill, without letting the decode side read."""
        self.decode.reserve(rid, prompt, params, f"{rid}#0")
        (grant,) = self.decode.try_reserve()
        first = grant.first_block
        self.prefill.add(rid, prompt, params, self.decode.receiver.address, f"{rid}#0", first)
        while self.p_engine.scheduler.num_running + self.p_engine.scheduler.num_waiting:
            for o in self.p_engine.step():
                self.prefill.finish(o.request_id, prefilled=True, first_token=o.token_ids[-1])
        self.wait_sent()

    def wait_sent(self, within_s=10.0):
        """Until the links' lanes sent every queued record and the prefill side heard of each close."""
        deadline = time.monotonic() + within_s
        while True:
            self.prefill.pump()
            if self.prefill.outbox.idle():
                return
            assert time.monotonic() < deadline, "the lanes did not send everything in time"
            time.sleep(0.001)

    def decode_all(self):
        outs = {}
        while self.d_engine.has_unfinished():
            for o in self.d_engine.step():
                if o.finished:
                    outs[o.request_id] = o.token_ids
        return outs

    def assert_no_leak(self, within_s=10.0):
        # the links' lanes send the last records on their own threads: wait for them, and for the receiver
        # to take them, so the sender may release its blocks
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            self.decode.receive(timeout_ms=1)
            self.prefill.pump()
            self.prefill.release_lent()
            if self.prefill.outbox.idle() and not self.prefill.lent and not self.prefill.closing:
                break
        assert not self.prefill.lent
        for engine in (self.p_engine, self.d_engine):
            assert_no_blocks_held(engine)
        assert len(self.decode.inbound) == 0 and not self.prefill.outbound

    def close(self):
        self.prefill.outbox.stop()
        self.prefill.sender.close()
        self.decode.receiver.close()


@pytest.fixture
def pair_factory(tiny_llama_dir, tmp_path):
    pairs = []

    def make(transport, **kw):
        pair = Pair(tiny_llama_dir, transport, tmp_path, **kw)
        pairs.append(pair)
        return pair

    yield make
    for p in pairs:
        p.close()


@pytest.mark.parametrize("transport,by_reference", [("shm", True), ("shm", False), ("tcp", False), ("auto", True)])
def test_pd_tokens_equal_single_engine(tiny_llama_dir, pair_factory, transport, by_reference):
    prompts = _prompts()
    tiers = dict(kv_host_gb=0.01)  # with host tiers on both sides: delivery and tier copies side by side
    pair = pair_factory(transport, prefill_kw=dict(max_num_batched_tokens=8, **tiers),  # chunked prefill on P
                        decode_kw=tiers, by_reference=by_reference)
    assert pair.run(prompts) == _reference(tiny_llama_dir, prompts)
    assert pair.outcomes == ["delivered"] * len(prompts)
    assert pair.decode.stats.bytes_received > 0
    if transport == "shm":
        sender = pair.prefill.sender
        # by reference: every full block; partly filled blocks always go as a copy of their bytes
        assert (sender.chunks_by_reference > 0) is by_reference and sender.chunks_copied > 0
    if transport == "auto":  # both paths probed (two transfers each), shm's by reference
        assert pair.prefill.sender.transfers == {"shm": 2, "tcp": 2}
        assert pair.prefill.sender.senders["shm"].chunks_by_reference > 0
    pair.assert_no_leak()


def test_blocks_read_in_place_are_held_until_the_receiver_took_them(tiny_llama_dir, pair_factory):
    """By-reference chunks: the prefill worker keeps the blocks after its request ended, until the
    decode worker has read the records; a receiver that never reads is outlived by the lease."""
    prompt = _prompts(1)[0]
    pair = pair_factory("shm")
    pair.prefill_one("a", prompt)
    held = pair.p_engine.block_manager.num_used_blocks
    assert held > 0 and pair.prefill.release_lent() == 0  # the request is done, its blocks are not
    assert pair.p_engine.block_manager.num_used_blocks == held
    pair.wait_sent()  # the lanes sent it all
    pair.decode.receive(timeout_ms=50)
    assert pair.prefill.release_lent() == 1 and pair.p_engine.block_manager.num_used_blocks == 0
    assert [o for _, o, _ in pair.decode.settle()] == ["delivered"]

    # A receiver that never reads: the lease frees the blocks.
    pair.d_engine.abort(["a"])
    pair.prefill_one("b", prompt[::-1])
    assert pair.prefill.release_lent() == 0
    assert pair.prefill.release_lent(now=pair.prefill.lent[0].deadline_s + 1) == 1
    assert pair.p_engine.block_manager.num_used_blocks == 0


def test_blocks_reused_before_the_receiver_read_them_are_rejected(tiny_llama_dir, pair_factory):
    """If the sender's blocks change before the receiver copies them (a lease ran out and they were
    reused), the copy fails its checksum: the transfer is recomputed, the wrong KV never consumed."""
    prompts = _prompts(1)
    pair = pair_factory("shm")
    pair.prefill_one("r0", prompts[0])
    pair.prefill.release_lent(now=float("inf"))
    for layer in pair.p_engine.executor.kv_pool.layers:
        layer.add_(1.0)  # the blocks now hold something else
    pair.wait_sent()  # the lanes sent it all
    pair.decode.receive(timeout_ms=50)
    assert [o for _, o, _ in pair.decode.settle()] == ["recompute"]
    assert pair.decode.stats.failures["failed_checksum"] == 1
    outs = pair.decode_all()
    assert [outs["r0"]] == _reference(tiny_llama_dir, prompts)
    pair.assert_no_leak()


def test_decode_prefix_cache_skips_delivered_blocks(tiny_llama_dir, pair_factory):
    shared = _prompts(1)[0] * 3  # 27 tokens
    prompts = [shared + [11, 12, 13], shared + [21, 22]]
    pair = pair_factory("shm")
    first = pair.run(prompts[:1])
    bytes_first = pair.decode.stats.bytes_received
    second = pair.run(prompts[1:])
    assert first + second == _reference(tiny_llama_dir, prompts)
    # the second prompt's first 24 tokens (6 blocks) were in the decode worker's cache: not sent again
    assert pair.decode.stats.bytes_received - bytes_first < bytes_first / 2
    assert pair.d_engine.scheduler.stats.num_prefix_hit_tokens == 24
    pair.assert_no_leak()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_corrupted_chunks_are_never_consumed(tiny_llama_dir, pair_factory, transport):
    prompts = _prompts(3)
    pair = pair_factory(transport, faults=FaultInjector(every=3))
    assert pair.run(prompts) == _reference(tiny_llama_dir, prompts)
    assert pair.decode.stats.failures["failed_checksum"] >= 1
    assert "recompute" in pair.outcomes
    pair.assert_no_leak()


def test_sender_gives_up_and_decode_recomputes(tiny_llama_dir, pair_factory):
    prompts = _prompts(2)
    pair = pair_factory("shm")
    pair.prefill.sender.send_chunk = _always_fails
    assert pair.run(prompts) == _reference(tiny_llama_dir, prompts)
    assert pair.outcomes == ["recompute", "recompute"]
    assert pair.decode.stats.failures["failed_peer"] == 2
    pair.assert_no_leak()


def test_silent_sender_hits_the_lease(tiny_llama_dir, pair_factory):
    prompts = _prompts(1)
    pair = pair_factory("tcp", timeout_s=0.2)
    pair.prefill.add = lambda *a, **k: None  # the prefill worker never starts: nothing ever arrives
    assert pair.run(prompts) == _reference(tiny_llama_dir, prompts)
    assert pair.decode.stats.failures["failed_timeout"] == 1
    pair.assert_no_leak()


def test_a_lease_is_judged_on_every_record_sent_before_the_receiver_looked(tiny_llama_dir, pair_factory):
    """A decode worker busy placing one transfer's chunks past another's lease (a slow first copy, a loaded
    host) reads the `alive` record sent meanwhile before it judges that sender silent: no lapse."""
    a, b = _prompts(2)
    pair = pair_factory("shm", timeout_s=0.5)
    pair.prefill_one("a", a)  # a's records wait in the ring
    pair.decode.reserve("b", b, GREEDY, "b#0")
    (grant,) = pair.decode.try_reserve()  # b's lease runs from now
    first = grant.first_block
    place, slowed = pair.decode._place, []

    def slow_place(header):
        if header.get("xfer") == "a#0" and not slowed:
            slowed.append(header)
            time.sleep(0.2)  # b's sender says it still holds b, well within its lease...
            pair.prefill.sender.send_control(pair.decode.receiver.address, {"kind": "alive", "xfer": "b#0"})
            time.sleep(0.5)  # ...while the receiver is still busy here, past b's lease
        return place(header)

    pair.decode._place = slow_place
    for _ in range(100):  # (the ring's announcement may reach the receiver a moment after its records)
        pair.decode.receive(timeout_ms=1)
        if slowed:
            break
    assert slowed and pair.decode.inbound.get("b#0") is not None, "b lapsed on a record not read yet"
    renewed = pair.decode.inbound.num_renewals
    pair.decode.receive()  # the alive record: renewed
    assert pair.decode.inbound.num_renewals == renewed + 1
    assert [(t.xfer, outcome) for t, outcome, _ in pair.decode.settle()] == [("a#0", "delivered")]
    pair.prefill.add("b", b, GREEDY, pair.decode.receiver.address, "b#0", first)
    while pair.p_engine.scheduler.num_running + pair.p_engine.scheduler.num_waiting:
        for o in pair.p_engine.step():
            pair.prefill.finish(o.request_id, prefilled=True, first_token=o.token_ids[-1])
    pair.wait_sent()  # the lanes sent it all
    pair.decode.receive(timeout_ms=50)
    assert [(t.xfer, outcome) for t, outcome, _ in pair.decode.settle()] == [("b#0", "delivered")]
    assert pair.decode_all() == dict(zip(("a", "b"), _reference(tiny_llama_dir, [a, b])))
    pair.assert_no_leak()


def test_a_lapsed_lease_is_held_for_the_conductor_then_redirected_or_recomputed(tiny_llama_dir, pair_factory):
    """Under a conductor (`hold_lapsed`) a lapsed transfer keeps its reserved blocks: `redirect` expects the KV
    anew into them (from another prefill worker: here the same one, under the new transfer id), `kv_failed`
    recomputes; KV still coming under the old id is rejected."""
    a, b = _prompts(2)
    pair = pair_factory("shm", timeout_s=0.2)
    pair.decode.hold_lapsed = True
    for rid, prompt in (("a", a), ("b", b)):
        pair.decode.reserve(rid, prompt, GREEDY, f"{rid}#0")
    assert len(pair.decode.try_reserve()) == 2
    time.sleep(0.3)
    pair.decode.receive()
    assert [(t.xfer, outcome) for t, outcome, _ in pair.decode.settle()] == [("a#0", "held"), ("b#0", "held")]
    held_blocks = pair.d_engine.block_manager.block_ids("a")
    assert held_blocks and pair.d_engine.scheduler.requests["a"].status.name == "WAITING_FOR_KV"
    assert pair.decode.redirect("a#0", "a#1").xfer == "a#1"  # expected now: the conductor may send a#1's prompt
    assert pair.decode.redirect("gone#0", "gone#1") is None  # ended meanwhile: nothing to expect, no dispatch
    pair.decode.peer_failed("b#0")  # b: the decode worker recomputes it
    assert pair.d_engine.scheduler.requests["b"].status.name == "WAITING"
    pair.decode.timeout_s = 10.0
    pair.decode.inbound.get("a#1").deadline_s = time.monotonic() + 10.0
    pair.prefill.add("a", a, GREEDY, pair.decode.receiver.address, "a#1", 0)
    while pair.p_engine.scheduler.num_running + pair.p_engine.scheduler.num_waiting:
        for o in pair.p_engine.step():
            pair.prefill.finish(o.request_id, prefilled=True, first_token=o.token_ids[-1])
    pair.wait_sent()  # the lanes sent it all
    pair.decode.receive(timeout_ms=50)
    assert [(t.xfer, outcome) for t, outcome, _ in pair.decode.settle()] == [("a#1", "delivered")]
    assert pair.d_engine.block_manager.block_ids("a") == held_blocks  # into the blocks it held
    assert pair.decode_all() == dict(zip(("a", "b"), _reference(tiny_llama_dir, [a, b])))
    assert not pair.decode.held
    pair.assert_no_leak()


def test_a_held_transfer_still_takes_its_kv_and_a_renewed_one_is_delivered(tiny_llama_dir, pair_factory):
    """A lapsed transfer held for the conductor stays live: chunks its (busy, not hung) sender sends meanwhile
    land, it is reported held once, `renew` gives it a lease again and it is delivered; one whose `done`
    arrives before the conductor's word is delivered, and the late word (`kv_failed`, `renew`) changes
    nothing."""
    a, b = _prompts(2)
    pair = pair_factory("shm", timeout_s=0.2)
    pair.decode.hold_lapsed = True
    firsts = {}
    for rid, prompt in (("a", a), ("b", b)):
        pair.decode.reserve(rid, prompt, GREEDY, f"{rid}#0")
    for g in pair.decode.try_reserve():
        firsts[g.reservation.request.request_id] = g.first_block
    time.sleep(0.3)  # both senders silent past the lease
    pair.decode.receive()
    assert [(t.xfer, outcome) for t, outcome, _ in pair.decode.settle()] == [("a#0", "held"), ("b#0", "held")]
    pair.decode.receive()
    assert pair.decode.settle() == []  # reported once: no deadline while held
    for rid, prompt in (("a", a), ("b", b)):  # now they send, late
        pair.prefill.add(rid, prompt, GREEDY, pair.decode.receiver.address, f"{rid}#0", firsts[rid])
    tokens = {}
    while pair.p_engine.scheduler.num_running + pair.p_engine.scheduler.num_waiting:
        for o in pair.p_engine.step():
            tokens[o.request_id] = o.token_ids[-1]
    pair.prefill.finish("a", prefilled=True, first_token=tokens["a"])
    pair.wait_sent()  # the lanes sent it all
    pair.decode.receive(timeout_ms=50)  # a: whole and done while held; b: its chunks landed, no done yet
    assert [(t.xfer, outcome) for t, outcome, _ in pair.decode.settle()] == [("a#0", "delivered")]
    pair.decode.peer_failed("a#0")  # the conductor's word came late: a decodes on
    assert pair.d_engine.scheduler.requests["a"].status.name != "WAITING"
    assert not pair.decode.renew("a#0")
    assert pair.decode.renew("b#0") and pair.decode.inbound.get("b#0").deadline_s < float("inf")
    pair.decode.inbound.get("b#0").deadline_s = time.monotonic() - 1.0  # renewed, and lapses again
    pair.decode.receive()
    assert [(t.xfer, outcome, t.lapses) for t, outcome, _ in pair.decode.settle()] == [("b#0", "held", 2)]
    assert pair.decode.stats.failures == {"failed_timeout": 2}  # a's lapse and b's first: b's second is the same
    assert pair.decode.renew("b#0")
    pair.decode.timeout_s = pair.decode.inbound.get("b#0").timeout_s = 10.0
    pair.decode.inbound.get("b#0").deadline_s = time.monotonic() + 10.0
    pair.prefill.finish("b", prefilled=True, first_token=tokens["b"])
    pair.wait_sent()  # the lanes sent it all
    pair.decode.receive(timeout_ms=50)
    assert [(t.xfer, outcome) for t, outcome, _ in pair.decode.settle()] == [("b#0", "delivered")]
    assert pair.decode_all() == dict(zip(("a", "b"), _reference(tiny_llama_dir, [a, b])))
    assert not pair.decode.held and pair.decode.stats.wasted_bytes == {}
    pair.assert_no_leak()


def test_abort_while_waiting_for_kv_frees_blocks_and_drops_late_chunks(tiny_llama_dir, pair_factory):
    prompt = _prompts(1)[0]
    pair = pair_factory("shm")
    pair.decode.reserve("a", prompt, GREEDY, "a#0")
    (grant,) = pair.decode.try_reserve()
    first = grant.first_block
    pair.prefill.add("a", prompt, GREEDY, pair.decode.receiver.address, "a#0", first)
    assert pair.d_engine.block_manager.num_used_blocks > 0
    pair.d_engine.abort(["a"])
    pair.decode.abort("a")
    while pair.p_engine.scheduler.num_running + pair.p_engine.scheduler.num_waiting:
        for o in pair.p_engine.step():
            pair.prefill.finish(o.request_id, prefilled=True, first_token=o.token_ids[-1])
    pair.wait_sent()  # the lanes sent it all
    pair.decode.receive(timeout_ms=50)
    assert pair.decode.settle() == []
    assert pair.decode.inbound.num_late_chunks > 0
    pair.assert_no_leak()


def _always_fails(*args, **kwargs):
    from pdserve.transfer.base import TransferError
    raise TransferError("test: the link is down")


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_layers_split_into_bounded_chunks(tiny_llama_dir, pair_factory, transport):
    prompts = _prompts(3)
    pair = pair_factory(transport)
    per_block = pair.p_engine.executor.kv_pool.layers[0][:, :, :1].numel() * 4
    pair.prefill.sender.max_chunk_bytes = 2 * per_block  # at most 2 blocks per chunk
    assert pair.run(prompts) == _reference(tiny_llama_dir, prompts)
    layers = len(pair.p_engine.executor.kv_pool.layers)
    assert pair.decode.stats.chunks_received > layers * len(prompts) * 2  # many chunks per layer
    pair.assert_no_leak()


@pytest.mark.parametrize("delivery", ["fifo", "scheduled"])
def test_steps_ending_inside_a_block_send_each_block_once(tiny_llama_dir, pair_factory, delivery):
    """Prefill steps of 6 tokens over blocks of 4 (as production pacing cuts a chunk at any token): a block a
    step left partly filled goes once, complete, with the next step, under either delivery (the receiver reads
    nothing before the transfer is done; fifo sent its bytes ahead too, ~25% more KV on a 50 Mbit/s link)."""
    prompts = _prompts(3)  # 9, 20 and 31 tokens: 3 + 5 + 8 blocks
    pair = pair_factory("tcp", prefill_kw={"max_num_batched_tokens": 6}, policy=DeliveryPolicy(delivery))
    assert pair.run(prompts) == _reference(tiny_llama_dir, prompts)
    pair.wait_sent()
    block_bytes = pair.prefill.block_bytes  # one block, all layers
    blocks = sum(-(-len(p) // 4) for p in prompts)
    assert pair.prefill.outbox.bytes_sent == blocks * block_bytes
    pair.assert_no_leak()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_late_receiver_still_gets_the_kv_the_sender_sent(tiny_llama_dir, pair_factory, transport):
    """Chunked prefill with blocks left partly filled between steps, and a receiver that reads only after
    the whole prompt was computed: every chunk must still verify (a block sent while partly filled must not
    be read later from the pool, where the next step has written more tokens into it)."""
    prompt = _prompts(3)[2]  # 31 tokens
    pair = pair_factory(transport, prefill_kw=dict(max_num_batched_tokens=6))  # 6-token steps, 4-token blocks
    pair.prefill_one("a", prompt)
    for _ in range(20):
        pair.decode.receive(timeout_ms=20)
    assert [o for _, o, _ in pair.decode.settle()] == ["delivered"]
    assert not pair.decode.stats.failures
    outs = pair.decode_all()
    assert [outs["a"]] == _reference(tiny_llama_dir, [prompt])
    pair.assert_no_leak()


def test_first_token_comes_from_the_prefill_worker(tiny_llama_dir, pair_factory):
    """The prefill worker samples the first token and sends it with `done`: a request that needs one token
    (or whose first token is a stop token) ends on delivery, with no step on the decode worker."""
    prompts = _prompts(2)
    ref = _reference(tiny_llama_dir, prompts)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    pair = pair_factory("shm")
    steps = []
    pair.d_engine.step = (lambda step: lambda: steps.append(1) or step())(pair.d_engine.step)
    assert pair.run(prompts, one) == [r[:1] for r in ref]
    assert pair.outcomes == ["delivered", "delivered"] and not steps
    stop_first = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[ref[0][0]])
    assert pair.run(prompts[:1], stop_first) == [ref[0][:1]]
    pair.assert_no_leak()


def test_done_without_a_valid_first_token_is_recomputed(tiny_llama_dir, pair_factory):
    prompts = _prompts(1)
    pair = pair_factory("tcp")
    finish = pair.prefill.finish
    pair.prefill.finish = lambda rid, prefilled, first_token=None: finish(rid, prefilled, first_token=10 ** 9)
    assert pair.run(prompts) == _reference(tiny_llama_dir, prompts)
    assert pair.outcomes == ["recompute"] and pair.decode.stats.failures["failed_incomplete"] == 1
    pair.assert_no_leak()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_pd_prompts_longer_than_both_pools(tiny_llama_dir, pair_factory, transport):
    """24-block pools (96 tokens) with host tiers: prompts of ~150-250 tokens. The prefill worker slides its
    window (older blocks leave its pool once sent and copied to host); the decode worker receives each
    prompt's head straight into its host tier and only the last window's blocks into its pool. Same tokens
    as one engine with a pool that holds everything; nothing leaked."""
    prompts = [[(53 * (i + 1) + 11 * j) % 4000 + 10 for j in range(150 + 50 * i)] for i in range(3)]
    small = dict(num_kv_blocks=24, kv_host_gb=0.02, max_num_batched_tokens=32)
    pair = pair_factory(transport, prefill_kw=small, decode_kw=small)
    assert pair.d_engine.scheduler.max_model_len > 24 * 4
    assert pair.run(prompts) == _reference(tiny_llama_dir, prompts)
    assert pair.outcomes == ["delivered"] * len(prompts)
    assert pair.d_engine.tiers.stats.bytes_in[Tier.HOST] > 0
    pair.assert_no_leak()
    for engine in (pair.p_engine, pair.d_engine):
        assert all(m.busy == 0 and m.ready for m in engine.tiers.host)


def test_auto_wire_format_ships_late_elastic_kv_as_int8_and_priority_exact(tiny_llama_dir, pair_factory):
    """--kv-wire-dtype auto on a slow link: a default-tier transfer the link cannot deliver before its predicted
    consumption goes as int8 (decoded by the receiver into its pool), a priority one exact; both delivered."""
    from pdserve.core.pd.wire_format import WireFormat
    a, b = _prompts(2)
    pair = pair_factory("tcp")
    pair.prefill.wire = WireFormat("auto")
    pair.prefill.outbox.link_rate = 1e5  # 100 kB/s: seconds for either prompt's KV
    firsts = {}
    for rid, prompt in (("a", a), ("b", b)):
        pair.decode.reserve(rid, prompt, GREEDY, f"{rid}#0")
    for g in pair.decode.try_reserve():
        firsts[g.reservation.request.request_id] = g.first_block
    for rid, prompt, tier in (("a", a, "default"), ("b", b, "priority")):
        pair.prefill.add(rid, prompt, GREEDY, pair.decode.receiver.address, f"{rid}#0", firsts[rid],
                         service_tier=tier, deadline_in_s=0.05, read_in_s=0.05)
    pool = pair.prefill.kv_format
    assert (pair.prefill.outbound["a"].wire_format, pair.prefill.outbound["b"].wire_format) == ("int8", pool)
    pair.prefill.outbox.link_rate = None  # (then as fast as the transport goes)
    for lane in pair.prefill.outbox.lanes.values():
        lane.bucket = None
    while pair.p_engine.scheduler.num_running + pair.p_engine.scheduler.num_waiting:
        for o in pair.p_engine.step():
            pair.prefill.finish(o.request_id, prefilled=True, first_token=o.token_ids[-1])
    pair.wait_sent()
    outcomes = []
    deadline = time.monotonic() + 10
    while len(outcomes) < 2 and time.monotonic() < deadline:
        pair.decode.receive(timeout_ms=10)
        outcomes += [(t.xfer, o) for t, o, _ in pair.decode.settle()]
    assert sorted(outcomes) == [("a#0", "delivered"), ("b#0", "delivered")]
    assert pair.decode.stats.chunks_transcoded > 0
    wire = pair.prefill.wire_bytes
    assert wire[("default", "int8")] > 0 and wire[("priority", pool)] > 0 and not wire[("default", pool)]
    pair.decode_all()
    pair.assert_no_leak()


def test_a_warm_pass_labels_its_blocks(tiny_llama_dir, pair_factory):
    """`PrefillSide.warm` with a label: the hot prefix's cached blocks carry it (secret: the block column that
    keeps them off an unsealed disk tier)."""
    pair = pair_factory("tcp")
    blocks = pair.p_engine.block_manager
    for rid, prompt, label in (("w1", _prompts(1, base=5)[0], "secret"), ("w2", _prompts(1, base=91)[0], "internal")):
        pair.prefill.warm(rid, prompt, label)
        while pair.p_engine.scheduler.num_running + pair.p_engine.scheduler.num_waiting:
            for o in pair.p_engine.step():
                pair.prefill.stage_ended(o.request_id, True)
        hit = blocks.find_prefix(prompt).block_ids
        assert hit and all(bool(blocks.cols.secret[b]) == (label == "secret") for b in hit), (label, hit)
