"""`tcp` transport: records over a plain TCP stream per (sender, receiver) pair. Works across hosts.

Framing: `<IIQB` (meta length, payload length, xxh3-64 of the payload, protection mode), msgpack meta,
payload, and for a protected record a 16-byte tag (`pdserve.transfer.kv_seal`: plain, mac or aead by the
chunk's sensitivity label and whether the connection crosses hosts). The sender
hashes a chunk's pieces first (a record fits the core's L2, so the send then reads them from cache) and
sends prefix, meta and payload with one `sendmsg` straight from its KV pool's views (the kernel's copy is
the only one). The receiver reads prefix and meta, asks its caller where the payload goes,
`recvmsg_into`s the reserved KV blocks directly and verifies the checksum over them. A payload nobody wants
(a transfer that ended) is read into scratch and dropped.

Why not ZeroMQ here (the control plane is ZeroMQ): a ZeroMQ message lands in a buffer ZeroMQ allocates, so
every chunk would be copied once more into the pool, and the sender needs a staging copy that outlives the
call. Every connection opens with the sender's hello (`pdserve.transfer.peer_auth`): the receiver reads
nothing from a peer of another deployment. A send blocks at most `timeout_s` (a receiver that stops reading
fills the socket buffers), then raises `TransferError`; so does a refused or reset connection."""

from __future__ import annotations

import selectors
import socket
import struct
import time

from pdserve.transfer.base import (Capabilities, FaultInjector, Place, Received, TransferError, checksum,
                                   decode_record, encode_meta, scratch_place)
from pdserve.transfer.kv_seal import MODE_CODES, MODES, TAG, AuthFailure, Seal, crosses_hosts
from pdserve.transfer.peer_auth import (HELLO, REPLY, HelloCheck, check_reply, deployment_secret, hello,
                                        hello_nonce, reply)

PREFIX = struct.Struct("<IIQB")


class ForeignPeer(Exception):
    """A connection that did not open with this deployment's hello (`pdserve.transfer.peer_auth`)."""

_MAX_IOV = 512  # buffers per sendmsg/recvmsg_into call (Linux allows 1,024)
_SOCK_BUF = 8 << 20
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)  # Linux's option number
NOTSENT_LOWAT = 128 << 10  # unsent bytes a socket may hold beyond what is in flight
_MAX_META = 1 << 20


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


