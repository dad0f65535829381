"""Peers of one deployment prove it when they connect: an HMAC hello keyed by a per-deployment secret.

`pdserve serve` generates a 32-byte secret at start and hands it to its workers in their environment
(`PDSERVE_DEPLOYMENT_SECRET`, hex), never on a command line (`/proc/<pid>/cmdline` is world-readable; a
process's environment is readable only by its user). A tcp sender opens every connection with a hello:

    8 bytes  wall-clock time (ns, little-endian)
    16 bytes random nonce
    32 bytes HMAC-SHA256(secret, time || nonce)

The receiver reads nothing else from a connection before a valid hello; one whose MAC does not verify,
whose time is more than `MAX_SKEW_S` off, or whose nonce it has seen (a replay) is closed and counted
(`pdserve_rejected_connections_total{endpoint="kv_tcp"}`). One round trip less than a challenge, and the
receiver stays non-blocking. The receiver answers a valid hello with a reply of its own:

    16 bytes random nonce
    32 bytes HMAC-SHA256(secret, "reply" || the hello's nonce || this nonce)

which proves the receiver to the sender, and gives both ends the two nonces the connection's record key is
derived from (`pdserve.transfer.kv_seal`). A process without the variable (a test pairing sender and receiver
in one process) uses a secret of its own, so its peers must be in the same process.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
import time
from collections import OrderedDict

ENV = "PDSERVE_DEPLOYMENT_SECRET"
HELLO = struct.Struct("<Q16s32s")
REPLY = struct.Struct("<16s32s")
MAX_SKEW_S = 60.0
MAX_NONCES = 65536

_local_secret = secrets.token_bytes(32)


def new_secret() -> str:
    """A fresh deployment secret, hex (for a child's environment)."""
    return secrets.token_hex(32)


def valid_secret(value: str) -> bool:
    """A deployment secret as given in the environment: 32 bytes, hex."""
    try:
        return len(bytes.fromhex(value)) == 32
    except ValueError:
        return False


def deployment_secret() -> bytes:
    value = os.environ.get(ENV)
    return bytes.fromhex(value) if value else _local_secret


def hello(secret: bytes | None = None) -> bytes:
    key = deployment_secret() if secret is None else secret
    stamp, nonce = time.time_ns(), secrets.token_bytes(16)
    return HELLO.pack(stamp, nonce, _mac(key, stamp, nonce))


class HelloCheck:
    """The receiver's side: verifies hellos, remembers recent nonces."""

    def __init__(self, secret: bytes | None = None) -> None:
        self.secret = deployment_secret() if secret is None else secret
        self.seen: OrderedDict[bytes, None] = OrderedDict()
        self.rejected = 0

    def verify(self, data: bytes) -> bool:
        stamp, nonce, mac = HELLO.unpack(data)
        ok = (hmac.compare_digest(mac, _mac(self.secret, stamp, nonce))
              and abs(time.time_ns() - stamp) <= MAX_SKEW_S * 1e9 and nonce not in self.seen)
        if not ok:
            self.rejected += 1
            return False
        self.seen[nonce] = None
        while len(self.seen) > MAX_NONCES:
            self.seen.popitem(last=False)
        return True


def hello_nonce(data: bytes) -> bytes:
    return HELLO.unpack(data)[1]


def reply(secret: bytes, sender_nonce: bytes) -> tuple[bytes, bytes]:
    """The receiver's answer to a verified hello, and its nonce."""
    nonce = secrets.token_bytes(16)
    return REPLY.pack(nonce, _reply_mac(secret, sender_nonce, nonce)), nonce


def check_reply(secret: bytes, sender_nonce: bytes, data: bytes) -> bytes | None:
    """The receiver's nonce from its reply, or None when the reply is not this deployment's."""
    nonce, mac = REPLY.unpack(data)
    return nonce if hmac.compare_digest(mac, _reply_mac(secret, sender_nonce, nonce)) else None


def _reply_mac(key: bytes, sender_nonce: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, b"reply" + sender_nonce + nonce, hashlib.sha256).digest()


def _mac(key: bytes, stamp: int, nonce: bytes) -> bytes:
    return hmac.new(key, struct.pack("<Q", stamp) + nonce, hashlib.sha256).digest()
