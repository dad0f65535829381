"""`shm` transport: payloads through a shared-memory ring per (sender, receiver) pair; headers over ZeroMQ IPC.

The sender owns one ring per destination: `[8-byte tail | data]`. It writes a chunk's payload straight into
the ring (the KV gather lands there, one copy), checksums it there, and sends a small header naming the
segment, offset and the running byte count `end`. The receiver verifies the bytes in place, copies them
into its KV pool and then publishes `end` as the ring's tail, which frees that space for the sender. Chunks
are consumed in order (one ordered header socket per pair), so a single tail counter suffices. A chunk that
does not fit before the ring's end starts again at offset 0. A full ring makes the sender wait at most
`timeout_s`, then raise `TransferError`.
"""

from __future__ import annotations

import itertools
import mmap
import os
import struct
import time
from collections.abc import Callable
from multiprocessing import shared_memory

import msgpack
import zmq

from pdserve.transfer.base import FaultInjector, Received, TransferError, checksum, drain

_META = 64  # bytes before the data: the tail counter, alone on its cache line
_names = itertools.count()


class _Ring:
    def __init__(self, size: int) -> None:
        self.size = size
        self.shm = shared_memory.SharedMemory(create=True, size=size + _META,
                                              name=f"pdserve-{os.getpid()}-{next(_names)}")
        struct.pack_into("<Q", self.shm.buf, 0, 0)
        self.head = 0

    def tail(self) -> int:
        return struct.unpack_from("<Q", self.shm.buf, 0)[0]

    def reserve(self, nbytes: int, deadline: float) -> tuple[int, int]:
        """Room for `nbytes` contiguous bytes: (offset in data, running end counter after them)."""
        if nbytes > self.size:
            raise TransferError(f"chunk of {nbytes} bytes exceeds the shm ring ({self.size} bytes)")
        start = self.head
        if start % self.size + nbytes > self.size:  # does not fit before the end: wrap to offset 0
            start += self.size - start % self.size
        while start + nbytes - self.tail() > self.size:
            if time.monotonic() > deadline:
                raise TransferError("shm ring full: the receiver did not consume in time")
            time.sleep(0.0002)
        self.head = start + nbytes
        return start % self.size, self.head

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self.shm.buf[_META + offset:_META + offset + nbytes]

    def close(self) -> None:
        try:
            self.shm.close()
            self.shm.unlink()
        except (BufferError, FileNotFoundError):
            pass


class ShmSender:
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

    def _peer(self, dest: str) -> tuple[zmq.Socket, _Ring]:
        peer = self._peers.get(dest)
        if peer is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, int(self._timeout_s * 1000))
            sock.connect(dest)
            peer = self._peers[dest] = (sock, _Ring(self._ring_bytes))
        return peer

    def send_chunk(self, dest: str, header: dict, nbytes: int, fill: Callable[[memoryview], None]) -> None:
        sock, ring = self._peer(dest)
        offset, end = ring.reserve(nbytes, time.monotonic() + self._timeout_s)
        view = ring.view(offset, nbytes)
        fill(view)
        header = dict(header, nbytes=nbytes, checksum=checksum(view), shm=ring.shm.name, offset=offset, end=end)
        self.faults.maybe_corrupt(view)
        del view
        self._send(sock, header, dest)
        self.bytes_sent += nbytes

    def send_control(self, dest: str, header: dict) -> None:
        self._send(self._peer(dest)[0], header, dest)

    @staticmethod
    def _send(sock: zmq.Socket, header: dict, dest: str) -> None:
        try:
            sock.send(msgpack.packb(header))
        except zmq.Again as e:
            raise TransferError(f"shm header to {dest} timed out") from e

    def close(self) -> None:
        for sock, ring in self._peers.values():
            sock.close(linger=0)
            ring.close()
        self._peers.clear()


class ShmReceiver:
    def __init__(self, address: str, ctx: zmq.Context | None = None) -> None:
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self.address = address
        self.socket = self._sock
        self._segments: dict[str, mmap.mmap] = {}

    def _segment(self, name: str) -> mmap.mmap:
        seg = self._segments.get(name)
        if seg is None:
            # Mapped directly (not through SharedMemory), so this process's resource tracker never learns of
            # it and never unlinks the sender's segment; the sender owns it.
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
            try:
                seg = self._segments[name] = mmap.mmap(fd, 0)
            finally:
                os.close(fd)
        return seg

    def poll(self, timeout_ms: int = 0) -> list[Received]:
        return drain(self._sock, timeout_ms, lambda: self._received(msgpack.unpackb(self._sock.recv(zmq.NOBLOCK))))

    def _received(self, header: dict) -> Received:
        if "shm" not in header:
            return Received(header, None, lambda: None)
        try:
            seg = self._segment(header["shm"])
        except FileNotFoundError:  # the sender is gone and its segment with it
            return Received(dict(header, lost=True), None, lambda: None)
        start = _META + header["offset"]
        payload = memoryview(seg)[start:start + header["nbytes"]]

        def release(seg=seg, end=header["end"]) -> None:
            struct.pack_into("<Q", seg, 0, end)

        return Received(header, payload, release)

    def close(self) -> None:
        self._sock.close(linger=0)
        for seg in self._segments.values():
            try:
                seg.close()
            except BufferError:
                pass
        self._segments.clear()
