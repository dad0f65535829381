"""Per-connection protection of tcp records: AES-256-GCM (`cryptography`) keyed per connection.

AES-GCM, not ChaCha20-Poly1305: every host this runs on has AES and carry-less multiply instructions, where AES-GCM
seals 2-2.5x faster (7.6 vs 3.1 GB/s encrypting 4 MiB on the Xeon of docs/benchmarks.md, "Failures"), and on the tcp
path the sealing runs in series with the send: aead delivered 65-72% of plain at 10 Gbit/s with it against 48-50%
with ChaCha20-Poly1305 in the same runs.

After the hello (`pdserve.transfer.peer_auth`: the sender's nonce, the receiver's in its reply) both ends
derive the connection's key, HKDF-SHA256 of the deployment secret salted with both nonces, for the one
direction records travel (sender -> receiver). Every record on the connection takes the next value of the
sender's 64-bit counter; a protected record carries it in its prefix (in place of the xxh3, which the tag
replaces), authenticated, and it is the record's AEAD nonce. The receiver accepts a protected record only when
its tag verifies and its counter is above the last one it accepted on the connection: a replayed or
reordered record is refused, and so is a changed or foreign one (its tag fails). A refused record fails its
transfer (never used) and the connection goes on: the records behind it, other transfers' among them, still
count (dropping the connection would lose them silently). A record missing from the stream is missing from
its transfer, which then fails as incomplete. The sender waits for the receiver's reply (its nonce) only
before its first protected record on a connection, at most its send timeout; a decode worker answers in its
next poll.

Modes (`pdserve.core.pd.sensitivity.protection` picks one per record by its label and path):

    plain  payload as is, xxh3-64 in the prefix (a checksum against accidents, not against anyone)
    mac    payload as is + a 16-byte tag over prefix, meta and payload (AES-GCM with an empty plaintext and all
           of it as associated data: GMAC)
    aead   payload encrypted + a 16-byte tag; prefix and meta are associated data (authenticated, not secret)

A path crosses hosts when the connection's peer address is not a loopback address (127.0.0.0/8, ::1), as
each end sees it: a connection to this host's own non-loopback address counts as crossing (protection errs
on the side of more). For tests on one machine, `PDSERVE_KV_CROSS_HOST=always` in a process's environment
(test-only) makes every tcp connection of that process count as crossing hosts.
"""

from __future__ import annotations

import ipaddress
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from pdserve.core.pd.sensitivity import DEFAULT, MODES, acceptable, protection

TAG = 16
CROSS_HOST_ENV = "PDSERVE_KV_CROSS_HOST"
_INFO = b"pdserve kv tcp v1: sender to receiver"


class AuthFailure(Exception):
    """A record whose tag does not verify, or that is protected less than its label and path ask. `header`:
    the record's (as it arrived: unverified), set by the stream that refused it."""

    header: dict = {}


def crosses_hosts(peer_host: str) -> bool:
    """Whether a connection to `peer_host` (an address) leaves this host (the module docstring)."""
    if os.environ.get(CROSS_HOST_ENV) == "always":
        return True
    try:
        addr = ipaddress.ip_address(peer_host.split("%")[0])
    except ValueError:
        return True
    mapped = getattr(addr, "ipv4_mapped", None)
    return not (mapped or addr).is_loopback


