"""`shm` transport: records through a shared-memory ring per (sender, receiver) pair, polled by the receiver.

Chunks go by reference when they can: a prefill worker's KV pool lives in shared memory (`DeviceKVPool(
shared=True)`, registered with `share_source`), so a chunk record carries only where its blocks are in that
pool and their checksum; the receiver copies them from there into its reserved blocks — the one copy of the
delivery — and verifies the checksum over what it wrote. The sender keeps those blocks unchanged until the
receiver has taken the record (`consumed`); if the sender reused them anyway (a lease ran out), the copy
fails its checksum and is rejected, never consumed. Payloads from anywhere else are copied into the ring.

The sender owns one ring per destination and announces it once over ZeroMQ IPC. Ring layout:
`[tail u64 | waiting u64 | pad | head u64 | pad | data]`: the receiver owns `tail`, the sender owns `head`,
both running byte counts. A record (`base.PREFIX`, meta, payload, each part 64-byte aligned) is written at `head`, the
payload copied straight from the sender's KV pool and checksummed there while in cache; then `head` moves
past it, which publishes it. A record that does not fit before the ring's end is preceded by a wrap marker
and starts again at offset 0. The receiver copies each payload into the place its caller names, verifies
the checksum over the copy and moves `tail`, which frees the space at once. There is no message per chunk:
the receiver reads the rings when it looks (a u64 each); only a receiver about to sleep sets `waiting`, and
a sender that sees it set rings a ZeroMQ doorbell once (`wakeup`, for the caller's poller). A doorbell lost
to a race costs at most the caller's poll timeout. A full ring makes the sender wait at
most `timeout_s`, then raise `TransferError`.

Ordering relies on the host's stores becoming visible in program order (x86-TSO); on weaker memory models a
torn record fails its checksum, so it is rejected, never consumed.
"""

from __future__ import annotations

import itertools
import mmap
import os
import struct
import time
from multiprocessing import shared_memory

import msgpack
import numpy as np
import zmq

from pdserve.paging import Populating
from pdserve.transfer.base import (PREFIX, Capabilities, FaultInjector, Place, Received, TransferError, checksum,
                                   copy_into, decode_record, encode_meta, scratch_place)
from pdserve.transfer.zmq_auth import Refusals, secure_client, secure_server

_META = 128  # tail and waiting at 0 and 8 (the receiver's line), head at 64 (the sender's line)
_WRAP = 0xFFFFFFFF  # a prefix with this meta length: the rest of the lap is unused
_U64 = struct.Struct("<Q")
_names = itertools.count()


def _align(n: int) -> int:
    return (n + 63) & ~63


class _Ring:
    def __init__(self, size: int) -> None:
        self.size = _align(size)
        self.shm = shared_memory.SharedMemory(create=True, size=self.size + _META,
                                              name=f"pdserve-{os.getpid()}-{next(_names)}")
        self.buf = self.shm.buf
        for off in (0, 8, 64):
            _U64.pack_into(self.buf, off, 0)
        self.head = 0

    def reserve(self, nbytes: int, deadline: float) -> int:
        """Wait for room for a record of `nbytes` (aligned); write a wrap marker if needed. Its data offset."""
        if nbytes > self.size:
            raise TransferError(f"chunk of {nbytes} bytes exceeds the shm ring ({self.size} bytes)")
        pos = self.head % self.size
        skip = self.size - pos if pos + nbytes > self.size else 0
        while self.head + skip + nbytes - _U64.unpack_from(self.buf, 0)[0] > self.size:
            if time.monotonic() > deadline:
                raise TransferError("shm ring full: the receiver did not consume in time")
            time.sleep(0.0002)
        if skip:
            PREFIX.pack_into(self.buf, _META + pos, _WRAP, 0, 0)
            self.head += skip
        return self.head % self.size

    def publish(self, nbytes: int) -> bool:
        """Make the record visible; True if the receiver was waiting (the caller rings the doorbell)."""
        self.head += nbytes
        _U64.pack_into(self.buf, 64, self.head)
        if _U64.unpack_from(self.buf, 8)[0]:
            _U64.pack_into(self.buf, 8, 0)
            return True
        return False

    def close(self) -> None:
        self.buf = None
        try:
            self.shm.close()
            self.shm.unlink()
        except (BufferError, FileNotFoundError):
            pass


