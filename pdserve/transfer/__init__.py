"""KV delivery between workers: one sender/receiver interface, transports `shm` and `tcp` (no torch here)."""

from __future__ import annotations

from pdserve.transfer.base import KVReceiver, KVSender


def make_sender(transport: str, ring_mb: int = 16, timeout_s: float = 10.0) -> KVSender:
    if transport == "shm":
        from pdserve.transfer.shm import ShmSender
        return ShmSender(ring_bytes=ring_mb << 20, timeout_s=timeout_s)
    if transport == "tcp":
        from pdserve.transfer.tcp import TcpSender
        return TcpSender(timeout_s=timeout_s)
    raise ValueError(f"unknown transport {transport!r}; choose shm or tcp")


def make_receiver(transport: str, address: str = "", host: str = "127.0.0.1") -> KVReceiver:
    """shm binds `address` (an ipc:// endpoint); tcp binds a free port on `host`."""
    if transport == "shm":
        from pdserve.transfer.shm import ShmReceiver
        return ShmReceiver(address)
    if transport == "tcp":
        from pdserve.transfer.tcp import TcpReceiver
        return TcpReceiver(host)
    raise ValueError(f"unknown transport {transport!r}; choose shm or tcp")
