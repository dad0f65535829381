"""KV delivery between workers: one sender/receiver interface, and the transports by name, declared once here
(`TRANSPORTS`): `shm` (same host), `tcp` and `mooncake` (Mooncake Transfer Engine, the optional
`pdserve[mooncake]`: `pdserve.transfer.mooncake`), plus `auto` (shm and tcp, with a path chosen per transfer:
`pdserve.transfer.paths`; mooncake stays out of it, as an optional package). Every flag and check of a
transport name reads this table (`names`, `check`, `capabilities`); a sender declares what it can do in its
class's `capabilities`. No torch here.

A new transport is a sender and a receiver class and one entry in `TRANSPORTS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdserve.core.pd.breaker import BreakerPolicy, Breakers
from pdserve.errors import InvalidRequestError
from pdserve.transfer.base import Capabilities, KVReceiver, KVSender
from pdserve.transfer.mooncake import MooncakeReceiver, MooncakeSender
from pdserve.transfer.paths import MultiReceiver, OnePath, PathChooser, PathSender
from pdserve.transfer.shm import ShmReceiver, ShmSender
from pdserve.transfer.tcp import TcpReceiver, TcpSender


@dataclass(frozen=True)
class Transport:
    sender: type  # its KVSender class (which declares its `capabilities`)
    make_sender: Callable[..., KVSender]  # (ring_mb, timeout_s, **its options)
    make_receiver: Callable[..., KVReceiver]  # (address: shm's ipc:// endpoint, host: tcp's interface, **options)
    options: tuple[str, ...] = ()  # the keyword settings it takes (`make_sender`'s and `make_receiver`'s)
    in_auto: bool = True  # one of `auto`'s paths


TRANSPORTS: dict[str, Transport] = {
    "shm": Transport(ShmSender, lambda ring_mb, timeout_s: ShmSender(ring_bytes=ring_mb << 20, timeout_s=timeout_s),
                     lambda address, host: ShmReceiver(address)),
    "tcp": Transport(TcpSender, lambda ring_mb, timeout_s: TcpSender(timeout_s=timeout_s),
                     lambda address, host: TcpReceiver(host)),
    "mooncake": Transport(MooncakeSender,  # (not in auto: an optional package)
                          lambda ring_mb, timeout_s, mooncake_protocol: MooncakeSender(timeout_s, mooncake_protocol),
                          lambda address, host, mooncake_protocol: MooncakeReceiver(host, mooncake_protocol),
                          options=("mooncake_protocol",), in_auto=False),
}
AUTO = "auto"  # every transport above `in_auto`, each transfer on the path measured best for its worker pair


def auto_paths() -> list[str]:
    return [name for name, t in TRANSPORTS.items() if t.in_auto]


def speaks(transport: str, path: str) -> bool:
    """Whether workers on `transport` take KV on `path` (a joined worker's `tcp`): its own, or one of auto's."""
    return transport == path or (transport == AUTO and path in auto_paths())


def _options(transport: str, given: dict) -> dict:
    return {k: given[k] for k in TRANSPORTS[transport].options}


def names() -> tuple[str, ...]:
    return (*TRANSPORTS, AUTO)


def check(transport: str, flag: str = "transport") -> str:
    """`transport` when it is one of `names()`; else a one-line error."""
    if transport not in names():
        raise InvalidRequestError(f"--{flag} must be {', '.join(names()[:-1])} or {AUTO}, got {transport!r}",
                                  param=flag)
    if transport == "mooncake":
        from pdserve.mooncake import unavailable
        if (why := unavailable()) is not None:
            raise InvalidRequestError(f"--{flag} mooncake: {why}", param=flag)
    return transport


def capabilities(transport: str) -> Capabilities:
    """What `transport` can do (`auto`: what any of its paths can)."""
    if check(transport) != AUTO:
        return TRANSPORTS[transport].sender.capabilities
    return Capabilities.of_any([TRANSPORTS[t].sender.capabilities for t in auto_paths()])


def make_sender(transport: str, ring_mb: int = 16, timeout_s: float = 10.0,
                policy: BreakerPolicy | None = None, mooncake_protocol: str = "tcp") -> KVSender:
    """`auto`: one of each, each transfer on the path measured best for its pair (`pdserve.transfer.paths`);
    one transport: it takes its own path of a peer's composite address (`OnePath`: a worker joining an `auto`
    deployment). Either way each (receiver, path) has a breaker (`pdserve.core.pd.breaker`), and one connect or
    send waits `policy.bound(timeout_s)` at most, well below the lease."""
    policy = policy or BreakerPolicy()
    timeout_s = policy.bound(timeout_s)
    given = {"mooncake_protocol": mooncake_protocol}
    if check(transport) == AUTO:
        return PathSender({t: TRANSPORTS[t].make_sender(ring_mb, timeout_s, **_options(t, given))
                           for t in auto_paths()}, PathChooser(breakers=Breakers(policy)))
    return OnePath(transport, TRANSPORTS[transport].make_sender(ring_mb, timeout_s, **_options(transport, given)),
                   Breakers(policy))


def make_receiver(transport: str, address: str = "", host: str = "127.0.0.1",
                  mooncake_protocol: str = "tcp") -> KVReceiver:
    """shm binds `address` (an ipc:// endpoint); tcp binds a free port on `host`; mooncake a free port and a
    transfer engine on `host` (over `mooncake_protocol`); auto shm and tcp."""
    if check(transport) == AUTO:
        return MultiReceiver({t: make_receiver(t, address, host) for t in auto_paths()})
    given = {"mooncake_protocol": mooncake_protocol}
    return TRANSPORTS[transport].make_receiver(address, host, **_options(transport, given))
