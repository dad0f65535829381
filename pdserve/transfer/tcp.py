"""`tcp` transport: ZeroMQ PUSH/PULL over TCP, header and payload as one two-frame message. Works across hosts.

ZeroMQ's I/O thread does the socket writes, so a prefill worker's compute goes on while a layer's KV is on
the wire. A receiver that stops reading makes the sender's queue fill; a send then waits at most
`timeout_s` and raises `TransferError` instead of hanging.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import msgpack
import zmq

from pdserve.transfer.base import FaultInjector, Received, TransferError, checksum, drain


def _noop() -> None:
    pass


class TcpSender:
    def __init__(self, timeout_s: float = 10.0, ctx: zmq.Context | None = None,
                 faults: FaultInjector | None = None) -> None:
        self._ctx = ctx or zmq.Context.instance()
        self._timeout_ms = int(timeout_s * 1000)
        self._sockets: dict[str, zmq.Socket] = {}
        self.faults = faults or FaultInjector()
        self.bytes_sent = 0
        self.max_chunk_bytes = 4 << 20  # callers split larger payloads, so chunks pipeline on the wire
        # Payload buffers are reused once ZeroMQ is done with them (fresh multi-MB buffers cost page faults).
        self._free: list[bytearray] = []
        self._in_flight: deque[tuple[bytearray, zmq.MessageTracker]] = deque()

    def _buffer(self, nbytes: int) -> bytearray:
        while self._in_flight and self._in_flight[0][1].done:
            self._free.append(self._in_flight.popleft()[0])
        for i, buf in enumerate(self._free):
            if len(buf) >= nbytes:
                return self._free.pop(i)
        if len(self._free) > 8:
            self._free.pop(0)
        return bytearray(nbytes)

    def _socket(self, dest: str) -> zmq.Socket:
        sock = self._sockets.get(dest)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 256)
            sock.connect(dest)
            self._sockets[dest] = sock
        return sock

    def send_chunk(self, dest: str, header: dict, nbytes: int, fill: Callable[[memoryview], None]) -> None:
        buf = self._buffer(nbytes)
        view = memoryview(buf)[:nbytes]
        fill(view)
        header = dict(header, nbytes=nbytes, checksum=checksum(view))
        self.faults.maybe_corrupt(view)
        sock = self._socket(dest)
        try:
            sock.send(msgpack.packb(header), zmq.SNDMORE)
            tracker = sock.send(view, copy=False, track=True)
        except zmq.Again as e:
            raise TransferError(f"tcp send to {dest} timed out ({self._timeout_ms} ms)") from e
        self._in_flight.append((buf, tracker))
        self.bytes_sent += nbytes

    def send_control(self, dest: str, header: dict) -> None:
        self._send([msgpack.packb(header)], dest)

    def _send(self, frames: list, dest: str) -> None:
        try:
            self._socket(dest).send_multipart(frames)
        except zmq.Again as e:
            raise TransferError(f"tcp send to {dest} timed out ({self._timeout_ms} ms)") from e

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()


class TcpReceiver:
    def __init__(self, host: str = "127.0.0.1", ctx: zmq.Context | None = None) -> None:
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.socket = self._sock  # for a caller's zmq.Poller

    def poll(self, timeout_ms: int = 0) -> list[Received]:
        return drain(self._sock, timeout_ms, self._read_one)

    def _read_one(self) -> Received:
        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
        payload = frames[1].buffer if len(frames) > 1 else None
        return Received(msgpack.unpackb(frames[0].bytes), payload, _noop)

    def close(self) -> None:
        self._sock.close(linger=0)
