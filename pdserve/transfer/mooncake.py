"""`mooncake` transport: KV payloads by one-sided write through Mooncake Transfer Engine (`mooncake.engine`, the
optional `pdserve[mooncake]`), control records over the `tcp` transport. Works across hosts; its TCP protocol
here, RDMA where the host has it (`--mooncake-protocol`).

The receiver (a decode worker) runs a transfer engine in P2P-handshake mode (no metadata server: a segment is
named by its `host:rpc_port`) and registers a *directory* with it: `SLOTS` slots of (channel nonce, ring base,
ring size, consumed). Its address names all three parts it serves, `mooncake://HOST:RPC_PORT/CTL_PORT/DIR`
(DIR: the directory's address, hex), where CTL_PORT is a `TcpReceiver` on HOST.

    1. open    the sender's first send to a receiver sends `{"kind": "mc_open", "nonce", "host"}` as a tcp
               control record (the tcp hello proves it is of this deployment: `pdserve.transfer.peer_auth`).
               The receiver, at its next poll, registers a ring of `ring_bytes` for the channel and fills a
               directory slot; the sender reads the directory (one-sided) until its nonce is there, or its
               deadline passes (`TransferError`).
    2. chunk   the sender gathers the chunk's pieces into its own registered staging buffer (sealing them there
               when its label asks: below), writes it into the ring at its head (one-sided; a record that would
               cross the ring's end starts again at 0), then sends the chunk's header over tcp with
               `"mc": [nonce, counter, start, wire bytes, mode, xxh3]` (start: the ring position, counted from
               the channel's start). A write completes before its header is sent, so a header never arrives
               before its payload.
    3. place   the receiver asks `place(header)` where the chunk goes, copies it there out of the ring and
               verifies it (xxh3 over what it wrote, or the tag), then marks the ring consumed up to the
               record's end, in its directory slot. A sender whose ring is full reads that slot (one-sided,
               ~25 us on loopback) until there is room, up to its deadline.

Control records (done, alive, fail) are plain tcp records. So every rule above the seam is the tcp path's: the
delivery schedule, the leases (`alive`), the breakers (a failed write, a full ring or an unanswered open is a
`TransferError`), and the checksum: a chunk whose bytes do not match fails its transfer, which is recomputed.

Sensitivity (`pdserve.core.pd.sensitivity`): the payload gets the mode its label and path ask (`protection`),
like a tcp record; the path crosses hosts when the peer's address is not loopback (`kv_seal.crosses_hosts`: the
sender from the receiver's address, the receiver from the address the sender states in its open record, a tcp
control record, so authenticated wherever the path crosses hosts). mac: a 16-byte GMAC tag after the payload; aead: the payload encrypted
(AES-256-GCM, its tag after it) *before* the engine sees it, with the chunk's meta as associated data. Key per
channel: HKDF-SHA256 of the deployment secret salted with the channel's nonce; nonce: the channel's record
counter, which the receiver accepts only rising (a replayed or reordered payload is refused). The header that
carries the counter is a tcp chunk record, protected by the tcp path's own rule for the same label and path,
so it cannot be changed either. A refused payload fails its transfer (counted in `auth_failures`).

Memory: each channel's ring is registered memory of the receiver (`ring_bytes`, 32 MiB by default; at most
`SLOTS` channels, the oldest closed for a new one; a sender that gives a channel up after a failure tells the
receiver to free its ring, `mc_close`); each sender has one registered staging buffer of its
largest record. One engine per process and protocol (`engine`), initialized with the first host asked for.

Why this shape: the prefill side pushes (as vLLM's Mooncake connector has the prefill worker write into the
decode worker's memory), so the engine's transfer time is spent on the sender's thread, never in the decode
worker's poll; the receiver grants a ring instead of exposing its KV pool, because blocks are placed only when
their header arrives (`place`), and verified before they count; and the consumed mark lives in the receiver's
memory, read by the sender only when its ring is full, so a receiver never writes to a sender. A header the
receiver cannot use (malformed, an unknown channel, a position outside the ring) fails its chunk, counted.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from pdserve.core.pd.sensitivity import DEFAULT, MODES, acceptable, protection
from pdserve.transfer.base import (Capabilities, FaultInjector, Place, Received, TransferError, copy_into,
                                   encode_meta, scratch_place)
from pdserve.transfer.kv_seal import TAG, crosses_hosts
from pdserve.transfer.peer_auth import deployment_secret
from pdserve.transfer.tcp import TcpReceiver, TcpSender, _scatter

SCHEME = "mooncake://"
SLOT = struct.Struct("<16sQQQ")  # channel nonce, ring base address, ring size, consumed (ring position)
SLOTS = 16  # channels a receiver keeps (a ring each)
RING_BYTES = 32 << 20
_INFO = b"pdserve kv mooncake v1"
_POLL_S = 0.0005  # a sender's wait between reads of a full ring's slot (or the directory, at open)


def parse_address(address: str) -> tuple[str, str, int]:
    """`mooncake://HOST:RPC/CTL/DIR` -> (segment `HOST:RPC`, control `tcp://HOST:CTL`, directory address)."""
    try:
        segment, ctl, directory = address.removeprefix(SCHEME).split("/")
        host = segment.rpartition(":")[0]
        return segment, f"tcp://{host}:{int(ctl)}", int(directory, 16)
    except ValueError as e:
        raise TransferError(f"KV address {address!r}: expected {SCHEME}HOST:RPC_PORT/CTL_PORT/DIR") from e


# ---- the engine and its memory ----------------------------------------------------------------------------
_engines: dict[str, tuple[object, str]] = {}
_engines_lock = threading.Lock()


def engine(host: str, protocol: str):
    """This process's transfer engine for `protocol` and its segment name (`host:rpc_port`), started at first
    use (P2P handshake: no metadata server). RuntimeError when it does not start."""
    with _engines_lock:
        if protocol not in _engines:
            from mooncake.engine import TransferEngine
            te = TransferEngine()
            rc = te.initialize(host, "P2PHANDSHAKE", protocol, "")
            if rc != 0:
                raise RuntimeError(f"Mooncake transfer engine did not start on {host} over {protocol} (rc {rc})")
            _engines[protocol] = (te, f"{host}:{te.get_rpc_port()}")
        return _engines[protocol]


class Region:
    """A buffer registered with an engine: `view` to read and write it, `addr` for one-sided transfers."""

    def __init__(self, te, nbytes: int) -> None:
        self.te, self.buf = te, bytearray(nbytes)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))
        if te.register_memory(self.addr, nbytes) != 0:
            raise RuntimeError(f"Mooncake could not register {nbytes} bytes")
        self.view = memoryview(self.buf)

    def close(self) -> None:
        if self.view is not None:
            self.te.unregister_memory(self.addr)
            self.view = None


def _key(secret: bytes, nonce: bytes) -> AESGCM:
    return AESGCM(HKDF(hashes.SHA256(), 32, salt=nonce, info=_INFO).derive(secret))


def _nonce(counter: int) -> bytes:
    return counter.to_bytes(12, "little")


def _local_host(peer_host: str) -> str:
    """This host's address on the route to `peer_host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer_host, 9))
        return s.getsockname()[0]