class ShmSender:
    capabilities = Capabilities(zero_copy=True, cross_host=False)

    def __init__(self, ring_bytes: int = 16 << 20, timeout_s: float = 10.0, ctx: zmq.Context | None = None,
                 faults: FaultInjector | None = None) -> None:
        self._ctx = ctx or zmq.Context.instance()
        self._ring_bytes = ring_bytes
        # Callers split payloads to at most this, so several chunks are in the ring at once. A small ring
        # is faster than a large one: it is reused while still in cache (measured: 16 MiB ~2x 64 MiB).
        self.max_chunk_bytes = ring_bytes // 4
        self._timeout_s = timeout_s
        self._peers: dict[str, tuple[zmq.Socket, _Ring]] = {}
        self.faults = faults or FaultInjector()
        self.bytes_sent = 0
        self.chunks_by_reference = 0
        self.chunks_copied = 0  # payloads outside the shared pool (tests, tools): copied into the ring
        self._source: tuple[str, int, int] | None = None  # (handle, base address, size)

    def share_source(self, handle: str, buffer) -> None:
        """Chunks whose pieces lie in `buffer` (a shared KV pool others open at `handle`) go by reference."""
        arr = np.frombuffer(buffer, dtype=np.uint8)
        self._source = (handle, arr.ctypes.data, arr.nbytes)

    def _spans(self, pieces: list[memoryview]) -> list[list[int]] | None:
        """[[offset, length]] of each piece in the shared source, or None if one lies outside it."""
        if self._source is None:
            return None
        _, base, size = self._source
        spans = []
        for piece in pieces:
            off = np.frombuffer(piece, dtype=np.uint8).ctypes.data - base if len(piece) else 0
            if not 0 <= off <= size - len(piece):
                return None
            spans.append([off, len(piece)])
        return spans

    def position(self, dest: str) -> int:
        return self._ring(dest).head

    def consumed(self, dest: str, mark: int) -> bool:
        ring = self._ring(dest)
        return _U64.unpack_from(ring.buf, 0)[0] >= mark

    def _ring(self, dest: str) -> _Ring:
        peer = self._peers.get(dest)
        if peer is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, int(self._timeout_s * 1000))
            secure_client(sock)
            sock.connect(dest)
            ring = _Ring(self._ring_bytes)
            try:
                sock.send(msgpack.packb({"ring": ring.shm.name}))
            except zmq.Again as e:
                ring.close()
                sock.close(linger=0)
                raise TransferError(f"shm receiver {dest} did not take the ring announcement") from e
            peer = self._peers[dest] = (sock, ring)
        return peer[1]

    def send_chunk(self, dest: str, header: dict, pieces: list[memoryview]) -> bool:
        nbytes = sum(len(p) for p in pieces)
        spans = self._spans(pieces)
        if spans is not None:
            digest = checksum(pieces) ^ self.faults.hit()  # a fault: a checksum the bytes cannot match
            self._write(dest, dict(header, ref=self._source[0], src=spans), [], 0, digest)
            self.chunks_by_reference += 1
        else:
            self._write(dest, header, pieces, nbytes)
            self.chunks_copied += 1
        self.bytes_sent += nbytes
        return spans is not None

    def send_control(self, dest: str, header: dict) -> None:
        self._write(dest, header, [], 0)

    def _write(self, dest: str, header: dict, pieces: list[memoryview], nbytes: int, digest: int = 0) -> None:
        ring = self._ring(dest)
        meta = encode_meta(header)
        head_bytes = _align(PREFIX.size + len(meta))
        total = head_bytes + _align(nbytes)
        pos = _META + ring.reserve(total, time.monotonic() + self._timeout_s)
        buf = ring.buf
        buf[pos + PREFIX.size:pos + PREFIX.size + len(meta)] = meta
        if nbytes:
            payload = buf[pos + head_bytes:pos + head_bytes + nbytes]
            digest = copy_into([payload], pieces)  # hashed as written, while in cache
            if self.faults.hit():
                payload[0] ^= 0xFF
            del payload
        PREFIX.pack_into(buf, pos, len(meta), nbytes, digest)
        if ring.publish(total):
            try:
                self._peers[dest][0].send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the receiver's poll timeout covers a lost doorbell

    def forget(self, dest: str) -> None:
        """`dest` died (or restarted): drop its ring and socket; a later send to it starts afresh."""
        peer = self._peers.pop(dest, None)
        if peer is not None:
            peer[0].close(linger=0)
            peer[1].close()

    def close(self) -> None:
        for sock, ring in self._peers.values():
            try:
                sock.send(msgpack.packb({"closed": ring.shm.name}), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            sock.close(linger=100)
            ring.close()
        self._peers.clear()


class _InRing:
    """The receiver's end of one sender's ring."""

    def __init__(self, name: str, sources: "_Sources") -> None:
        self.sources = sources
        # Mapped directly (not through SharedMemory), so this process's resource tracker never learns of
        # it and never unlinks the sender's segment; the sender owns it.
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self.name = name
        self.buf = memoryview(self.map)
        self.size = len(self.map) - _META
        self.tail = _U64.unpack_from(self.buf, 0)[0]
        self.closing = False

    def read(self, place: Place) -> list[Received]:
        out = []
        head = _U64.unpack_from(self.buf, 64)[0]
        while self.tail < head:
            pos = self.tail % self.size
            meta_len, nbytes, digest = PREFIX.unpack_from(self.buf, _META + pos)
            if meta_len == _WRAP:
                self.tail += self.size - pos
                continue
            head_bytes = _align(PREFIX.size + meta_len)
            if head_bytes + nbytes > self.size - pos:
                raise ValueError(f"malformed record in {self.name}")
            start = _META + pos
            header = decode_record(bytes(self.buf[start + PREFIX.size:start + PREFIX.size + meta_len]), nbytes, digest)
            if "src" in header:
                out.append(self._take_reference(header, digest, place))
            else:
                out.append(_take(header, [self.buf[start + head_bytes:start + head_bytes + nbytes]], place))
            self.tail += head_bytes + _align(nbytes)
            _U64.pack_into(self.buf, 0, self.tail)  # the sender may reuse the space now
        return out

    def _take_reference(self, header: dict, digest: int, place: Place) -> Received:
        spans = header.pop("src")
        header.update(nbytes=sum(n for _, n in spans), checksum=digest)
        source = self.sources.get(header.pop("ref"))
        if source is None or any(off < 0 or off + n > len(source) for off, n in spans):
            return Received(header)  # the sender's pool is gone (or the record is wrong): not placed
        return _take(header, [source[off:off + n] for off, n in spans], place)

    @property
    def drained(self) -> bool:
        return self.tail >= _U64.unpack_from(self.buf, 64)[0]

    def set_waiting(self, waiting: bool) -> None:
        _U64.pack_into(self.buf, 8, int(waiting))

    def close(self) -> None:
        self.buf.release()
        self.map.close()


def _take(header: dict, sources: list[memoryview], place: Place) -> Received:
    if not header.get("nbytes"):
        return Received(header)
    views = place(header)
    if views is None:
        return Received(header)
    return Received(header, views, copy_into(views, sources) == header["checksum"])


class _Sources:
    """Senders' shared KV pools, mapped read-only on first use."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[mmap.mmap, memoryview]] = {}

    def get(self, handle: str) -> memoryview | None:
        entry = self._maps.get(handle)
        if entry is None:
            try:
                fd = os.open(handle, os.O_RDONLY)
            except OSError:  # the sender is gone
                return None
            try:
                m = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            # made resident in the background, off the GIL (`pdserve.paging`): the first reads may fault
            Populating(m, write=False, name="kv-source-populate")  # (a daemon thread; the prefill side counts failures)
            entry = self._maps[handle] = (m, memoryview(m))
        return entry[1]

    def close(self) -> None:
        for m, view in self._maps.values():
            view.release()
            m.close()
        self._maps.clear()


class ShmReceiver:
    def __init__(self, address: str, ctx: zmq.Context | None = None) -> None:
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)  # ring announcements only
        self._sock.setsockopt(zmq.LINGER, 0)
        secure_server(self._sock)  # this deployment's senders only (`pdserve.transfer.zmq_auth`)
        self._sock.bind(address)
        self._refusals = Refusals(self._sock)
        self.address = address
        self._rings: dict[str, _InRing] = {}
        self._sources = _Sources()
        self.num_bad_records = 0

    @property
    def wakeup(self) -> zmq.Socket:
        """Readable when a ring was announced or a sender rang after `arm()`: for the caller's poller."""
        return self._sock

    def arm(self) -> bool:
        """Ask senders to ring `wakeup` on their next record; False if a record is already waiting."""
        for ring in self._rings.values():
            ring.set_waiting(True)
        return all(ring.drained for ring in self._rings.values())

    def poll(self, timeout_ms: int = 0, place: Place = scratch_place) -> list[Received]:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            self._announcements()
            out = []
            for ring in list(self._rings.values()):
                out += self._read(ring, place)
            remaining = deadline - time.monotonic()
            if out or remaining <= 0:
                return out
            if self.arm():  # a doorbell lost to the arm/publish race costs at most 5 ms
                self._sock.poll(min(remaining * 1000, 5))

    def _read(self, ring: _InRing, place: Place) -> list[Received]:
        try:
            out = ring.read(place)
        except (ValueError, msgpack.UnpackException) as e:  # a broken ring: nothing more from it is trusted
            self.num_bad_records += 1
            self._drop(ring)
            return [Received({"kind": "bad", "reason": str(e)})]
        if ring.closing and ring.drained:
            self._drop(ring)
        return out

    def _announcements(self) -> None:
        while True:
            try:
                raw = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not raw:  # a doorbell: the rings are read next
                continue
            msg = msgpack.unpackb(raw)
            if "ring" in msg:
                try:
                    self._rings[msg["ring"]] = _InRing(msg["ring"], self._sources)
                except FileNotFoundError:  # the sender is already gone
                    pass
            elif msg.get("closed") in self._rings:
                self._rings[msg["closed"]].closing = True

    def _drop(self, ring: _InRing) -> None:
        self._rings.pop(ring.name, None)
        ring.close()

    @property
    def rejected_connections(self) -> dict[str, int]:
        """Connection attempts refused (not of this deployment), by endpoint."""
        return {"kv_shm": self._refusals.count()}

    def close(self) -> None:
        self._refusals.close()
        self._sock.close(linger=0)
        for ring in list(self._rings.values()):
            self._drop(ring)
        self._sources.close()