class TcpSender:
    capabilities = Capabilities(zero_copy=False, cross_host=True)

    def __init__(self, timeout_s: float = 10.0, faults: FaultInjector | None = None,
                 secret: bytes | None = None) -> None:
        self._timeout_s = timeout_s
        self._secret = secret  # None: the deployment's (`peer_auth.deployment_secret`)
        self._sockets: dict[str, socket.socket] = {}
        self._seals: dict[str, Seal] = {}  # each connection's record protection (`kv_seal`)
        self.protected_bytes = {mode: 0 for mode in MODES}  # payload bytes sent, by mode
        self.faults = faults or FaultInjector()
        self.bytes_sent = 0
        self.max_chunk_bytes = 8 << 20  # callers split larger payloads, so chunks pipeline on the wire

    def _socket(self, dest: str, deadline: float) -> socket.socket:
        sock = self._sockets.get(dest)
        if sock is not None and _closed_by_peer(sock):  # (its receiver restarted, or dropped a broken stream)
            self.forget(dest)
            sock = None
        if sock is None:
            try:
                sock = socket.create_connection(parse_address(dest), timeout=max(deadline - time.monotonic(), 0.01))
            except (OSError, ValueError) as e:
                raise TransferError(f"tcp connect to {dest} failed: {e}") from e
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # What waits for the link waits in the sender's queue, in delivery order, not in a kernel buffer:
            # a send returns once all but NOTSENT_LOWAT of it is on the wire (`pdserve.transfer.link_lane`).
            sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, NOTSENT_LOWAT)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
            # Data unacknowledged for a send's deadline (a blackholed peer) aborts the connection: the next send
            # fails (its breaker counts it: `pdserve.core.pd.breaker`) instead of filling the buffer unheard.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(int(self._timeout_s * 1000), 1))
            try:
                self._seals[dest] = self._handshake(sock, deadline)  # this deployment's: `peer_auth`
            except OSError as e:
                sock.close()
                raise TransferError(f"tcp hello to {dest} failed: {e or 'timed out'}") from e
            self._sockets[dest] = sock
        return sock

    def _handshake(self, sock: socket.socket, deadline: float) -> Seal:
        """The hello; the connection's key waits for the receiver's reply (`_keyed`)."""
        secret = deployment_secret() if self._secret is None else self._secret
        first = hello(secret)
        _send_all(sock, [first], deadline)
        return Seal(secret, hello_nonce(first), crosses_hosts(sock.getpeername()[0]))

    def _keyed(self, sock: socket.socket, seal: Seal, mode: str, deadline: float) -> None:
        """Key `seal` from the receiver's reply: waited for (up to `deadline`) only when a protected record
        needs it, taken when already there otherwise (a receiver polls only while it expects KV)."""
        if seal.keyed:
            return
        if mode == "plain":
            sock.settimeout(0)  # (a socket with a timeout would wait for it even under MSG_DONTWAIT)
            try:
                if len(sock.recv(REPLY.size, socket.MSG_PEEK)) < REPLY.size:
                    return
            except BlockingIOError:
                return
        theirs = check_reply(seal.secret, seal.sender_nonce, _recv_exact(sock, REPLY.size, deadline))
        if theirs is None:
            raise ConnectionError("the receiver's reply is not this deployment's")
        seal.key(theirs)

    def send_chunk(self, dest: str, header: dict, pieces: list[memoryview]) -> bool:
        nbytes = sum(len(p) for p in pieces)
        self._send(dest, header, pieces, nbytes)
        self.bytes_sent += nbytes
        return False  # the kernel has its copy: the pieces may change now

    def position(self, dest: str) -> int:
        return 0

    def consumed(self, dest: str, mark: int) -> bool:
        return True

    def send_control(self, dest: str, header: dict) -> None:
        self._send(dest, header, [], 0)

    def _send(self, dest: str, header: dict, pieces: list, nbytes: int) -> None:
        deadline = time.monotonic() + self._timeout_s
        meta = encode_meta(header)
        sock = self._socket(dest, deadline)
        try:
            seal = self._seals[dest]
            mode = seal.mode_for(header)
            self._keyed(sock, seal, mode, deadline)
            seq = seal.take()
            # Hashed first (a record fits the core's L2), so the send then reads the pieces from cache. A
            # protected record carries its counter there instead (its tag is its check: `kv_seal`).
            field = seq if mode != "plain" else checksum(pieces) if nbytes else 0
            head = PREFIX.pack(len(meta), nbytes, field, MODE_CODES[mode]) + meta
            body = seal.seal(mode, head, pieces, nbytes, seq)
            wire = [head, *self.faults.maybe_corrupt(body)]
            _send_all(sock, wire, deadline)
            if self.faults.replay():  # (test-only: the same record again, as a replay on the path)
                _send_all(sock, wire, deadline)
            if nbytes:
                self.protected_bytes[mode] += nbytes
        except OSError as e:  # timeout, reset, broken pipe: this connection is done
            self._sockets.pop(dest, None)
            self._seals.pop(dest, None)
            sock.close()
            raise TransferError(f"tcp send to {dest} failed: {e or 'timed out'}") from e

    def forget(self, dest: str) -> None:
        """`dest` died (or restarted): drop its connection; a later send to it connects afresh."""
        sock = self._sockets.pop(dest, None)
        self._seals.pop(dest, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()


def _send_all(sock: socket.socket, buffers: list, deadline: float) -> None:
    bufs = [memoryview(b).cast("B") for b in buffers]
    while bufs:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("send deadline passed")
        sock.settimeout(remaining)
        sent = sock.sendmsg(bufs[:_MAX_IOV])
        while bufs and sent >= len(bufs[0]):
            sent -= len(bufs[0])
            bufs.pop(0)
        if sent:
            bufs[0] = bufs[0][sent:]


def _scatter(source: memoryview, views: list[memoryview]) -> None:
    if sum(len(v) for v in views) != len(source):
        raise ValueError(f"placement holds {sum(len(v) for v in views)} bytes, the chunk has {len(source)}")
    at = 0
    for view in views:
        view[:] = source[at:at + len(view)]
        at += len(view)


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the receiver closed (or reset) the connection: sending on it would lose what is sent."""
    sock.settimeout(0)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _recv_exact(sock: socket.socket, size: int, deadline: float) -> bytes:
    data = bytearray()
    while len(data) < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("no reply to the hello before the deadline")
        sock.settimeout(remaining)
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the receiver closed the connection at the hello")
        data += chunk
    return bytes(data)


class _Stream:
    """One accepted connection: a record parser that writes payloads where `place` says."""

    def __init__(self, sock: socket.socket, check: HelloCheck) -> None:
        self.sock = sock
        self.check = check
        self.hello = bytearray()  # until it is whole and verified, nothing else is read
        self.head = bytearray(PREFIX.size)  # the prefix, then the meta
        self.filled = 0
        self.header: dict | None = None
        self.views: list[memoryview] | None = None  # the rest of the payload's destination
        self.placed: list[memoryview] | None = None  # all of it (None: dropping it)
        self.left = 0  # payload bytes still to read
        self.scratch = memoryview(bytearray(1 << 20))
        self.seal: Seal | None = None  # once the hello is verified (`kv_seal`)
        self.mode = "plain"  # the current record's
        self.counter = 0  # a protected record's counter (its prefix's third field)
        self.refused: str | None = None  # a plain record where more is due: read, dropped, then refused
        self.sealed = bytearray()  # a protected record whole: prefix and meta, payload, tag (`Seal.open`)

    def read(self, place: Place, out: list[Received]) -> None:
        """Every record complete so far, into `out`; raises EOFError when the peer closed, `AuthFailure` when a
        record fails its protection (`self.header` is that record's, unverified)."""
        if self.placed is not None:
            self._replace(place)
        try:
            if self.hello is not None:
                self._read_hello()
            while True:
                if self.header is None:
                    self._read_head(place)
                if self.header is not None:
                    self._read_payload()
                    out.append(self._finish(place))
        except BlockingIOError:
            return

    def _read_hello(self) -> None:
        while len(self.hello) < HELLO.size:
            chunk = self.sock.recv(HELLO.size - len(self.hello))
            if not chunk:
                raise EOFError
            self.hello += chunk
        if not self.check.verify(bytes(self.hello)):
            raise ForeignPeer("a connection without this deployment's hello")
        theirs = hello_nonce(bytes(self.hello))
        answer, ours = reply(self.check.secret, theirs)
        if self.sock.send(answer) != len(answer):  # (a fresh socket's buffer takes 48 bytes)
            raise ValueError("the hello's reply did not fit the socket")
        self.seal = Seal(self.check.secret, theirs, crosses_hosts(self.sock.getpeername()[0])).key(ours)
        self.hello = None

    def _recv_into(self, view: memoryview) -> int:
        n = self.sock.recv_into(view)
        if n == 0:
            raise EOFError
        return n

    def _read_head(self, place: Place) -> None:
        while self.filled < len(self.head):
            self.filled += self._recv_into(memoryview(self.head)[self.filled:])
        meta_len, nbytes, digest, mode = PREFIX.unpack_from(self.head)
        if meta_len > _MAX_META:
            raise ValueError(f"record meta of {meta_len} bytes")
        if len(self.head) == PREFIX.size and meta_len:
            self.head += bytes(meta_len)  # now read the meta
            return self._read_head(place)
        if mode >= len(MODES):
            raise ValueError(f"record protection mode {mode}")
        self.header = decode_record(bytes(self.head[PREFIX.size:]), nbytes, digest)
        self.mode, self.left, self.counter = MODES[mode], nbytes, digest
        if self.mode != "plain":  # read whole, opened, then placed (`_finish`)
            self.left = nbytes + TAG
            if len(self.sealed) < len(self.head) + self.left:
                self.sealed = bytearray(len(self.head) + self.left)
            self.sealed[:len(self.head)] = self.head
            self.views = [memoryview(self.sealed)[len(self.head):len(self.head) + self.left]]
            return
        try:
            self.seal.check(self.mode, self.header)
        except AuthFailure as e:
            self.refused = str(e)
            self.left, self.placed, self.views = nbytes, None, None  # its payload is read and dropped
            return
        self.placed = place(self.header) if nbytes else None
        self.views = list(self.placed) if self.placed is not None else None
        if self.placed is not None and sum(len(v) for v in self.placed) != nbytes:
            raise ValueError(f"placement holds {sum(len(v) for v in self.placed)} bytes, the chunk has {nbytes}")

    def _replace(self, place: Place) -> None:
        """A payload that arrived only in part at the last poll: ask again where it goes before writing the
        rest (its transfer may have ended since, and its blocks gone to another request)."""
        fresh = place(self.header)
        if fresh is None or sum(len(v) for v in fresh) != self.header["nbytes"]:
            self.placed = self.views = None  # the rest is read into scratch and dropped
            return
        self.placed, self.views, done = fresh, [], self.header["nbytes"] - self.left
        for view in fresh:
            if done >= len(view):
                done -= len(view)
                continue
            self.views.append(view[done:])
            done = 0

    def _read_payload(self) -> None:
        while self.left:
            if self.views is None:
                self.left -= self._recv_into(self.scratch[:min(self.left, len(self.scratch))])
                continue
            n = self.sock.recvmsg_into(self.views[:_MAX_IOV])[0]
            if n == 0:
                raise EOFError
            self.left -= n
            while self.views and n >= len(self.views[0]):
                n -= len(self.views[0])
                self.views.pop(0)
            if n:
                self.views[0] = self.views[0][n:]

    def _finish(self, place: Place) -> Received:
        if self.mode != "plain":
            return self._open(place)
        header, placed, refused = self.header, self.placed, self.refused
        self._next_record()
        if refused is not None:
            raise _refusal(refused, header)
        if placed is None:
            return Received(header)
        return Received(header, placed, checksum(placed) == header["checksum"])

    def _open(self, place: Place) -> Received:
        """A protected record: verified (decrypted) first; only then is it placed (`AuthFailure` if not)."""
        header, nbytes = self.header, self.header.get("nbytes", 0)
        try:
            payload = self.seal.open(self.mode, memoryview(self.sealed), len(self.head), nbytes, self.counter)
            self.seal.check(self.mode, header)
        except AuthFailure as e:
            raise _refusal(str(e), header)
        finally:
            self._next_record()
        placed = place(header) if nbytes else None
        if placed is None:
            return Received(header)
        _scatter(payload, placed)
        return Received(header, placed, True)

    def _next_record(self) -> None:
        self.head, self.filled, self.header, self.views, self.placed = bytearray(PREFIX.size), 0, None, None, None
        self.mode, self.refused = "plain", None


def _refusal(reason: str, header: dict) -> AuthFailure:
    failure = AuthFailure(reason)
    failure.header = header
    return failure


def _refused(header: dict, reason: str) -> Received:
    """What a record refused by its protection means to the receiver: its transfer (as the unverified header
    names it) fails, through the checksum path for a chunk (never used), as the sender's failure otherwise."""
    if header.get("kind") == "chunk":
        return Received(header, [], False)
    return Received({"kind": "fail", "xfer": header.get("xfer"), "reason": reason})


class TcpReceiver:
    def __init__(self, host: str = "127.0.0.1", secret: bytes | None = None) -> None:
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.address = f"tcp://{host}:{self._listener.getsockname()[1]}"
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._streams: dict[socket.socket, _Stream] = {}
        self.num_bad_records = 0
        self.auth_failures = 0  # records refused by their protection (`kv_seal`): their transfers fail
        self.auth = HelloCheck(secret)  # `auth.rejected`: foreign connections refused

    wakeup = None  # its sockets are plain TCP: a caller with transfers in flight polls (`arm` is a no-op)

    def arm(self) -> bool:
        return True

    def poll(self, timeout_ms: int = 0, place: Place = scratch_place) -> list[Received]:
        out: list[Received] = []
        for key, _ in self._selector.select(timeout_ms / 1000):
            if key.fileobj is self._listener:
                self._accept()
        for stream in list(self._streams.values()):  # read every connection until it would block
            try:
                self._read(stream, place, out)
            except (EOFError, ForeignPeer):  # (a foreign one: refused and counted, `auth.rejected`)
                self._drop(stream)
            except (OSError, ValueError) as e:  # a broken stream: nothing more from it is trusted
                self.num_bad_records += 1
                out.append(Received({"kind": "bad", "reason": str(e)}))
                self._drop(stream)
        return out

    def _read(self, stream: _Stream, place: Place, out: list[Received]) -> None:
        """A stream's records until it would block; a refused one (tampered, replayed, reordered, foreign)
        fails its transfer, counted, and the stream goes on."""
        while True:
            try:
                return stream.read(place, out)
            except AuthFailure as e:
                self.auth_failures += 1
                out.append(_refused(e.header, str(e)))

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)
            self._streams[sock] = _Stream(sock, self.auth)
            self._selector.register(sock, selectors.EVENT_READ)

    def _drop(self, stream: _Stream) -> None:
        self._streams.pop(stream.sock, None)
        self._selector.unregister(stream.sock)
        stream.sock.close()

    @property
    def rejected_connections(self) -> dict[str, int]:
        """Connections refused, by endpoint (`pdserve_rejected_connections_total`)."""
        return {"kv_tcp": self.auth.rejected}

    def close(self) -> None:
        for stream in list(self._streams.values()):
            self._drop(stream)
        self._selector.close()
        self._listener.close()
