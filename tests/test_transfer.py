"""Transports and the inbound book, without a model: bytes arrive intact or are flagged, rings wrap and
apply backpressure with a deadline, and a transfer completes only when every block of every layer came."""

from __future__ import annotations

import os
import uuid

import pytest

from pdserve.transfer import make_receiver, make_sender
from pdserve.transfer.base import FaultInjector, TransferError, TransferState
from pdserve.transfer.inbound import InboundTransfers


@pytest.fixture(params=["shm", "tcp"])
def link(request, tmp_path):
    receiver = make_receiver(request.param, f"ipc://{tmp_path}/kv-{uuid.uuid4().hex[:6]}")
    sender = make_sender(request.param, ring_mb=1, timeout_s=0.5)
    yield sender, receiver
    sender.close()
    receiver.close()


def _drain(receiver, expect: int):
    got = []
    for _ in range(200):
        for msg in receiver.poll(timeout_ms=20):
            got.append((msg.header, bytes(msg.payload) if msg.payload is not None else None, msg.verified))
            msg.release()
        if len(got) >= expect:
            return got
    raise AssertionError(f"got {len(got)} of {expect}")


def test_chunks_arrive_intact_and_in_order(link):
    sender, receiver = link
    payloads = [os.urandom(n) for n in (1, 4096, 300_000, 700_000, 300_000, 123)]  # wraps the 1 MiB ring
    got = []
    for i, p in enumerate(payloads):
        sender.send_chunk(receiver.address, {"kind": "chunk", "seq": i}, len(p),
                          lambda buf, p=p: buf.__setitem__(slice(None), p))
        got += _drain(receiver, 1)  # consume as we go, so the ring frees space
    sender.send_control(receiver.address, {"kind": "done", "num_chunks": len(payloads)})
    got += _drain(receiver, 1)
    assert [h.get("seq") for h, _, _ in got] == [0, 1, 2, 3, 4, 5, None]
    assert [p for _, p, _ in got[:-1]] == payloads and all(ok for _, _, ok in got[:-1])
    assert got[-1][0] == {"kind": "done", "num_chunks": len(payloads)} and got[-1][1] is None


def test_payload_bytes_and_checksums(link):
    sender, receiver = link
    data = [os.urandom(5000) for _ in range(5)]
    for p in data:
        sender.send_chunk(receiver.address, {"kind": "chunk"}, len(p), lambda buf, p=p: buf.__setitem__(slice(None), p))
    got = _drain(receiver, 5)
    assert [g[1] for g in got] == data and all(g[2] for g in got)


def test_corruption_is_detected(link):
    sender, receiver = link
    sender.faults = FaultInjector(every=2)
    for _ in range(4):
        sender.send_chunk(receiver.address, {"kind": "chunk"}, 64, lambda buf: buf.__setitem__(slice(None), b"a" * 64))
    assert [g[2] for g in _drain(receiver, 4)] == [True, False, True, False]


def test_shm_ring_full_raises_after_deadline(tmp_path):
    receiver = make_receiver("shm", f"ipc://{tmp_path}/kv-full")
    sender = make_sender("shm", ring_mb=1, timeout_s=0.2)
    try:
        fill = lambda buf: None  # noqa: E731
        sender.send_chunk(receiver.address, {"kind": "chunk"}, 700_000, fill)
        with pytest.raises(TransferError, match="ring full"):
            sender.send_chunk(receiver.address, {"kind": "chunk"}, 700_000, fill)  # nobody consumed
        with pytest.raises(TransferError, match="exceeds"):
            sender.send_chunk(receiver.address, {"kind": "chunk"}, 2 << 20, fill)
    finally:
        sender.close()
        receiver.close()


def test_tcp_send_to_a_dead_receiver_times_out():
    sender = make_sender("tcp", timeout_s=0.2)
    try:
        with pytest.raises(TransferError):
            for _ in range(10_000):  # the queue to an unreachable peer fills, then the deadline hits
                sender.send_chunk("tcp://127.0.0.1:9", {"kind": "chunk"}, 1024, lambda buf: None)
    finally:
        sender.close()


