"""A prefill worker's outgoing KV: chunks queued per link and sent in the delivery policy's order.

Production (`PrefillSide.on_layer`) pushes each layer's new blocks as chunks; `pump` sends what the links
allow, in `pdserve.core.pd.delivery` order (`--delivery fifo`: as produced; `scheduled`: by service tier share,
earliest predicted consumption first within a tier), each link throttled to `link_rate` bytes/s when set
(`--link-gbps`, to emulate a slower network; unthrottled, everything pushed goes at the next pump). A
chunk that must wait keeps its blocks held until the receiver took them (a partly filled block's chunk and
a long prompt's, whose blocks leave the pool as it goes, are copies made when produced).
A transfer's closing record goes after its last chunk. Chunk size follows congestion (`chunk_blocks`): while a
link has chunks waiting, new chunks carry about CHUNK_QUANTUM_S of its rate, so a more urgent transfer's chunk
waits at most that long behind one already picked; an idle link takes chunks as large as the transport allows.

Per link it keeps the numbers of the link metrics: busy seconds (inside the transport's send), bytes sent,
useful bytes (not later superseded by a complete block), demand seconds (something queued or sending).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.core.pd.delivery import DeliveryPolicy, LinkQueue, TokenBucket
from pdserve.transfer.base import KVSender, TransferError

BURST_S = 0.005  # a throttled link's burst: this many seconds of its rate
CHUNK_QUANTUM_S = 0.010  # a congested link's chunks: about this many seconds of its rate each
RECENT_WEIGHT = 0.25  # a chunk's send rate's weight in a link's recent rate (an exponential mean)


@dataclass
class Chunk:
    out: object  # the transfer's `Outbound`
    header: dict
    pieces: list
    nbytes: int
    ids: list[int]  # pool blocks it reads
    partial: bool = False  # a partly filled block's bytes as they were (a copy)
    useful: bool = True  # False: a partly filled block the complete one will supersede
    detached: bool = False
    dequeued: bool = False  # sent, or dropped with its transfer


@dataclass
class LinkStats:
    busy_s: float = 0.0
    bytes: int = 0
    useful_bytes: int = 0
    chunks: int = 0
    demand_s: float = 0.0
    demand_since: float | None = None
    recent: float | None = None  # bytes/s the transport sent its last chunks at (exponential mean; it
    # moves only when a chunk is sent: after a slow spell, landings stay late until the next chunk shows better)

    def rate(self, link_rate: float | None) -> float | None:
        """The link's capacity: its throttle's rate, else the rate the transport sent at (None: unknown)."""
        return link_rate or (self.bytes / self.busy_s if self.busy_s else None)

    def sent(self, nbytes: int, seconds: float) -> None:
        if seconds > 0:
            r = nbytes / seconds
            self.recent = r if self.recent is None else self.recent + RECENT_WEIGHT * (r - self.recent)

    def landing_rate(self, link_rate: float | None) -> float | None:
        """The rate queued bytes go at now: the throttle's, unless the transport went slower lately (another
        sender on the same receiver's port, a loaded host); else the transport's recent rate."""
        if link_rate and self.recent:
            return min(link_rate, self.recent)
        return link_rate or self.recent or self.rate(None)

    def as_dict(self, link_rate: float | None, now: float) -> dict:
        demand = self.demand_s + (now - self.demand_since if self.demand_since is not None else 0.0)
        return {"busy_s": self.busy_s, "bytes": self.bytes, "useful_bytes": self.useful_bytes, "demand_s": demand,
                "capacity": self.rate(link_rate), "chunks": self.chunks}


@dataclass
class Outbox:
    sender: KVSender
    policy: DeliveryPolicy
    hold: Callable[[object, list[int]], None]  # keep an outbound's pool blocks until the receiver took them
    link_rate: float | None = None  # bytes/s per link; None: as fast as the transport goes
    queues: dict[str, LinkQueue] = field(default_factory=dict)
    buckets: dict[str, TokenBucket] = field(default_factory=dict)
    links: dict[str, LinkStats] = field(default_factory=dict)
    pending: Counter = field(default_factory=Counter)  # xfer -> chunks queued
    failures: Counter = field(default_factory=Counter)
    on_drained: Callable[[object], None] | None = None  # a closing transfer's last chunk went
    fresh: list = field(default_factory=list)  # chunks pushed since the last pump (not detached yet)
    bytes_sent: int = 0
    chunks_in_place: int = 0
    chunks_payload: int = 0

    def push(self, chunk: Chunk) -> None:
        out = chunk.out
        queue = self.queues.get(out.link)
        if queue is None:
            queue = self.queues[out.link] = LinkQueue(self.policy)
            self.links[out.link] = LinkStats()
            if self.link_rate:
                self.buckets[out.link] = TokenBucket(self.link_rate, self.link_rate * BURST_S)
        if not len(queue):
            self.links[out.link].demand_since = time.monotonic()
        queue.push(chunk, chunk.nbytes, out.tier, out.deadline_s)
        self.fresh.append(chunk)
        self.pending[out.xfer] += 1

    def pump(self) -> None:
        """Send what the links allow now; detach what stays queued."""
        for link, queue in self.queues.items():
            bucket = self.buckets.get(link)
            while len(queue) and (bucket is None or bucket.wait_s(time.monotonic()) <= 0):
                self._send(link, queue.pick().key, bucket)
            if not len(queue) and self.links[link].demand_since is not None:
                stats = self.links[link]
                stats.demand_s += time.monotonic() - stats.demand_since
                stats.demand_since = None
        self._detach_waiting()

    def _detach_waiting(self) -> None:
        """The chunks pushed since the last pump that are still queued wait: detach them (once each)."""
        fresh, self.fresh = self.fresh, []
        for chunk in fresh:
            if not chunk.dequeued:
                _detach(chunk, self.hold)

    def _send(self, link: str, chunk: Chunk, bucket: TokenBucket | None) -> None:
        chunk.dequeued = True
        out, stats = chunk.out, self.links[link]
        self.pending[out.xfer] -= 1
        if not out.failed:
            start = time.perf_counter()
            try:
                by_reference = self.sender.send_chunk(out.dest, chunk.header, chunk.pieces)
            except TransferError as e:
                out.failed = str(e)
                self.failures["send_timeout"] += 1
                by_reference = None
            took = time.perf_counter() - start
            stats.busy_s += took
            if by_reference is not None:
                stats.sent(chunk.nbytes, took)
                self._sent(chunk, stats, by_reference)
                if bucket is not None:
                    bucket.take(chunk.nbytes, time.monotonic())
        if self.pending[out.xfer] <= 0:
            del self.pending[out.xfer]
            if self.on_drained is not None:
                self.on_drained(out)

    def _sent(self, chunk: Chunk, stats: LinkStats, by_reference: bool) -> None:
        out = chunk.out
        self.chunks_in_place += by_reference
        self.chunks_payload += not by_reference
        if by_reference and not chunk.detached:
            self.hold(out, chunk.ids)
        out.num_chunks += 1
        out.last_sent_s = time.monotonic()
        self.bytes_sent += chunk.nbytes
        stats.bytes += chunk.nbytes
        stats.chunks += 1
        stats.useful_bytes += chunk.nbytes if chunk.useful else 0

    def chunk_blocks(self, link: str, block_bytes: int, most: int) -> int:
        """Blocks per new chunk on `link` (`block_bytes`: one block of one layer; `most`: the transport's
        bound): about CHUNK_QUANTUM_S of the link while chunks wait on it, else `most`."""
        queue, stats = self.queues.get(link), self.links.get(link)
        rate = stats.rate(self.link_rate) if stats is not None else None
        if queue is None or not len(queue) or not rate:
            return most
        return max(1, min(most, int(rate * CHUNK_QUANTUM_S) // block_bytes))

    def queued(self, xfer: str) -> int:
        return self.pending.get(xfer, 0)

    def landing_in_s(self, out, expedite: bool = True) -> float:
        """`out` is prefilled: its queued chunks are due (made so now, with `expedite`). When the last of them
        will have gone, from now (in policy order, at the link's rate now: `LinkStats.landing_rate`; 0 when
        nothing of it waits or the rate is unknown yet)."""
        queue = self.queues.get(out.link)
        if queue is None:
            return 0.0
        if expedite:
            queue.expedite(lambda it: it.key.out is out, time.monotonic())
        ahead = queue.bytes_until(lambda it: it.key.out is out)
        rate = self.links[out.link].landing_rate(self.link_rate)
        return ahead / rate if ahead and rate else 0.0

    def link_backlog(self, link: str, tiers: set[str]) -> list[tuple[float, float | None]]:
        """[(bytes of `tiers` queued for `link`, its rate)]: nothing when none is queued."""
        queue = self.queues.get(link)
        if queue is None or not len(queue):
            return []
        return [(queue.queued_bytes(tiers), self.links[link].rate(self.link_rate))]

    def drop(self, out) -> int:
        """Forget a failed or aborted transfer's queued chunks; returns how many."""
        queue = self.queues.get(out.link)
        gone = [] if queue is None else queue.drop(lambda it: it.key.out is not out)
        for item in gone:
            item.key.dequeued = True
        self.pending.pop(out.xfer, None)
        return len(gone)

    def wait_s(self) -> float | None:
        """How long until a queued chunk may go (None: nothing queued)."""
        now, waits = time.monotonic(), []
        for link, queue in self.queues.items():
            if len(queue):
                bucket = self.buckets.get(link)
                waits.append(0.0 if bucket is None else bucket.wait_s(now))
        return min(waits, default=None)

    def link_report(self) -> dict:
        now = time.monotonic()
        return {link: stats.as_dict(self.link_rate, now) for link, stats in self.links.items()}


def _detach(chunk: Chunk, hold: Callable[[object, list[int]], None]) -> None:
    """A chunk that waits must still find its bytes: hold its blocks (a partly filled block's chunk and a
    long prompt's, whose blocks leave the pool as it goes, are copies made when produced)."""
    if chunk.detached:
        return
    chunk.detached = True
    if not (chunk.partial or chunk.out.by_copy):  # those are copies already
        hold(chunk.out, chunk.ids)
