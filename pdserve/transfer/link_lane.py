"""One link's sending lane: a thread that owns every send to one receiving worker, so no send ever runs on
the compute thread.

The compute thread (`pdserve.transfer.outbox.Outbox`) queues chunks in the link's `LinkQueue` (delivery
order: `pdserve.core.pd.delivery`) and control records in the lane's FIFO, and returns. The lane sends control
records first (`alive`), then the chunk the policy picks, one at a time: the transport takes a chunk only as
the link drains (a tcp socket's unsent bytes are held under `TCP_NOTSENT_LOWAT`, a shm ring has its
capacity), so the order of what waits is decided here, not in a kernel buffer, and each chunk's send time
measures the link's real rate (`LinkStats`). A transfer's closing record (`done` or `fail`) waits in the
lane until the transfer's last queued chunk went, then goes; the compute thread hears of it
(`Outbox.pump` → `on_closed(out, mark)`). A send that fails (the transport's deadline passed: a stalled link,
a stopped receiver) fails its transfer: its queued chunks are dropped and its closing record says `fail`.
With `--link-gbps` the lane also paces chunks by a token bucket (an emulated slower link).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.core.pd.delivery import LinkQueue, TokenBucket
from pdserve.transfer.base import KVSender, TransferError
from pdserve.transfer.paths import PathOpen

IDLE_WAIT_S = 0.5  # a lane with nothing to send rechecks this often (it is woken on new work)


@dataclass
class Close:
    out: object  # the transfer's `Outbound`
    prefilled: bool  # False: aborted or failed: a `fail` record
    first_token: int | None = None


RATE_WINDOW = 16  # a link's measured rate: over its last this many chunks sent


@dataclass
class LinkStats:
    busy_s: float = 0.0  # inside the transport's sends that went through
    busy_since: float | None = None  # a send in progress since (monotonic)
    bytes: int = 0
    chunks: int = 0
    demand_s: float = 0.0
    demand_since: float | None = None
    window: deque = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))  # (bytes, seconds) of recent sends

    def rate(self, link_rate: float | None) -> float | None:
        """The link's capacity: its throttle's rate, else the rate its last chunks went at (None: unknown). A
        window, not the link's lifetime: a stalled receiver or a failed send does not drag it down for good."""
        if link_rate:
            return link_rate
        seconds = sum(s for _, s in self.window)
        return sum(b for b, _ in self.window) / seconds if seconds > 0 else None

    def sent(self, nbytes: int, seconds: float) -> None:
        """A chunk of `nbytes` went through in `seconds` (inside the transport's send)."""
        self.busy_s += seconds
        if seconds > 0:
            self.window.append((nbytes, seconds))

    def landing_rate(self, link_rate: float | None) -> float | None:
        """The rate queued bytes go at now: the throttle's, unless the transport went slower lately (another
        sender on the same receiver's port, a loaded host); else the transport's recent rate."""
        measured = self.rate(None)
        if link_rate and measured:
            return min(link_rate, measured)
        return link_rate or measured

    def as_dict(self, link_rate: float | None, now: float) -> dict:
        demand = self.demand_s + (now - self.demand_since if self.demand_since is not None else 0.0)
        busy = self.busy_s + (now - self.busy_since if self.busy_since is not None else 0.0)
        return {"busy_s": busy, "bytes": self.bytes, "demand_s": demand,
                "capacity": self.rate(link_rate), "chunks": self.chunks}


