"""Path choice: a worker pair with more than one transport (`--transport auto`: shm and tcp) sends each transfer
on the path measured best for that pair, and moves to another when one fails.

A decode worker under `auto` listens on every transport (`MultiReceiver`); its address is the composite
`paths:shm=ipc://...;tcp=tcp://host:port` (a plain `ipc://` or `tcp://` address is a one-path peer). A
sender of one transport (a worker that joined an `auto` deployment: tcp) takes its own path of a composite
address (`OnePath`), as a Mooncake initiator picks the protocol it has from a segment's descriptors; a peer
with no such path is a `TransferError` at the transfer's first send, not a lapse. The
prefill worker's `PathSender` keeps one sender per transport and, per destination, a `PathChooser`:

* a transfer stays on one path from its first chunk to its `done` (the receiver's `done` must come after the
  transfer's chunks, which only one ordered stream guarantees);
* each path is measured by its chunks' handoff time (seconds inside the transport's `send_chunk` per byte,
  the per-chunk overhead included, as an EWMA), so it reflects both bandwidth and per-chunk latency;
* the first `PROBE_TRANSFERS` transfers to a destination go on each path in turn; then every transfer takes
  the fastest path, except one in `REPROBE_EVERY`, which goes on another to keep its estimate fresh;
* each path has a circuit breaker (`pdserve.core.pd.breaker`, the same rule `OnePath` follows): a path whose
  breaker is open is not chosen, and a send on it fails at once (`PathOpen`); a transfer whose first chunk
  failed goes on another path at once (counted as a failover); a failure later in a transfer fails it, as on
  one path. With no path up, the transfer fails at once (its decode worker recomputes).

Counted per path: transfers started (`transfers`), failovers (`failovers`), as the worker's stats report.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.core.pd.breaker import Breakers
from pdserve.transfer.base import Capabilities, KVReceiver, KVSender, Place, Received, TransferError, scratch_place

PROBE_TRANSFERS = 2
REPROBE_EVERY = 32
RATE_EWMA = 0.2
MAX_TRACKED_XFERS = 1 << 16  # transfers whose path is remembered until their `done` (the oldest forgotten)
PREFIX = "paths:"
SCHEMES = {"ipc://": "shm", "tcp://": "tcp", "mooncake://": "mooncake"}


def parse_dest(dest: str) -> dict[str, str]:
    """Path name -> address, from a composite `paths:...` address or a plain one."""
    if dest.startswith(PREFIX):
        return dict(part.split("=", 1) for part in dest[len(PREFIX):].split(";") if part)
    for scheme, path in SCHEMES.items():
        if dest.startswith(scheme):
            return {path: dest}
    raise ValueError(f"KV address {dest!r}: expected ipc://, tcp://, mooncake:// or {PREFIX}")


def path_address(dest: str, path: str) -> str:
    """`path`'s address in `dest` (composite or plain); `TransferError` when it has none."""
    try:
        addr = parse_dest(dest).get(path)
    except ValueError as e:
        raise TransferError(str(e)) from e
    if addr is None:
        raise TransferError(f"KV address {dest!r} has no {path} path")
    return addr


@dataclass
class PathStats:
    seconds_per_byte: float | None = None  # EWMA of its chunks' handoff
    transfers: int = 0


class PathOpen(TransferError):
    """A send refused at once: its path's breaker is open (`pdserve.core.pd.breaker`)."""


def guarded(breakers: Breakers, dest: str, path: str, send, clock=time.monotonic):
    """`send()` through the breaker of (`dest`, `path`): refused at once when it is open; its failure (and
    how long it took) or success told to it."""
    start = clock()
    if not breakers.allow(dest, path, start):
        raise PathOpen(f"KV path {path} to {dest} is open (its breaker): no new sends until a probe goes through")
    try:
        out = send()
    except TransferError:
        now = clock()
        breakers.of(dest, path).failed(now, now - start)
        raise
    breakers.of(dest, path).succeeded()
    return out


