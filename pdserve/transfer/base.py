"""What every transport shares: the record format, its checksum, the transfer states and the interfaces.

A transfer moves one request's prompt KV from a prefill worker to the decode worker that reserved blocks
for it. It is a sequence of *chunks* (one layer's KV of a run of blocks each, sent as soon as that layer is
computed) closed by a *done* message that states how many chunks were sent.

On the wire (the shm ring and the tcp stream alike) every message is one *record*:

    prefix  <IIQ: meta length, payload length, xxh3-64 of the payload> (tcp: <IIQB, + its protection mode,
            and a protected record's counter in place of the xxh3: `pdserve.transfer.kv_seal`)
    meta    msgpack dict
    payload the chunk bytes (none for control messages)

The sender sends the payload straight from its KV pool (`block_pieces`); the receiver asks its `place`
callback where a chunk's bytes go (views into the reserved blocks, or None to drop them), writes them there
and verifies the checksum over what it wrote before the chunk counts. Meta dicts:

    chunk: {"kind": "chunk", "xfer": str, "layer": int, "first": int (block-table index of the first block),
            "count": int}                 (the receiver adds "nbytes" and "checksum" from the prefix)
    done:  {"kind": "done", "xfer": str, "num_chunks": int, "first_token": int (what the prefill sampled),
           "logprobs": {"lp": entry, "plp": [entry | None, ...]} | None (when the request asked)}
    fail:  {"kind": "fail", "xfer": str, "reason": str}   (the sender gave up)
    alive: {"kind": "alive", "xfer": str}   (the sender holds the transfer, queued or producing: the
                                             receiver's lease starts over; sent at least every third of it)
"""

from __future__ import annotations

import enum
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgpack
import xxhash


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


PREFIX = struct.Struct("<IIQ")
_STEP = 256 << 10  # copy-then-hash granule: hashed while it is still in the core's L2

Place = Callable[[dict], "list[memoryview] | None"]


def checksum(pieces: Sequence) -> int:
    """xxh3-64 of the concatenated pieces (the same value as one call over the joined bytes)."""
    if len(pieces) == 1:
        return xxhash.xxh3_64_intdigest(pieces[0])
    h = xxhash.xxh3_64()
    for piece in pieces:
        h.update(piece)
    return h.intdigest()


def encode_meta(header: dict) -> bytes:
    return msgpack.packb(header)


def decode_record(meta: bytes, nbytes: int, digest: int) -> dict:
    header = msgpack.unpackb(meta)
    if not isinstance(header, dict):
        raise ValueError("record meta is not a map")
    if nbytes:
        header.update(nbytes=nbytes, checksum=digest)
    return header


def scratch_place(header: dict) -> list[memoryview]:
    """A `place` for callers without a pool (tests, tools): a fresh buffer per chunk."""
    return [memoryview(bytearray(header["nbytes"]))]


@dataclass
class Received:
    """One message taken off a transport. For a chunk, `views` are where its payload was written (None when
    `place` declined it) and `verified` says the checksum over them matched."""

    header: dict
    views: list[memoryview] | None = None
    verified: bool = False

    @property
    def written(self) -> bool:
        return self.views is not None

    @property
    def payload(self) -> bytes | None:
        return None if self.views is None else b"".join(bytes(v) for v in self.views)


