"""KV delivery between workers: one sender/receiver interface, transports `shm` and `tcp`, and `auto` (both,
with a path chosen per transfer: `pdserve.transfer.paths`). No torch here."""

from __future__ import annotations

from pdserve.transfer.base import KVReceiver, KVSender


TRANSPORTS = ("shm", "tcp", "auto")


def make_sender(transport: str, ring_mb: int = 16, timeout_s: float = 10.0) -> KVSender:
    """`auto`: both, each transfer on the path measured best for its pair (`pdserve.transfer.paths`)."""
    if transport == "auto":
        from pdserve.transfer.paths import PathSender
        return PathSender({t: make_sender(t, ring_mb, timeout_s) for t in ("shm", "tcp")})
    if transport == "shm":
        from pdserve.transfer.shm import ShmSender
        return ShmSender(ring_bytes=ring_mb << 20, timeout_s=timeout_s)
    if transport == "tcp":
        from pdserve.transfer.tcp import TcpSender
        return TcpSender(timeout_s=timeout_s)
    raise ValueError(f"unknown transport {transport!r}; choose shm, tcp or auto")


def make_receiver(transport: str, address: str = "", host: str = "127.0.0.1") -> KVReceiver:
    """shm binds `address` (an ipc:// endpoint); tcp binds a free port on `host`; auto both."""
    if transport == "auto":
        from pdserve.transfer.paths import MultiReceiver
        return MultiReceiver({t: make_receiver(t, address, host) for t in ("shm", "tcp")})
    if transport == "shm":
        from pdserve.transfer.shm import ShmReceiver
        return ShmReceiver(address)
    if transport == "tcp":
        from pdserve.transfer.tcp import TcpReceiver
        return TcpReceiver(host)
    raise ValueError(f"unknown transport {transport!r}; choose shm, tcp or auto")
