"""KV delivery between workers: one sender/receiver interface, and the transports by name, declared once here
(`TRANSPORTS`): `shm` (same host) and `tcp`, plus `auto` (every one of them, with a path chosen per transfer:
`pdserve.transfer.paths`). Every flag and check of a transport name reads this table (`names`, `check`,
`capabilities`); a sender declares what it can do in its class's `capabilities`. No torch here.

A new transport is a sender and a receiver class and one entry in `TRANSPORTS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdserve.core.pd.breaker import BreakerPolicy, Breakers
from pdserve.errors import InvalidRequestError
from pdserve.transfer.base import Capabilities, KVReceiver, KVSender
from pdserve.transfer.paths import MultiReceiver, OnePath, PathChooser, PathSender
from pdserve.transfer.shm import ShmReceiver, ShmSender
from pdserve.transfer.tcp import TcpReceiver, TcpSender


@dataclass(frozen=True)
class Transport:
    sender: type  # its KVSender class (which declares its `capabilities`)
    make_sender: Callable[[int, float], KVSender]  # (ring_mb, timeout_s)
    make_receiver: Callable[[str, str], KVReceiver]  # (address: shm's ipc:// endpoint, host: tcp's interface)


TRANSPORTS: dict[str, Transport] = {
    "shm": Transport(ShmSender, lambda ring_mb, timeout_s: ShmSender(ring_bytes=ring_mb << 20, timeout_s=timeout_s),
                     lambda address, host: ShmReceiver(address)),
    "tcp": Transport(TcpSender, lambda ring_mb, timeout_s: TcpSender(timeout_s=timeout_s),
                     lambda address, host: TcpReceiver(host)),
}
AUTO = "auto"  # every transport above, each transfer on the path measured best for its worker pair


def names() -> tuple[str, ...]:
    return (*TRANSPORTS, AUTO)


def check(transport: str, flag: str = "transport") -> str:
    """`transport` when it is one of `names()`; else a one-line error."""
    if transport not in names():
        raise InvalidRequestError(f"--{flag} must be {', '.join(names()[:-1])} or {AUTO}, got {transport!r}",
                                  param=flag)
    return transport


def capabilities(transport: str) -> Capabilities:
    """What `transport` can do (`auto`: what any of its paths can)."""
    if check(transport) != AUTO:
        return TRANSPORTS[transport].sender.capabilities
    return Capabilities.of_any([t.sender.capabilities for t in TRANSPORTS.values()])


def make_sender(transport: str, ring_mb: int = 16, timeout_s: float = 10.0,
                policy: BreakerPolicy | None = None) -> KVSender:
    """`auto`: one of each, each transfer on the path measured best for its pair (`pdserve.transfer.paths`);
    one transport: it takes its own path of a peer's composite address (`OnePath`: a worker joining an `auto`
    deployment). Either way each (receiver, path) has a breaker (`pdserve.core.pd.breaker`), and one connect or
    send waits `policy.bound(timeout_s)` at most, well below the lease."""
    policy = policy or BreakerPolicy()
    timeout_s = policy.bound(timeout_s)
    if check(transport) == AUTO:
        return PathSender({t: TRANSPORTS[t].make_sender(ring_mb, timeout_s) for t in TRANSPORTS},
                          PathChooser(breakers=Breakers(policy)))
    return OnePath(transport, TRANSPORTS[transport].make_sender(ring_mb, timeout_s), Breakers(policy))


def make_receiver(transport: str, address: str = "", host: str = "127.0.0.1") -> KVReceiver:
    """shm binds `address` (an ipc:// endpoint); tcp binds a free port on `host`; auto both."""
    if check(transport) == AUTO:
        return MultiReceiver({t: make_receiver(t, address, host) for t in TRANSPORTS})
    return TRANSPORTS[transport].make_receiver(address, host)
