"""KV records in transit on the tcp path (issue 40 items 1-2): a real sender and receiver, real sockets, and a
relay between them (a small TCP proxy in this process) that captures the stream and tampers with it: flips a
byte, replays a record, or rewrites a record's protection. Across hosts is forced on loopback with the test-only
`PDSERVE_KV_CROSS_HOST=always` (`pdserve.transfer.kv_seal`)."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from pdserve.core.pd.sensitivity import acceptable, protection, resolve
from pdserve.errors import InvalidRequestError
from pdserve.transfer.kv_seal import CROSS_HOST_ENV, TAG, crosses_hosts, protection_report
from pdserve.transfer.peer_auth import HELLO, REPLY, hello
from pdserve.transfer.base import TransferError
from pdserve.transfer.tcp import PREFIX, TcpReceiver, TcpSender, parse_address


def test_protection_by_label_and_path():
    assert [protection(label, False) for label in ("public", "internal", "secret")] == ["plain", "plain", "aead"]
    assert [protection(label, True) for label in ("public", "internal", "secret")] == ["mac", "aead", "aead"]
    assert protection(None, True) == "mac" and protection(None, False) == "plain"  # control records
    assert protection("bogus", False) == "aead"  # an unknown label is held as secret
    assert not acceptable("plain", "public", True) and acceptable("aead", "public", True)
    assert not acceptable("mac", "secret", False) and acceptable("plain", "internal", False)
    assert resolve(None, None, "internal") == "internal" and resolve(None, "secret", "internal") == "secret"
    assert resolve("public", "secret", "internal") == "public"
    with pytest.raises(InvalidRequestError) as e:
        resolve("top-secret", None, "internal")
    assert e.value.param == "kv_sensitivity"


def test_crossing_hosts_is_the_peer_address(monkeypatch):
    monkeypatch.delenv(CROSS_HOST_ENV, raising=False)
    assert not crosses_hosts("127.0.0.1") and not crosses_hosts("127.3.0.9") and not crosses_hosts("::1")
    assert not crosses_hosts("::ffff:127.0.0.1")
    assert crosses_hosts("10.0.0.2") and crosses_hosts("fe80::1%eth0") and crosses_hosts("not-an-address")
    monkeypatch.setenv(CROSS_HOST_ENV, "always")
    assert crosses_hosts("127.0.0.1")


class Relay:
    """sender -> relay -> receiver. The sender's stream is parsed into its hello and records; `edit(i, record)`
    returns what to forward for record i (a list: [] drops it, two copies replay it). Everything forwarded
    is captured."""

    def __init__(self, target, edit=lambda i, record: [record]) -> None:
        self.target, self.edit = target, edit  # (target: an address, or a callable that names it when asked)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.captured = bytearray()
        self.records: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(parse_address(self.target() if callable(self.target) else self.target))
            threading.Thread(target=self._pipe, args=(up, down), daemon=True).start()  # the reply, as is
            threading.Thread(target=self._forward, args=(down, up), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        _close(src, dst)  # one end closed: so is the other (as a receiver's close reaches a real sender)

    def _forward(self, src: socket.socket, dst: socket.socket) -> None:
        buf = bytearray()
        try:
            dst.sendall(_take(src, buf, HELLO.size))
            while True:
                head = _take(src, buf, PREFIX.size)
                meta_len, nbytes, _, mode = PREFIX.unpack(head)
                record = head + _take(src, buf, meta_len + nbytes + (TAG if mode else 0))
                self.records.append(record)
                for out in self.edit(len(self.records) - 1, record):
                    self.captured += out
                    dst.sendall(out)
        except (OSError, EOFError):
            _close(src, dst)

    def close(self) -> None:
        self.listener.close()


def _close(*socks: socket.socket) -> None:
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


def _take(sock: socket.socket, buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        data = sock.recv(1 << 16)
        if not data:
            raise EOFError
        buf += data
    out = bytes(buf[:n])
    del buf[:n]
    return out


def _flip(record: bytes, at: int) -> bytes:
    out = bytearray(record)
    out[at] ^= 0x01
    return bytes(out)


@pytest.fixture
def link():
    receiver, sender, relays = TcpReceiver(), TcpSender(timeout_s=5.0), []

    def through(edit=lambda i, record: [record]) -> Relay:
        relays.append(Relay(receiver.address, edit))
        return relays[-1]
    yield sender, receiver, through
    sender.close()
    receiver.close()
    for relay in relays:
        relay.close()


def _chunk(i: int, label: str | None = None) -> dict:
    header = {"kind": "chunk", "xfer": f"x{i}", "layer": 0, "first": 0, "count": 1}
    return header if label is None else {**header, "label": label}


def _exchange(sender, receiver, dest: str, records: list[tuple[dict, bytes | None]], expect: int,
              wait_s: float = 10.0):
    """Send `records` (chunk header and payload, or a control header and None) while the receiver polls in a
    thread (the sender waits for the hello's reply before its first protected record); -> what arrived."""
    got, stop = [], threading.Event()

    def poll():
        deadline = time.monotonic() + wait_s
        while len(got) < expect and time.monotonic() < deadline and not stop.is_set():
            got.extend(receiver.poll(10))
    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        for header, payload in records:
            if payload is None:
                sender.send_control(dest, header)
            else:
                sender.send_chunk(dest, header, [memoryview(payload)[:1000], memoryview(payload)[1000:]])
    except BaseException:
        stop.set()
        raise
    finally:
        thread.join(wait_s + 5)
    return got


PAYLOAD = os.urandom(200_000)


@pytest.mark.parametrize("label,cross,mode", [("public", False, "plain"), ("public", True, "mac"),
                                              ("internal", False, "plain"), ("internal", True, "aead"),
                                              ("secret", False, "aead"), ("secret", True, "aead")])
def test_each_label_arrives_intact_in_its_mode(link, monkeypatch, label, cross, mode):
    if cross:
        monkeypatch.setenv(CROSS_HOST_ENV, "always")
    sender, receiver, through = link
    relay = through()
    got = _exchange(sender, receiver, relay.address, [(_chunk(0, label), PAYLOAD),
                                                      ({"kind": "done", "xfer": "x0"}, None)], 2)
    assert got[0].payload == PAYLOAD and got[0].verified and got[1].header == {"kind": "done", "xfer": "x0"}
    assert protection_report(sender)[0] == {f"tcp:{m}": PAYLOAD.__len__() if m == mode else 0
                                            for m in ("plain", "mac", "aead")}
    assert receiver.auth_failures == 0
    # encrypted: no 32-byte piece of the payload is on the wire; otherwise all of it is
    windows = [PAYLOAD[i:i + 32] for i in range(0, len(PAYLOAD), 4096)]
    on_wire = [w for w in windows if w in relay.captured]
    assert (on_wire == []) if mode == "aead" else (on_wire == windows)


@pytest.mark.parametrize("label,where", [("public", "payload"), ("internal", "payload"), ("internal", "meta"),
                                         ("internal", "tag"), ("public", "prefix")])
def test_a_record_changed_on_the_wire_is_refused_and_the_next_transfer_delivered(link, monkeypatch, label,
                                                                                 where):
    monkeypatch.setenv(CROSS_HOST_ENV, "always")
    sender, receiver, through = link

    def edit(i, record):
        if i != 0:
            return [record]
        meta_len = PREFIX.unpack_from(record)[0]
        at = {"payload": PREFIX.size + meta_len + 5000, "meta": PREFIX.size + meta_len - 1,
              "tag": len(record) - 1, "prefix": 8}[where]  # (prefix: the xxh3 field, unused by mac)
        return [_flip(record, at)]
    relay = through(edit)
    got = _exchange(sender, receiver, relay.address, [(_chunk(0, label), PAYLOAD)], 1)
    assert len(got) == 1 and not got[0].verified and receiver.auth_failures == 1
    assert got[0].header.get("xfer") in ("x0", None) or where == "meta"
    # the connection goes on: the next transfer's record behind it is delivered
    later = []
    for attempt in range(20):
        try:
            later = _exchange(sender, receiver, relay.address, [(_chunk(1 + attempt, label), PAYLOAD)], 1, 0.5)
        except TransferError:
            continue
        if later:
            break
    assert later and later[0].payload == PAYLOAD and later[0].verified and receiver.auth_failures == 1


@pytest.mark.parametrize("label", ["public", "internal", "secret"])
def test_a_replayed_or_reordered_record_is_refused(link, monkeypatch, label):
    monkeypatch.setenv(CROSS_HOST_ENV, "always")
    sender, receiver, through = link
    held = []

    def replay(i, record):
        return [record, record] if i == 0 else [record]
    relay = through(replay)
    got = _exchange(sender, receiver, relay.address, [(_chunk(0, label), PAYLOAD), (_chunk(1, label), PAYLOAD)], 3)
    assert [(m.header["xfer"], m.verified) for m in got] == [("x0", True), ("x0", False), ("x1", True)]
    assert receiver.auth_failures == 1  # the copy refused; the connection goes on (x1 after it counts)

    def swap(i, record):  # records 0 and 1 of the next connection, in the other order
        if i == 0:
            held.append(record)
            return []
        return [record, *held] if i == 1 else [record]
    relay2 = through(swap)
    got = _exchange(sender, receiver, relay2.address, [(_chunk(2, label), PAYLOAD), (_chunk(3, label), PAYLOAD),
                                                       (_chunk(4, label), PAYLOAD)], 3)
    assert [(m.header["xfer"], m.verified) for m in got] == [("x3", True), ("x2", False), ("x4", True)]
    assert receiver.auth_failures == 2  # (the later one first: taken; the earlier one after it: refused)


def test_a_downgraded_or_foreign_record_is_refused(link, monkeypatch):
    """A peer that passed the hello but sends a plain record where its label asks for more, or seals its
    records under another key (it does not hold this connection's nonces), is refused."""
    monkeypatch.setenv(CROSS_HOST_ENV, "always")
    sender, receiver, through = link

    def downgrade(i, record):  # a public record across hosts: mac -> claims plain (tag dropped)
        meta_len, nbytes, _, _ = PREFIX.unpack_from(record)
        import xxhash
        body = record[PREFIX.size + meta_len:PREFIX.size + meta_len + nbytes]
        head = PREFIX.pack(meta_len, nbytes, xxhash.xxh3_64_intdigest(body), 0)
        return [head + record[PREFIX.size:PREFIX.size + meta_len] + body]
    relay = through(downgrade)
    got = _exchange(sender, receiver, relay.address, [(_chunk(0, "public"), PAYLOAD)], 1)
    assert not got[0].verified and receiver.auth_failures == 1

    # a record sealed under a key of another connection (replayed from relay's capture into a fresh one)
    foreign = socket.create_connection(parse_address(receiver.address))
    foreign.sendall(hello())
    got = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not got:
        got += receiver.poll(10)
        try:
            foreign.setblocking(False)
            if len(foreign.recv(REPLY.size, socket.MSG_PEEK)) == REPLY.size and not got:
                foreign.sendall(relay.records[0])
                foreign.setblocking(True)
                relay.records.clear()
        except (BlockingIOError, IndexError):
            pass
    assert got and not got[0].verified and receiver.auth_failures == 2
    foreign.close()


def test_a_receiver_that_does_not_answer_the_hello_fails_the_sender_in_bounded_time(monkeypatch):
    monkeypatch.setenv(CROSS_HOST_ENV, "always")
    mute = socket.create_server(("127.0.0.1", 0))  # accepts, never replies
    sender = TcpSender(timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(Exception, match="tcp send"):
        sender.send_chunk(f"tcp://127.0.0.1:{mute.getsockname()[1]}", _chunk(0, "secret"), [memoryview(PAYLOAD)])
    assert time.monotonic() - started < 2.0
    sender.close()
    mute.close()


def test_prefix_layout():
    assert PREFIX.size == struct.calcsize("<IIQB")