@dataclass(eq=False)
class Lane:
    """The state of one link, guarded by the outbox's lock (`cond`); its thread runs `run`."""
    name: str
    queue: LinkQueue
    cond: threading.Condition
    sender: KVSender
    events: deque  # (kind, ...) for the compute thread: ("closed", out, mark)
    bucket: TokenBucket | None = None
    stats: LinkStats = field(default_factory=LinkStats)
    controls: deque = field(default_factory=deque)  # (dest, header) or a `Close` ready to go
    closes: dict = field(default_factory=dict)  # xfer -> `Close` waiting for its transfer's queued chunks
    pending: dict = field(default_factory=dict)  # xfer -> chunks queued
    failures: dict = field(default_factory=dict)  # reason -> count (the outbox adds them up)
    forget: set = field(default_factory=set)  # receivers that died: the transport drops their connection
    stopped: bool = False
    sending: bool = False
    on_sent: Callable | None = None  # (chunk, by_reference, seconds): the outbox's counters

    def start(self) -> None:
        threading.Thread(target=self.run, name=f"kv-lane-{self.name}", daemon=True).start()

    # ---- under the lock, from either thread ---------------------------------------------------------------
    def settle_close(self, xfer: str) -> None:
        """`xfer` has nothing queued: its closing record (if asked for) is ready to go."""
        if not self.pending.get(xfer) and xfer in self.closes:
            self.controls.append(self.closes.pop(xfer))

    def idle(self) -> bool:
        return not (self.controls or len(self.queue) or self.forget or self.sending)

    # ---- the lane's thread ---------------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            with self.cond:
                work = self._next()
                if work is None:
                    return
            self._do(work)

    def _next(self):
        """Wait for something to send (the lock held) and take it."""
        while not self.stopped:
            if self.forget:
                return ("forget", self.forget.pop())
            if self.controls:
                self.sending = True
                return ("control", self.controls.popleft())
            wait = IDLE_WAIT_S
            if len(self.queue):
                wait = 0.0 if self.bucket is None else self.bucket.wait_s(time.monotonic())
                if wait <= 0:
                    self.sending = True
                    return ("chunk", self.queue.pick().key)
            self.cond.wait(wait)
        return None

    def _do(self, work) -> None:
        kind, item = work
        if kind == "forget":
            self.sender.forget(item)
        elif kind == "chunk":
            self._send_chunk(item)
        elif isinstance(item, Close):
            self._send_close(item)
        else:
            self._send_control(*item)
        with self.cond:
            self.sending = False
            if self.idle() and self.stats.demand_since is not None:  # the link's demand ends here
                self.stats.demand_s += time.monotonic() - self.stats.demand_since
                self.stats.demand_since = None
            self.cond.notify_all()

    def _send_chunk(self, chunk) -> None:
        out = chunk.out
        by_reference, took = None, 0.0
        if not out.failed:
            with self.cond:
                self.stats.busy_since = time.monotonic()
            start = time.monotonic()
            try:
                by_reference = self.sender.send_chunk(out.dest, chunk.header, chunk.pieces)
            except TransferError as e:  # (refused at once by an open breaker: `path_open`)
                self._failed(out, str(e), "path_open" if isinstance(e, PathOpen) else "send_timeout")
            took = time.monotonic() - start
        with self.cond:
            chunk.dequeued = True
            self.stats.busy_since = None
            if by_reference is not None:  # (a failed send's time is no measure of the link)
                self.stats.sent(chunk.nbytes, took)
                if self.bucket is not None:
                    self.bucket.take(chunk.nbytes, time.monotonic())
                self.on_sent(chunk, by_reference)
            self.pending[out.xfer] -= 1
            if self.pending[out.xfer] <= 0:
                del self.pending[out.xfer]
            self.settle_close(out.xfer)

    def _send_control(self, dest: str, header: dict) -> None:
        try:
            self.sender.send_control(dest, header)
        except TransferError:
            with self.cond:
                self.failures["control_send"] = self.failures.get("control_send", 0) + 1

    def _send_close(self, close: Close) -> None:
        out = close.out
        try:
            if close.prefilled and not out.failed:
                self.sender.send_control(out.dest, {"kind": "done", "xfer": out.xfer, "num_chunks": out.num_chunks,
                                                    "first_token": close.first_token, "logprobs": out.logprobs})
            else:
                self.sender.send_control(out.dest, {"kind": "fail", "xfer": out.xfer,
                                                    "reason": out.failed or "aborted"})
        except TransferError as e:
            out.failed = out.failed or str(e)
        mark = self.sender.position(out.dest)
        with self.cond:
            self.events.append(("closed", out, mark))

    def _failed(self, out, reason: str, kind: str) -> None:
        """A send of `out` failed: the transfer fails, its other queued chunks go with it."""
        with self.cond:
            out.failed = reason
            self.failures[kind] = self.failures.get(kind, 0) + 1
            for item in self.queue.drop(lambda it: it.key.out is not out):
                item.key.dequeued = True
                self.pending[out.xfer] -= 1
