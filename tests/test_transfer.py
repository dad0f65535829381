"""Transports and the inbound book, without a model: bytes arrive intact or are flagged, rings wrap and
apply backpressure with a deadline, and a transfer completes only when every block of every layer came."""

from __future__ import annotations

import os
import socket
import time
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


def _drain(receiver, expect: int, place=None):
    got = []
    for _ in range(200):
        kw = {} if place is None else {"place": place}
        for msg in receiver.poll(timeout_ms=20, **kw):
            got.append((msg.header, msg.payload, msg.verified))
        if len(got) >= expect:
            return got
    raise AssertionError(f"got {len(got)} of {expect}")


def _send(sender, receiver, header, payload: bytes, pieces: int = 1):
    """Send `payload` as `pieces` separate views (a pool's block runs)."""
    cut = [len(payload) * i // pieces for i in range(pieces + 1)]
    views = [memoryview(payload)[cut[i]:cut[i + 1]] for i in range(pieces)]
    sender.send_chunk(receiver.address, header, views)


def test_chunks_arrive_intact_and_in_order(link):
    sender, receiver = link
    payloads = [os.urandom(n) for n in (1, 4096, 300_000, 700_000, 300_000, 123)]  # wraps the 1 MiB ring
    got = []
    for i, p in enumerate(payloads):
        _send(sender, receiver, {"kind": "chunk", "seq": i}, p, pieces=1 + i % 3)
        got += _drain(receiver, 1)  # consume as we go, so the ring frees space
    sender.send_control(receiver.address, {"kind": "done", "num_chunks": len(payloads)})
    got += _drain(receiver, 1)
    assert [h.get("seq") for h, _, _ in got] == [0, 1, 2, 3, 4, 5, None]
    assert [p for _, p, _ in got[:-1]] == payloads and all(ok for _, _, ok in got[:-1])
    assert [h["nbytes"] for h, _, _ in got[:-1]] == [len(p) for p in payloads]
    assert got[-1][0] == {"kind": "done", "num_chunks": len(payloads)} and got[-1][1] is None


def test_payload_lands_in_the_placed_views(link):
    """The receiver writes each payload across the views `place` names (a pool's blocks), in order, and
    a declined payload is skipped without losing the records after it."""
    sender, receiver = link
    pool = bytearray(30_000)
    data = [os.urandom(5000) for _ in range(4)]
    for i, p in enumerate(data):
        _send(sender, receiver, {"kind": "chunk", "i": i}, p, pieces=4)

    def place(header):
        if header["i"] == 2:
            return None  # e.g. a late chunk: nowhere to go
        base = 7000 * header["i"]
        return [memoryview(pool)[base:base + 1000], memoryview(pool)[base + 2000:base + 6000]]

    got = _drain(receiver, 4, place)
    assert [g[0]["i"] for g in got] == [0, 1, 2, 3]
    assert [g[2] for g in got] == [True, True, False, True] and got[2][1] is None
    for i in (0, 1, 3):
        base = 7000 * i
        assert pool[base:base + 1000] + pool[base + 2000:base + 6000] == data[i]
        assert pool[base + 1000:base + 2000] == bytes(1000)  # untouched between the views


def test_corruption_is_detected(link):
    sender, receiver = link
    sender.faults = FaultInjector(every=2)
    source = bytearray(b"a" * 64)
    for _ in range(4):
        sender.send_chunk(receiver.address, {"kind": "chunk"}, [memoryview(source)])
    assert [g[2] for g in _drain(receiver, 4)] == [True, False, True, False]
    assert source == b"a" * 64  # the sender's own memory is never the corrupted copy


def test_shm_ring_full_raises_after_deadline(tmp_path):
    receiver = make_receiver("shm", f"ipc://{tmp_path}/kv-full")
    sender = make_sender("shm", ring_mb=1, timeout_s=0.2)
    try:
        big = memoryview(bytes(700_000))
        sender.send_chunk(receiver.address, {"kind": "chunk"}, [big])
        with pytest.raises(TransferError, match="ring full"):
            sender.send_chunk(receiver.address, {"kind": "chunk"}, [big])  # nobody consumed
        with pytest.raises(TransferError, match="exceeds"):
            sender.send_chunk(receiver.address, {"kind": "chunk"}, [memoryview(bytes(2 << 20))])
    finally:
        sender.close()
        receiver.close()


def test_tcp_send_to_a_dead_receiver_fails():
    sender = make_sender("tcp", timeout_s=0.2)
    try:
        with pytest.raises(TransferError, match="connect"):
            sender.send_chunk("tcp://127.0.0.1:9", {"kind": "chunk"}, [memoryview(bytes(1024))])
    finally:
        sender.close()


def test_tcp_receiver_that_stops_reading_makes_the_sender_time_out():
    receiver = make_receiver("tcp")
    sender = make_sender("tcp", timeout_s=0.3)
    try:
        payload = [memoryview(bytes(4 << 20))]
        sender.send_chunk(receiver.address, {"kind": "chunk"}, [payload[0][:16 << 10]])
        receiver.poll(0)  # accepts the connection (and reads a little); never called again
        with pytest.raises(TransferError, match="failed"):
            for _ in range(64):  # 256 MiB: far beyond the socket buffers
                sender.send_chunk(receiver.address, {"kind": "chunk"}, payload)
    finally:
        sender.close()
        receiver.close()


def test_tcp_garbage_ends_that_stream_only(link):
    sender, receiver = link
    if not receiver.address.startswith("tcp://"):
        pytest.skip("tcp only")
    from pdserve.transfer.tcp import parse_address
    from pdserve.transfer.peer_auth import hello
    foreign = socket.create_connection(parse_address(receiver.address))
    foreign.sendall(b"\xff" * 64)  # no hello of this deployment: refused, counted, nothing read
    stolen = socket.create_connection(parse_address(receiver.address))
    stolen.sendall(hello(b"another deployment's secret....."))
    junk = socket.create_connection(parse_address(receiver.address))
    junk.sendall(hello() + b"\xff" * 64)  # a peer of ours, then a prefix claiming a 4 GiB meta
    _send(sender, receiver, {"kind": "chunk", "ok": 1}, b"x" * 100)
    got = _drain(receiver, 2)
    kinds = sorted(str(h.get("kind")) for h, _, _ in got)
    assert kinds == ["bad", "chunk"] and receiver.num_bad_records == 1
    for _ in range(100):
        if receiver.rejected_connections == {"kv_tcp": 2}:
            break
        receiver.poll(timeout_ms=20)
    assert receiver.rejected_connections == {"kv_tcp": 2}
    for s in (foreign, stolen, junk):
        s.close()


def _chunk(xfer, layer, first, count, nbytes=10):
    return {"kind": "chunk", "xfer": xfer, "layer": layer, "first": first, "count": count, "nbytes": nbytes}


def test_inbound_completes_only_with_every_block_of_every_layer():
    book = InboundTransfers(num_layers=2)
    book.expect("x", "r", first_block=1, num_blocks=3, timeout_s=10)
    for layer in (0, 1):
        assert book.accept_chunk(_chunk("x", layer, 1, 2), True) is not None
    assert book.accept_chunk(_chunk("x", 0, 3, 1), True) is not None
    book.on_done({"xfer": "x", "num_chunks": 3, "first_token": 5}, vocab_size=10)  # layer 1 lacks block 3
    (ended,) = book.take_ended()
    assert ended.state is TransferState.FAILED_INCOMPLETE

    book.expect("y", "r2", first_block=0, num_blocks=2, timeout_s=10)
    for layer in (0, 1):
        book.accept_chunk(_chunk("y", layer, 0, 2), True)
    book.on_done({"xfer": "y", "num_chunks": 2, "first_token": 5}, vocab_size=10)
    (done,) = book.take_ended()
    assert done.state is TransferState.COMPLETED and done.first_token == 5

    for bad in (None, -1, 10, "5"):  # every block arrived, but no usable first token
        book.expect("z", "r3", first_block=0, num_blocks=1, timeout_s=10)
        for layer in (0, 1):
            book.accept_chunk(_chunk("z", layer, 0, 1), True)
        book.on_done({"xfer": "z", "num_chunks": 2, "first_token": bad}, vocab_size=10)
        assert book.take_ended()[0].state is TransferState.FAILED_INCOMPLETE


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


def test_inbound_lease_renews_on_alive_records_of_a_queued_transfer():
    book = InboundTransfers(num_layers=1)
    t = book.expect("x", "r", first_block=0, num_blocks=1, timeout_s=0.2)
    for _ in range(4):  # queued at the sender, no chunk yet: each `alive` starts the lease over
        time.sleep(0.1)
        book.renew("x")
        book.expire()
    assert len(book) == 1 and book.num_renewals == 4 and t.state is TransferState.RESERVED
    book.renew("unknown")  # a transfer that ended (or never was) is ignored
    time.sleep(0.25)
    book.expire()  # the sender went silent
    assert book.take_ended()[0].state is TransferState.FAILED_TIMEOUT


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


@pytest.mark.parametrize("ids", [[3], [0, 1, 2, 3], [7, 8, 2, 3, 4], list(range(20, 0, -1))])
def test_block_pieces_are_the_wire_payload_in_place(ids):
    """`block_pieces` names exactly the bytes `gather_blocks` would produce, as views into the pool: a
    write through them lands in those blocks and nowhere else."""
    import torch

    from pdserve.kv.block_io import block_pieces, chunk_nbytes, gather_blocks
    src = torch.randn(2, 3, 32, 4, 8)
    buf = bytearray(chunk_nbytes(src, len(ids)))
    gather_blocks(src, ids, buf)
    assert b"".join(bytes(p) for p in block_pieces(src, ids)) == bytes(buf)
    dst = torch.zeros_like(src)
    off = 0
    for piece in block_pieces(dst, ids):
        piece[:] = buf[off:off + len(piece)]
        off += len(piece)
    assert torch.equal(dst[:, :, ids], src[:, :, ids])
    assert not dst[:, :, [b for b in range(32) if b not in ids]].any()


def test_tcp_payload_split_across_polls_asks_again_where_the_rest_goes():
    """A payload that arrives in parts: before writing the rest, the receiver asks `place` again; once its
    transfer has ended (None), the rest is dropped and nothing more is written into the old blocks."""
    import xxhash

    from pdserve.transfer.base import encode_meta
    from pdserve.transfer.tcp import PREFIX, parse_address
    from pdserve.transfer.peer_auth import hello
    receiver = make_receiver("tcp")
    raw = socket.create_connection(parse_address(receiver.address))
    raw.sendall(hello())  # this deployment's peer

    def frame(i: int, payload: bytes) -> tuple[bytes, int]:
        meta = encode_meta({"kind": "chunk", "i": i})
        head = PREFIX.pack(len(meta), len(payload), xxhash.xxh3_64_intdigest(payload), 0) + meta  # plain
        return head + payload, len(head)

    def poll_until(n, got):
        for _ in range(50):
            got += receiver.poll(20, place)
            if len(got) >= n:
                return got
        return got

    pool = bytearray(40_000)
    live = {0: True, 1: True}

    def place(header):
        i = header["i"]
        return [memoryview(pool)[20_000 * i:20_000 * i + 7_000], memoryview(pool)[20_000 * i + 7_000:20_000 * (i + 1)]] \
            if live[i] else None

    try:
        first, _ = frame(0, os.urandom(20_000))
        second, head = frame(1, b"\x07" * 20_000)
        raw.sendall(first[:-10_000])  # record 0 in two parts: still lands whole and verifies
        assert poll_until(1, []) == []
        raw.sendall(first[-10_000:] + second[:head + 3_000])  # record 1's head and 3,000 payload bytes
        got = poll_until(1, [])
        assert len(got) == 1 and got[0].verified and bytes(pool[:20_000]) == first[-20_000:]
        live[1] = False  # record 1's transfer ends while the rest of its payload is on the wire
        raw.sendall(second[head + 3_000:])
        got = poll_until(2, got)
        assert len(got) == 2 and not got[1].written
        assert pool[20_000:23_000] == b"\x07" * 3_000 and pool[23_000:] == bytes(17_000)
    finally:
        raw.close()
        receiver.close()


from hypothesis import given, strategies as st  # noqa: E402


@given(st.lists(st.integers(0, 40), max_size=30))
def test_runs_are_maximal_and_cover_the_ids(ids):
    from pdserve.kv.block_io import runs
    got = runs(ids)
    assert [b for _, first, n in got for b in range(first, first + n)] == ids
    assert [pos for pos, _, _ in got] == [sum(n for _, _, n in got[:i]) for i in range(len(got))]
    assert all(first + n != nxt for (_, first, n), (_, nxt, _) in zip(got, got[1:]))  # maximal