# ---- sender ------------------------------------------------------------------------------------------------
class _RingFull(TransferError):
    """The receiver consumed nothing of its ring before the send's deadline."""


@dataclass
class _Out:
    """A sender's channel to one receiver: its ring there, where it writes next, what it knows is consumed."""
    segment: str
    ctl: str
    slot_addr: int
    nonce: bytes
    base: int
    size: int
    crosses: bool
    aead: AESGCM
    head: int = 0
    consumed: int = 0
    counter: int = 0


class MooncakeSender:
    capabilities = Capabilities(zero_copy=False, cross_host=True)

    def __init__(self, timeout_s: float = 10.0, protocol: str = "tcp", faults: FaultInjector | None = None,
                 secret: bytes | None = None) -> None:
        self._timeout_s, self._protocol = timeout_s, protocol
        self._secret = secret
        self._control = TcpSender(timeout_s, secret=secret)
        self._channels: dict[str, _Out] = {}
        self._stage: Region | None = None  # gathered (and sealed) payloads, the engine's source
        self._small: Region | None = None  # where directory and slot reads land
        self._plain = bytearray()  # an aead payload's plaintext, gathered
        self.faults = faults or FaultInjector()
        self.protected_bytes = {mode: 0 for mode in MODES}
        self.bytes_sent = 0
        self.max_chunk_bytes = 8 << 20

    def send_chunk(self, dest: str, header: dict, pieces: list[memoryview]) -> bool:
        deadline = time.monotonic() + self._timeout_s
        ch = self._channel(dest, deadline)
        nbytes = sum(len(p) for p in pieces)
        mode = protection(header.get("label", DEFAULT), ch.crosses)
        wire = nbytes + (TAG if mode != "plain" else 0)
        try:
            start = self._reserve(ch, wire, deadline)
            digest = self._fill(ch, mode, header, pieces, nbytes)
            if wire and self.faults.hit():  # (test-only: a byte changed after the checksum or tag)
                self._stage.view[0] ^= 0xFF
            te, _ = engine("", self._protocol)
            if wire and te.transfer_sync_write(ch.segment, self._stage.addr, ch.base + start % ch.size, wire) != 0:
                raise TransferError(f"mooncake write of {wire} bytes to {ch.segment} failed")
        except _RingFull:  # (a receiver alive, not reading: told to free the ring)
            self._give_up(dest)
            raise
        except TransferError:  # (a failed write: the receiver is likely gone)
            self.forget(dest)
            raise
        self._control.send_control(ch.ctl, {**header, "mc": [ch.nonce, ch.counter, start, wire, mode, digest]})
        ch.counter += 1
        self.protected_bytes[mode] += nbytes
        self.bytes_sent += nbytes
        return False  # the staging buffer has its copy: the pieces may change now

    def _fill(self, ch: _Out, mode: str, header: dict, pieces: list, nbytes: int) -> int:
        """The payload into the staging buffer, as it goes on the wire; its xxh3 (plain) or 0."""
        stage = self._staging(nbytes + TAG)
        if mode == "plain":
            return copy_into([stage[:nbytes]], pieces)
        if mode == "mac":
            copy_into([stage[:nbytes]], pieces)
            stage[nbytes:nbytes + TAG] = ch.aead.encrypt(_nonce(ch.counter), b"", bytes(stage[:nbytes]))
            return 0
        if len(self._plain) < nbytes:
            self._plain = bytearray(nbytes)
        plain = memoryview(self._plain)[:nbytes]
        copy_into([plain], pieces)
        ch.aead.encrypt_into(_nonce(ch.counter), plain, encode_meta(header), stage[:nbytes + TAG])
        return 0

    def _staging(self, nbytes: int) -> memoryview:
        if self._stage is None or len(self._stage.buf) < nbytes:
            if self._stage is not None:
                self._stage.close()
            self._stage = Region(engine("", self._protocol)[0], max(nbytes, self.max_chunk_bytes + TAG))
        return self._stage.view

    def _reserve(self, ch: _Out, wire: int, deadline: float) -> int:
        """The ring position the next `wire` bytes go to, once the receiver has consumed enough for them."""
        if wire > ch.size:
            raise TransferError(f"a {wire}-byte record does not fit the receiver's {ch.size}-byte ring")
        off = ch.head % ch.size
        start = ch.head + (ch.size - off if off + wire > ch.size else 0)
        while start + wire - ch.consumed > ch.size:
            if time.monotonic() > deadline:
                raise _RingFull(f"mooncake ring at {ch.segment} stayed full")
            time.sleep(_POLL_S)
            nonce, _, _, ch.consumed = SLOT.unpack(self._read(ch.segment, ch.slot_addr, SLOT.size))
            if nonce != ch.nonce:
                raise TransferError(f"mooncake channel to {ch.segment} was closed by the receiver")
        ch.head = start + wire
        return start

    def _read(self, segment: str, addr: int, nbytes: int) -> bytes:
        te, _ = engine("", self._protocol)
        if self._small is None:
            self._small = Region(te, SLOT.size * SLOTS)
        if te.transfer_sync_read(segment, self._small.addr, addr, nbytes) != 0:
            raise TransferError(f"mooncake read from {segment} failed")
        return bytes(self._small.view[:nbytes])

    def _channel(self, dest: str, deadline: float) -> _Out:
        ch = self._channels.get(dest)
        if ch is not None:
            return ch
        segment, ctl, directory = parse_address(dest)
        peer = segment.rpartition(":")[0]
        try:
            here = _local_host(peer)
            engine(here, self._protocol)
        except (OSError, RuntimeError) as e:
            raise TransferError(f"no mooncake route to {segment}: {e}") from e
        nonce = os.urandom(16)
        self._control.send_control(ctl, {"kind": "mc_open", "nonce": nonce, "host": here})
        while True:  # (the receiver opens it at its next poll)
            table = self._read(segment, directory, SLOT.size * SLOTS)
            for i in range(SLOTS):
                theirs, base, size, consumed = SLOT.unpack_from(table, i * SLOT.size)
                if theirs == nonce:
                    secret = deployment_secret() if self._secret is None else self._secret
                    ch = _Out(segment, ctl, directory + i * SLOT.size, nonce, base, size, crosses_hosts(peer),
                              _key(secret, nonce), consumed, consumed)
                    self._channels[dest] = ch
                    return ch
            if time.monotonic() > deadline:
                raise TransferError(f"mooncake receiver {segment} did not open a channel in time")
            time.sleep(_POLL_S)

    def position(self, dest: str) -> int:
        return 0

    def consumed(self, dest: str, mark: int) -> bool:
        return True

    def send_control(self, dest: str, header: dict) -> None:
        self._control.send_control(parse_address(dest)[1], header)

    def _give_up(self, dest: str) -> None:
        """A channel given up: the receiver is told to free its ring (if it still hears), then it is forgotten."""
        ch = self._channels.get(dest)
        if ch is not None:
            try:
                self._control.send_control(ch.ctl, {"kind": "mc_close", "nonce": ch.nonce})
            except TransferError:
                pass  # (its receiver is gone: nothing to free)
        self.forget(dest)

    def forget(self, dest: str) -> None:
        ch = self._channels.pop(dest, None)
        if ch is not None:
            self._control.forget(ch.ctl)

    def close(self) -> None:
        self._control.close()
        for region in (self._stage, self._small):
            if region is not None:
                region.close()


