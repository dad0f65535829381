"""Every ZeroMQ socket of a deployment speaks CurveZMQ with keys only its processes know.

The control plane (the gateway's commands to each worker, the workers' events and heartbeats to the gateway)
and the shm transport's ring announcements run over ZeroMQ. In a deployment (`PDSERVE_DEPLOYMENT_SECRET` in
the environment, `pdserve.transfer.peer_auth`), each such socket uses CURVE with one key pair derived from the
deployment's secret: a bound socket is a CURVE server with it, a connecting one a client that names it as the
server's key. The CURVE handshake needs the server's public key, which here is as secret as the secret itself
(derived from it, never written anywhere): a process outside the deployment — a plain socket, or CURVE with
any other key — fails the handshake, its messages are never delivered, and every refused attempt is counted
(`Refusals`, `pdserve_rejected_connections_total{endpoint="control"|"kv_shm"}`). Messages are encrypted too.

A process without the variable (an in-process test) uses plain sockets: all its peers are in it.
"""

from __future__ import annotations

import hashlib
import itertools
import os

import zmq
from zmq.utils import z85

from pdserve.transfer.peer_auth import ENV

REFUSED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_monitors = itertools.count()


def curve_keys() -> tuple[bytes, bytes] | None:
    """(public, secret) Z85 keys of this deployment; None outside one."""
    value = os.environ.get(ENV)
    if not value:
        return None
    secret = z85.encode(hashlib.sha256(b"pdserve-curve|" + bytes.fromhex(value)).digest())
    return zmq.curve_public(secret), secret


def secure_server(sock: zmq.Socket) -> None:
    """Before `bind`: accept only this deployment's peers."""
    keys = curve_keys()
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey = keys
        sock.curve_server = True


def secure_client(sock: zmq.Socket) -> None:
    """Before `connect`: talk to this deployment's servers."""
    keys = curve_keys()
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey = keys
        sock.curve_serverkey = keys[0]


class Refusals:
    """Counts connection attempts a bound socket refused (failed handshakes), from its monitor."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.refused = 0
        self._monitor: zmq.Socket | None = None
        if curve_keys() is None:
            return
        addr = f"inproc://pdserve-refusals-{os.getpid()}-{next(_monitors)}"
        sock.monitor(addr, REFUSED)
        self._monitor = sock.context.socket(zmq.PAIR, socket_class=zmq.Socket)  # (plain, also in asyncio)
        self._monitor.connect(addr)

    def count(self) -> int:
        """Refused attempts so far (reads the monitor's queued events; never blocks)."""
        mon = self._monitor
        while mon is not None and mon.poll(0):
            frames = mon.recv_multipart()
            self.refused += len(frames) == 2  # [event + value, endpoint]
        return self.refused

    def close(self) -> None:
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