class PathChooser:
    def __init__(self, clock=time.monotonic, breakers: Breakers | None = None) -> None:
        self.clock = clock
        self.breakers = breakers or Breakers()
        self.stats: dict[tuple[str, str], PathStats] = {}
        self._picks: Counter = Counter()  # dest -> transfers started

    def _of(self, dest: str, path: str) -> PathStats:
        return self.stats.setdefault((dest, path), PathStats())

    def pick(self, dest: str, paths: Sequence[str], exclude: str | None = None) -> str | None:
        """The path for a new transfer to `dest` (None: none but `exclude` whose breaker takes it)."""
        now = self.clock()
        up = [p for p in paths if p != exclude and self.breakers.up(dest, p, now)]
        if not up:
            return None
        unprobed = [p for p in up if self._of(dest, p).transfers < PROBE_TRANSFERS]
        n = self._picks[dest]
        if unprobed:
            choice = min(unprobed, key=lambda p: self._of(dest, p).transfers)
        else:
            best = min(up, key=lambda p: self._of(dest, p).seconds_per_byte or 0.0)
            others = [p for p in up if p != best]
            choice = others[(n // REPROBE_EVERY) % len(others)] if others and n % REPROBE_EVERY == 0 else best
        self._picks[dest] += 1
        self._of(dest, choice).transfers += 1
        return choice

    def best(self, dest: str, paths: Sequence[str]) -> str:
        """The fastest path measured to `dest` (for a message outside any transfer)."""
        return min(paths, key=lambda p: self._of(dest, p).seconds_per_byte or 0.0)

    def observe(self, dest: str, path: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0:
            return
        st = self._of(dest, path)
        spb = seconds / nbytes
        st.seconds_per_byte = spb if st.seconds_per_byte is None else (
            st.seconds_per_byte + RATE_EWMA * (spb - st.seconds_per_byte))


class PathSender:
    """A `KVSender` over several transports (`--transport auto`)."""

    def __init__(self, senders: dict[str, KVSender], chooser: PathChooser | None = None) -> None:
        self.senders = senders
        self.chooser = chooser or PathChooser()
        self.max_chunk_bytes = min(s.max_chunk_bytes for s in senders.values())
        self.capabilities = Capabilities.of_any([s.capabilities for s in senders.values()])
        self._routes: dict[str, dict[str, str]] = {}  # dest -> path -> address
        self._xfers: OrderedDict = OrderedDict()  # transfer id -> its path, until its done or fail
        self.transfers: Counter = Counter()  # path -> transfers started on it
        self.failovers = 0

    @property
    def breakers(self) -> Breakers:
        return self.chooser.breakers

    def share_source(self, handle, buffer) -> None:
        for s in self.senders.values():
            if s.capabilities.zero_copy:
                s.share_source(handle, buffer)

    def _route(self, dest: str) -> dict[str, str]:
        route = self._routes.get(dest)
        if route is None:
            route = self._routes[dest] = {p: a for p, a in parse_dest(dest).items() if p in self.senders}
            if not route:
                raise TransferError(f"no transport in common with {dest!r}")
        return route

    def _start(self, dest: str, xfer: str, exclude: str | None = None) -> str | None:
        path = self.chooser.pick(dest, list(self._route(dest)), exclude)
        if path is not None:
            self._xfers[xfer] = path
            self.transfers[path] += 1
            while len(self._xfers) > MAX_TRACKED_XFERS:
                self._xfers.popitem(last=False)
        return path

    def send_chunk(self, dest: str, header: dict, pieces: list[memoryview]) -> bool:
        xfer = header["xfer"]
        path = self._xfers.get(xfer)
        first = path is None
        if first:
            path = self._start(dest, xfer)
            if path is None:
                raise PathOpen(f"every KV path to {dest} is open (their breakers)")
        try:
            return self._send(dest, path, header, pieces)
        except TransferError:
            other = self._start(dest, xfer, exclude=path) if first else None
            if other is None:
                raise
            self.failovers += 1
            return self._send(dest, other, header, pieces)

    def _send(self, dest: str, path: str, header: dict, pieces: list[memoryview]) -> bool:
        start = time.perf_counter()
        in_place = guarded(self.chooser.breakers, dest, path,
                           lambda: self.senders[path].send_chunk(self._route(dest)[path], header, pieces),
                           self.chooser.clock)
        self.chooser.observe(dest, path, sum(len(p) for p in pieces), time.perf_counter() - start)
        return in_place

    def send_control(self, dest: str, header: dict) -> None:
        route = self._route(dest)
        xfer = header.get("xfer")
        path = self._xfers.get(xfer) or self.chooser.best(dest, list(route))
        if header.get("kind") in ("done", "fail"):
            self._xfers.pop(xfer, None)
        guarded(self.chooser.breakers, dest, path, lambda: self.senders[path].send_control(route[path], header),
                self.chooser.clock)

    def position(self, dest: str) -> tuple:
        return tuple((p, self.senders[p].position(a)) for p, a in self._route(dest).items())

    def consumed(self, dest: str, mark: tuple) -> bool:
        route = self._route(dest)
        return all(self.senders[p].consumed(route[p], m) for p, m in mark)

    def forget(self, dest: str) -> None:
        route = self._routes.pop(dest, None) or {}
        for path, addr in route.items():
            self.senders[path].forget(addr)

    def close(self) -> None:
        for s in self.senders.values():
            s.close()


class OnePath:
    """A sender of one transport (`path`) that takes a peer's address whole: a composite `paths:` one is read
    for `path`'s address (`path_address`). Each peer's sends go through its path's breaker (`guarded`). Every
    other attribute, read or set, is the wrapped sender's."""

    _OWN = frozenset({"path", "sender", "_addrs", "breakers", "clock"})

    def __init__(self, path: str, sender: KVSender, breakers: Breakers | None = None,
                 clock=time.monotonic) -> None:
        self.path, self.sender = path, sender
        self.breakers = breakers or Breakers()
        self.clock = clock
        self._addrs: dict[str, str] = {}  # dest -> its `path` address

    def __getattr__(self, name: str):
        if name in self._OWN:  # (not set yet: no recursion through `self.sender`)
            raise AttributeError(name)
        return getattr(self.sender, name)

    def __setattr__(self, name: str, value) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.sender, name, value)

    def _addr(self, dest: str) -> str:
        addr = self._addrs.get(dest)
        if addr is None:
            addr = self._addrs[dest] = path_address(dest, self.path)
        return addr

    def send_chunk(self, dest: str, header: dict, pieces: list[memoryview]) -> bool:
        addr = self._addr(dest)
        return guarded(self.breakers, dest, self.path, lambda: self.sender.send_chunk(addr, header, pieces),
                       self.clock)

    def send_control(self, dest: str, header: dict) -> None:
        addr = self._addr(dest)
        guarded(self.breakers, dest, self.path, lambda: self.sender.send_control(addr, header), self.clock)

    def position(self, dest: str):
        return self.sender.position(self._addr(dest))

    def consumed(self, dest: str, mark) -> bool:
        return self.sender.consumed(self._addr(dest), mark)

    def forget(self, dest: str) -> None:
        addr = self._addrs.pop(dest, None)
        if addr is not None:  # (never sent to: nothing to forget)
            self.sender.forget(addr)

    def close(self) -> None:
        self.sender.close()


class MultiReceiver:
    """A `KVReceiver` listening on several transports; polled (no wakeup socket: tcp has none)."""

    wakeup = None

    def __init__(self, receivers: dict[str, KVReceiver]) -> None:
        self.receivers = receivers
        self.address = PREFIX + ";".join(f"{p}={r.address}" for p, r in receivers.items())

    def arm(self) -> bool:
        return True

    def poll(self, timeout_ms: int = 0, place: Place = scratch_place) -> list[Received]:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            out = [m for r in self.receivers.values() for m in r.poll(0, place)]
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(0.0005)

    @property
    def rejected_connections(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.receivers.values():
            for endpoint, n in r.rejected_connections.items():
                out[endpoint] = out.get(endpoint, 0) + n
        return out

    def close(self) -> None:
        for r in self.receivers.values():
            r.close()