# ---- receiver ----------------------------------------------------------------------------------------------
@dataclass
class _In:
    """A receiver's channel from one sender: its ring and slot, the last counter it accepted."""
    slot: int
    ring: Region
    crosses: bool
    aead: AESGCM
    last: int = -1
    opened: float = field(default_factory=time.monotonic)


class MooncakeReceiver:
    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", ring_bytes: int = RING_BYTES,
                 secret: bytes | None = None) -> None:
        self._control = TcpReceiver(host, secret)
        self._secret = deployment_secret() if secret is None else secret
        self._te, segment = engine(host, protocol)
        self._dir = Region(self._te, SLOT.size * SLOTS)
        self._ring_bytes = ring_bytes
        self._channels: dict[bytes, _In] = {}
        self._plain = bytearray()
        self.address = f"{SCHEME}{segment}/{self._control.address.rpartition(':')[2]}/{self._dir.addr:x}"
        self.refused = 0  # payloads refused (protection, counter, channel): their transfers fail
        self.auth = self._control.auth

    wakeup = None  # polled, as tcp
    path = "mooncake"  # its name in `kv_seal.protection_report`

    @property
    def auth_failures(self) -> int:
        """Records refused: payloads here, and headers on the tcp side (`TcpReceiver.auth_failures`)."""
        return self.refused + self._control.auth_failures

    def arm(self) -> bool:
        return True

    @property
    def num_bad_records(self) -> int:
        return self._control.num_bad_records

    @property
    def rejected_connections(self) -> dict[str, int]:
        return self._control.rejected_connections

    def poll(self, timeout_ms: int = 0, place: Place = scratch_place) -> list[Received]:
        out = []
        for rec in self._control.poll(timeout_ms, place):
            kind = rec.header.get("kind")
            if kind == "mc_open":
                self._open(rec.header)
            elif kind == "mc_close":
                nonce = rec.header.get("nonce")
                if isinstance(nonce, bytes) and nonce in self._channels:
                    self._close_channel(nonce)
            elif kind == "chunk" and "mc" in rec.header and rec.views is None:
                out.append(self._chunk(rec.header, place))
            else:  # control records, and chunk headers the tcp path refused (their transfers fail)
                out.append(rec)
        return out

    def _open(self, header: dict) -> None:
        nonce = header.get("nonce")
        if not isinstance(nonce, bytes) or len(nonce) != 16 or nonce in self._channels:
            return
        used = {ch.slot for ch in self._channels.values()}
        free = [i for i in range(SLOTS) if i not in used]
        if not free:  # the oldest channel gives up its slot (its sender's next write fails, and it reopens)
            oldest = min(self._channels, key=lambda n: self._channels[n].opened)
            free = [self._close_channel(oldest)]
        ring = Region(self._te, self._ring_bytes)
        self._channels[nonce] = _In(free[0], ring, crosses_hosts(str(header.get("host", ""))),
                                    _key(self._secret, nonce))
        SLOT.pack_into(self._dir.view, free[0] * SLOT.size, nonce, ring.addr, self._ring_bytes, 0)

    def _close_channel(self, nonce: bytes) -> int:
        ch = self._channels.pop(nonce)
        SLOT.pack_into(self._dir.view, ch.slot * SLOT.size, bytes(16), 0, 0, 0)
        ch.ring.close()
        return ch.slot

    def _chunk(self, header: dict, place: Place) -> Received:
        """A chunk whose payload is in its channel's ring: placed, copied out and verified, or refused."""
        try:
            nonce, counter, start, wire, mode, digest = header.pop("mc")
            if not (isinstance(nonce, bytes) and all(isinstance(v, int) for v in (counter, start, wire, digest))):
                raise TypeError
        except (TypeError, ValueError):
            self.refused += 1
            return Received({**header, "reason": "a malformed mooncake chunk header"}, [], False)
        aad = encode_meta(header)
        nbytes = wire - (TAG if mode != "plain" else 0)
        header.update(nbytes=nbytes, checksum=digest)
        ch = self._channels.get(nonce)
        reason = self._refuse(ch, header, counter, start, wire, mode)
        if reason is not None:
            self.refused += 1
            return Received({**header, "reason": reason}, [], False)
        ch.last = counter
        try:
            placed = place(header)
            if placed is None:
                return Received(header)
            at = start % ch.ring.view.nbytes
            payload = ch.ring.view[at:at + wire]
            if sum(len(v) for v in placed) != nbytes:  # (never written: its transfer fails)
                return Received({**header, "reason": f"placement is not {nbytes} bytes"}, [], False)
            if mode == "plain":
                return Received(header, placed, copy_into(placed, [payload]) == digest)
            return Received(header, placed, self._open_sealed(ch, mode, counter, payload, aad, placed))
        finally:  # the ring space is free again, whatever became of the chunk
            struct.pack_into("<Q", self._dir.view, (ch.slot + 1) * SLOT.size - 8, start + wire)  # consumed

    def _refuse(self, ch: _In | None, header: dict, counter: int, start: int, wire: int, mode: str) -> str | None:
        """Why a chunk's payload is not to be used, or None."""
        if ch is None:
            return "a chunk of an unknown mooncake channel"
        label = header.get("label", DEFAULT)
        if mode not in MODES or not acceptable(mode, label, ch.crosses):
            return f"a {mode} payload where {protection(label, ch.crosses)} is required"
        if counter <= ch.last:
            return f"a replayed or reordered payload (counter {counter}, last accepted {ch.last})"
        size = ch.ring.view.nbytes
        if (not 0 <= start < 1 << 62 or wire < (TAG if mode != "plain" else 0) or wire > size
                or start % size + wire > size):
            return f"a payload of {wire} bytes at ring position {start} outside the ring"
        return None

    def _open_sealed(self, ch: _In, mode: str, counter: int, payload: memoryview, aad: bytes,
                     placed: list[memoryview]) -> bool:
        """A mac or aead payload verified (decrypted) and written to `placed`; False (counted) if its tag fails."""
        from cryptography.exceptions import InvalidTag
        nbytes = len(payload) - TAG
        try:
            if mode == "mac":
                ch.aead.decrypt(_nonce(counter), bytes(payload[nbytes:]), bytes(payload[:nbytes]))
                copy_into(placed, [payload[:nbytes]])
                return True
            if len(self._plain) < nbytes:
                self._plain = bytearray(nbytes)
            plain = memoryview(self._plain)[:nbytes]
            ch.aead.decrypt_into(_nonce(counter), payload, aad, plain)
            _scatter(plain, placed)
            return True
        except InvalidTag:
            self.refused += 1
            return False

    def close(self) -> None:
        for nonce in list(self._channels):
            self._close_channel(nonce)
        self._dir.close()
        self._control.close()