def copy_into(views: list[memoryview], sources: list[memoryview]) -> int:
    """Copy the concatenation of `sources` over the concatenation of `views` (equal lengths); returns the
    xxh3-64 of the bytes written, read back from each destination piece right after it was written (while
    it is in cache), i.e. `checksum(views)`."""
    if sum(len(v) for v in views) != sum(len(s) for s in sources):
        raise ValueError(f"placement holds {sum(len(v) for v in views)} bytes, the chunk has "
                         f"{sum(len(s) for s in sources)}")
    digest = xxhash.xxh3_64()
    i = j = si = sj = 0  # view i at offset si, source j at offset sj
    while i < len(views) and j < len(sources):
        n = min(len(views[i]) - si, len(sources[j]) - sj, _STEP)
        out = views[i][si:si + n]
        out[:] = sources[j][sj:sj + n]
        digest.update(out)
        si, sj = si + n, sj + n
        if si == len(views[i]):
            i, si = i + 1, 0
        if sj == len(sources[j]):
            j, sj = j + 1, 0
    return digest.intdigest()


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do, declared by its sender class (`capabilities`), read instead of probing."""

    zero_copy: bool  # given the KV pool's shared memory (`share_source`), sends chunks in it by reference
    cross_host: bool  # reaches a receiver on another host

    @staticmethod
    def of_any(every: list[Capabilities]) -> Capabilities:
        """What a sender over several transports can do: what any of them can."""
        return Capabilities(any(c.zero_copy for c in every), any(c.cross_host for c in every))


class KVSender(Protocol):
    capabilities: Capabilities
    max_chunk_bytes: int  # callers split payloads to at most this (shm: a quarter of its ring)

    def send_chunk(self, dest: str, header: dict, pieces: list[memoryview]) -> bool:
        """Send a chunk whose payload is the concatenation of `pieces` (views into the KV pool): checksum
        it and hand it to the transport. Raises `TransferError` when it cannot be sent before the sender's
        deadline (a full ring, a dead peer). True when the receiver reads the pieces in place later: their
        memory must then stay unchanged until `consumed(dest, position(dest))` (or the caller's lease)."""
        ...

    def position(self, dest: str) -> int:
        """A mark just past everything sent to `dest` so far."""
        ...

    def consumed(self, dest: str, mark: int) -> bool:
        """Whether `dest` has taken everything up to `mark`."""
        ...

    def send_control(self, dest: str, header: dict) -> None: ...

    def forget(self, dest: str) -> None:
        """`dest` died or restarted: drop what is kept for it (a ring, a connection), sending nothing."""

    def close(self) -> None: ...


class KVReceiver(Protocol):
    address: str  # what a sender passes as `dest`

    def poll(self, timeout_ms: int = 0, place: Place = scratch_place) -> list[Received]:
        """Messages that arrived (waiting up to `timeout_ms` for the first), chunks already written where
        `place` said and verified."""
        ...

    @property
    def wakeup(self):
        """A ZeroMQ socket that turns readable when KV arrives after `arm()`, for the caller's poller; None
        when the transport cannot wake a caller (it must poll)."""
        ...

    def arm(self) -> bool:
        """Ask to be woken through `wakeup` by the next record; False if one is already waiting."""
        ...

    def close(self) -> None: ...


class TransferError(Exception):
    """A chunk could not be handed to the transport in time."""


class FaultInjector:
    """Test-only sabotage of outgoing chunks, from the environment of the sending process.

    `PDSERVE_FAULT_CORRUPT_CHUNKS=N` flips one payload byte *after* the checksum of the N-th chunk sent
    (1-based) and of every N-th after it; the receiver must reject those transfers. `PDSERVE_FAULT_REPLAY_RECORDS=N`
    (tcp) sends every N-th record twice, byte for byte, as an attacker on the path would replay it; the receiver
    must refuse the copy (a protected record's counter) or see a duplicate. Off when unset.
    """

    def __init__(self, every: int | None = None, replay_every: int | None = None) -> None:
        if every is None:
            every = int(os.environ.get("PDSERVE_FAULT_CORRUPT_CHUNKS", "0") or 0)
        if replay_every is None:
            replay_every = int(os.environ.get("PDSERVE_FAULT_REPLAY_RECORDS", "0") or 0)
        self.every, self.replay_every = every, replay_every
        self.count = self.sent = 0

    def replay(self) -> bool:
        """Whether the record just sent is one to send again."""
        if self.replay_every <= 0:
            return False
        self.sent += 1
        return self.sent % self.replay_every == 0

    def hit(self) -> bool:
        """Whether the chunk being sent now is one to corrupt."""
        if self.every <= 0:
            return False
        self.count += 1
        return self.count % self.every == 0

    def maybe_corrupt(self, pieces: list[memoryview]) -> list[memoryview]:
        """The pieces to put on the wire: every N-th chunk's first byte flipped, in a copy (the sender's
        pool is never touched)."""
        if not pieces or len(pieces[0]) == 0 or not self.hit():
            return pieces
        bad = bytearray(pieces[0])
        bad[0] ^= 0xFF
        return [memoryview(bad), *pieces[1:]]