class Seal:
    """One connection's protection, at either end: its key, its record counter, whether it crosses hosts."""

    def __init__(self, secret: bytes, sender_nonce: bytes, crosses: bool) -> None:
        self.secret, self.sender_nonce = secret, sender_nonce
        self._aead: AESGCM | None = None  # keyed once the receiver's nonce is known
        self.crosses = crosses
        self.seq = 0  # the sender's: the next record's
        self.last = -1  # the receiver's: the counter of the last protected record it accepted
        self._buf = bytearray()  # reused: [meta-and-prefix | payload | tag] (mac) or the plaintext (aead)
        self._out = bytearray()

    def key(self, receiver_nonce: bytes) -> Seal:
        key = HKDF(hashes.SHA256(), 32, salt=self.sender_nonce + receiver_nonce, info=_INFO).derive(self.secret)
        self._aead = AESGCM(key)
        return self

    @property
    def keyed(self) -> bool:
        return self._aead is not None

    def mode_for(self, header: dict) -> str:
        return protection(_label(header), self.crosses)

    def take(self) -> int:
        """The sender's counter for its next record."""
        self.seq += 1
        return self.seq - 1

    # ---- sender ------------------------------------------------------------------------------------------
    def seal(self, mode: str, head: bytes, pieces: list, nbytes: int, seq: int) -> list:
        """The wire buffers that follow `head` (prefix + meta, `seq` in it) for a record in `mode`."""
        nonce = seq.to_bytes(12, "little")
        if mode == "plain":
            return pieces
        if mode == "mac":
            buf = _fill(self._grow("_buf", len(head) + nbytes), [head, *pieces])
            return [*pieces, self._aead.encrypt(nonce, b"", buf[:len(head) + nbytes])]
        plain = _fill(self._grow("_buf", nbytes), pieces)
        out = self._grow("_out", nbytes + TAG)
        self._aead.encrypt_into(nonce, plain[:nbytes], head, out[:nbytes + TAG])
        return [out[:nbytes + TAG]]

    # ---- receiver ----------------------------------------------------------------------------------------
    def open(self, mode: str, whole: memoryview, head_len: int, nbytes: int, seq: int) -> memoryview:
        """The payload of a protected record read whole (`whole`: prefix and meta, `head_len` bytes, then the
        payload or ciphertext, then the tag), verified (AEAD: decrypted); raises `AuthFailure`."""
        record = whole[head_len:]
        if seq <= self.last:
            raise AuthFailure(f"a replayed or reordered record (counter {seq}, last accepted {self.last})")
        nonce = seq.to_bytes(12, "little")
        try:
            if mode == "mac":
                self._aead.decrypt(nonce, record[nbytes:nbytes + TAG], whole[:head_len + nbytes])
                payload = record[:nbytes]
            else:
                payload = self._grow("_out", nbytes)[:nbytes]
                self._aead.decrypt_into(nonce, record[:nbytes + TAG], whole[:head_len], payload)
            self.last = seq
            return payload
        except InvalidTag:
            raise AuthFailure(f"a {mode} record failed its tag (tampered, replayed, reordered or foreign)")

    def check(self, mode: str, header: dict) -> None:
        """Refuse a record protected less than its label and path ask (`AuthFailure`)."""
        label = _label(header)
        if not acceptable(mode, label, self.crosses):
            raise AuthFailure(f"a {mode} record where {protection(label, self.crosses)} is required")

    def _grow(self, name: str, size: int) -> memoryview:
        buf = getattr(self, name)
        if len(buf) < size:
            buf = bytearray(size)
            setattr(self, name, buf)
        return memoryview(buf)


def _label(header: dict) -> str | None:
    """A record's label: a chunk's (the default when it names none), None for a control record."""
    return header.get("label", DEFAULT) if header.get("kind") == "chunk" else None


def _fill(dest: memoryview, sources: list) -> memoryview:
    at = 0
    for src in sources:
        view = memoryview(src).cast("B")
        dest[at:at + len(view)] = view
        at += len(view)
    return dest


MODE_CODES = {mode: i for i, mode in enumerate(MODES)}  # the prefix's mode byte


def protection_report(endpoint) -> tuple[dict[str, int], dict[str, int]]:
    """A sender's payload bytes by path and mode ({"tcp:aead": n}) and a receiver's refused records by path
    ({"tcp": n}), summed over the paths of an `auto` one (`senders`, `receivers`); a one-path endpoint is named
    by its `path` (`mooncake`), tcp when it has none."""
    parts = (getattr(endpoint, "senders", None) or getattr(endpoint, "receivers", None)
             or {getattr(endpoint, "path", "tcp"): endpoint})  # (one path: tcp, or mooncake's own name)
    sent, refused = {}, {}
    for path, part in parts.items():
        for mode, n in getattr(part, "protected_bytes", {}).items():
            sent[f"{path}:{mode}"] = n
        if hasattr(part, "auth_failures"):
            refused[path] = part.auth_failures
    return sent, refused