def _chunk(xfer, layer, first, count, nbytes=10):
    return {"kind": "chunk", "xfer": xfer, "layer": layer, "first": first, "count": count, "nbytes": nbytes}


def test_inbound_completes_only_with_every_block_of_every_layer():
    book = InboundTransfers(num_layers=2)
    book.expect("x", "r", first_block=1, num_blocks=3, timeout_s=10)
    for layer in (0, 1):
        assert book.accept_chunk(_chunk("x", layer, 1, 2), True) is not None
    assert book.accept_chunk(_chunk("x", 0, 3, 1), True) is not None
    book.on_done({"xfer": "x", "num_chunks": 3})  # layer 1 lacks block 3
    (ended,) = book.take_ended()
    assert ended.state is TransferState.FAILED_INCOMPLETE

    book.expect("y", "r2", first_block=0, num_blocks=2, timeout_s=10)
    for layer in (0, 1):
        book.accept_chunk(_chunk("y", layer, 0, 2), True)
    book.on_done({"xfer": "y", "num_chunks": 2})
    assert book.take_ended()[0].state is TransferState.COMPLETED


@pytest.mark.parametrize("header,verified,state", [
    (_chunk("x", 0, 0, 1), False, TransferState.FAILED_CHECKSUM),
    (_chunk("x", 0, 0, 1), True, TransferState.FAILED_PEER),  # before first_block: a cached, shared block
    (_chunk("x", 5, 1, 1), True, TransferState.FAILED_PEER),  # no such layer
    (_chunk("x", 0, 2, 5), True, TransferState.FAILED_PEER),  # past the reserved blocks
])
def test_inbound_rejects_bad_chunks(header, verified, state):
    book = InboundTransfers(num_layers=2)
    book.expect("x", "r", first_block=1, num_blocks=2, timeout_s=10)
    assert book.accept_chunk(header, verified) is None
    assert book.take_ended()[0].state is state
    assert book.accept_chunk(_chunk("x", 0, 1, 1), True) is None  # late chunks of an ended transfer
    assert book.num_late_chunks == 1


def test_inbound_lease_renews_on_progress_and_expires():
    book = InboundTransfers(num_layers=1)
    t = book.expect("x", "r", first_block=0, num_blocks=4, timeout_s=5)
    book.expire(now=t.deadline_s - 1)
    assert len(book) == 1
    book.accept_chunk(_chunk("x", 0, 0, 1), True)
    book.expire(now=t.started_s + 4.9)
    assert len(book) == 1
    book.expire(now=t.deadline_s + 0.1)
    assert book.take_ended()[0].state is TransferState.FAILED_TIMEOUT
    book.expect("y", "r", 0, 1, 5)
    book.abort_request("r")
    assert book.take_ended()[0].state is TransferState.ABORTED


@pytest.mark.parametrize("ids", [[3], [0, 1, 2, 3], [7, 8, 2, 3, 4], [9, 1, 5, 3, 7, 0, 2], list(range(20, 0, -1))])
def test_block_gather_scatter_roundtrip(ids):
    import torch

    from pdserve.kv.block_io import chunk_nbytes, gather_blocks, scatter_blocks
    src = torch.randn(2, 3, 32, 4, 8)
    buf = bytearray(chunk_nbytes(src, len(ids)))
    gather_blocks(src, ids, buf)
    wire = torch.frombuffer(buf, dtype=torch.float32).view(6, len(ids), 32)
    assert torch.equal(wire, src.view(6, 32, 32)[:, ids])
    dst = torch.zeros_like(src)
    scatter_blocks(dst, ids, buf)
    assert torch.equal(dst[:, :, ids], src[:, :, ids])
    others = [b for b in range(32) if b not in ids]
    assert not dst[:, :, others].any()
