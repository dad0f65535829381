"""What every transport shares: the chunk header, its checksum, the transfer states and the interfaces.

A transfer moves one request's prompt KV from a prefill worker to the decode worker that reserved blocks
for it. It is a sequence of *chunks* (one layer's KV of a run of blocks each, pushed as soon as that layer
is computed) closed by a *done* message that states how many chunks were sent. Each chunk header carries
an xxh3-64 checksum of its payload; the receiver verifies it before a byte reaches the KV pool.

Headers are plain dicts (msgpack on the wire):

    chunk: {"kind": "chunk", "xfer": str, "layer": int, "blocks": [destination block ids], "first": int
            (index of the first block in the request's block table), "nbytes": int, "checksum": int, ...}
    done:  {"kind": "done", "xfer": str, "num_chunks": int}
    fail:  {"kind": "fail", "xfer": str, "reason": str}   (the sender gave up)
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import xxhash
import zmq


class TransferState(enum.Enum):
    RESERVED = "reserved"  # the receiver holds blocks, nothing arrived yet
    IN_FLIGHT = "in_flight"  # chunks are arriving
    COMPLETED = "completed"  # every expected block of every layer arrived and verified, done received
    FAILED_CHECKSUM = "failed_checksum"
    FAILED_TIMEOUT = "failed_timeout"
    FAILED_PEER = "failed_peer"  # the sender reported a failure or died
    FAILED_INCOMPLETE = "failed_incomplete"  # done arrived but blocks are missing
    ABORTED = "aborted"  # the request ended first

    @property
    def failed(self) -> bool:
        return self.name.startswith("FAILED_")

    @property
    def ended(self) -> bool:
        return self in (TransferState.COMPLETED, TransferState.ABORTED) or self.failed


def checksum(payload) -> int:
    return xxhash.xxh3_64_intdigest(payload)


@dataclass
class Received:
    """One message taken off a transport. `payload` is valid until `release()` (shm reuses the memory)."""

    header: dict
    payload: memoryview | None
    release: Callable[[], None]

    @property
    def verified(self) -> bool:
        return self.payload is not None and checksum(self.payload) == self.header.get("checksum")


def drain(sock, timeout_ms: int, read_one: Callable[[], Received]) -> list[Received]:
    """Wait up to `timeout_ms` for the first message on a ZeroMQ socket, then take every one waiting.
    `read_one` reads one message without blocking (raising `zmq.Again` when there is none)."""
    out: list[Received] = []
    if not sock.poll(timeout_ms):
        return out
    while True:
        try:
            out.append(read_one())
        except zmq.Again:
            return out


class KVSender(Protocol):
    def send_chunk(self, dest: str, header: dict, nbytes: int, fill: Callable[[memoryview], None]) -> None:
        """Reserve `nbytes` of outgoing payload, let `fill` write it, checksum it and send it to `dest`.

        Raises `TransferError` when it cannot be sent before the sender's deadline (a full ring, a dead peer).
        """
        ...

    def send_control(self, dest: str, header: dict) -> None: ...

    def close(self) -> None: ...


class KVReceiver(Protocol):
    address: str  # what a sender passes as `dest`

    def poll(self, timeout_ms: int = 0) -> list[Received]: ...

    def close(self) -> None: ...


class TransferError(Exception):
    """A chunk could not be handed to the transport in time."""


class FaultInjector:
    """Test-only sabotage of outgoing chunks, from the environment of the sending process.

    `PDSERVE_FAULT_CORRUPT_CHUNKS=N` flips one payload byte *after* the checksum of the N-th chunk sent
    (1-based) and of every N-th after it; the receiver must reject those transfers. Off when unset.
    """

    def __init__(self, every: int | None = None) -> None:
        if every is None:
            every = int(os.environ.get("PDSERVE_FAULT_CORRUPT_CHUNKS", "0") or 0)
        self.every = every
        self.count = 0

    def maybe_corrupt(self, payload: memoryview) -> bool:
        if self.every <= 0 or len(payload) == 0:
            return False
        self.count += 1
        if self.count % self.every:
            return False
        payload[0] = payload[0] ^ 0xFF
        return True
