"""A prefill worker's outgoing KV: chunks queued per link, sent by each link's own thread in the delivery
policy's order (`pdserve.transfer.link_lane`): the compute thread queues and returns, it never waits on a
link.

Production (`PrefillSide.on_layer`) pushes each layer's new blocks as chunks; each link's lane sends them in
`pdserve.core.pd.delivery` order (`--delivery fifo`: as produced; `scheduled`: by service tier share, earliest
predicted consumption first within a tier) as fast as the link takes them (each link throttled to `link_rate`
bytes/s when set: `--link-gbps`, to emulate a slower network). A queued chunk's pool blocks are held from the
moment it is queued until the receiver took them (a partly filled block's chunk and a long prompt's, whose
blocks leave the pool as it goes, are copies made when produced). A transfer's closing record goes after its
last chunk. Chunk size follows congestion (`chunk_blocks`): while a link has chunks waiting, new chunks carry
about CHUNK_QUANTUM_S of its measured rate, so a more urgent transfer's chunk waits at most about that long
behind one already picked; an idle link takes chunks as large as the transport allows.

Per link it keeps the numbers of the link metrics: busy seconds (inside the transport's send), bytes sent,
demand seconds (something queued or sending).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.core.pd.delivery import DeliveryPolicy, LinkQueue, TokenBucket
from pdserve.transfer.base import KVSender
from pdserve.transfer.link_lane import Close, Lane, LinkStats

BURST_S = 0.005  # a throttled link's burst: this many seconds of its rate
CHUNK_QUANTUM_S = 0.010  # a congested link's chunks: about this many seconds of its rate each

__all__ = ["BURST_S", "CHUNK_QUANTUM_S", "Chunk", "Close", "LinkStats", "Outbox"]


@dataclass
class Chunk:
    out: object  # the transfer's `Outbound`
    header: dict
    pieces: list
    nbytes: int
    ids: list[int]  # pool blocks it reads
    partial: bool = False  # the prompt's partly filled last block (a copy)
    copy: bool = False  # its bytes are a copy (re-encoded into the transfer's wire format): nothing to hold
    dequeued: bool = False  # sent, or dropped with its transfer


@dataclass
class Outbox:
    sender: KVSender
    policy: DeliveryPolicy
    hold: Callable[[object, list[int]], None]  # keep an outbound's pool blocks until the receiver took them
    link_rate: float | None = None  # bytes/s per link; None: as fast as the transport goes
    failures: Counter = field(default_factory=Counter)
    on_closed: Callable[[object, int], None] | None = None  # a transfer's closing record went (its mark)
    lanes: dict[str, Lane] = field(default_factory=dict)
    bytes_sent: int = 0
    chunks_in_place: int = 0
    chunks_payload: int = 0

    def __post_init__(self) -> None:
        self.cond = threading.Condition()
        self.events: deque = deque()  # from the lanes: ("closed", out, mark)

    def _lane(self, link: str) -> Lane:
        lane = self.lanes.get(link)
        if lane is None:
            bucket = TokenBucket(self.link_rate, self.link_rate * BURST_S) if self.link_rate else None
            lane = self.lanes[link] = Lane(link, LinkQueue(self.policy), self.cond, self.sender, self.events,
                                           bucket, on_sent=self._sent)
            if self.sender is not None:
                lane.start()
        return lane

    @property
    def links(self) -> dict[str, LinkStats]:
        return {name: lane.stats for name, lane in self.lanes.items()}

    # ---- the compute thread's side ---------------------------------------------------------------------------
    def push(self, chunk: Chunk) -> None:
        """Queue `chunk` for its link (its pool blocks held until the receiver took them) and return."""
        out = chunk.out
        if not (chunk.partial or chunk.copy or out.by_copy):  # those are copies already
            self.hold(out, chunk.ids)
        with self.cond:
            lane = self._lane(out.link)
            if lane.stats.demand_since is None:  # the link has demand from now until its lane is idle
                lane.stats.demand_since = time.monotonic()
            lane.queue.push(chunk, chunk.nbytes, out.tier, out.deadline_s)
            lane.pending[out.xfer] = lane.pending.get(out.xfer, 0) + 1
            self.cond.notify_all()

    def control(self, out, header: dict) -> None:
        """A control record for `out`'s receiver (an `alive`): sent before the link's next chunk."""
        with self.cond:
            self._lane(out.link).controls.append((out.dest, header))
            self.cond.notify_all()

    def close(self, out, prefilled: bool, first_token: int | None = None) -> None:
        """`out`'s closing record (`done` when `prefilled`, else `fail`): sent after its last queued chunk."""
        with self.cond:
            lane = self._lane(out.link)
            lane.closes[out.xfer] = Close(out, prefilled, first_token)
            lane.settle_close(out.xfer)
            self.cond.notify_all()

    def forget(self, dest: str) -> None:
        """The receiver at `dest` died: the lanes sending to it drop its connection (nothing is sent to it)."""
        with self.cond:
            lanes = [lane for lane in self.lanes.values() if lane.sender is not None]
            for lane in lanes:
                lane.forget.add(dest)
            self.cond.notify_all()
        if not lanes and self.sender is not None:
            self.sender.forget(dest)

    def pump(self) -> None:
        """What the lanes did since: closed transfers go to `on_closed` (on this, the compute thread)."""
        with self.cond:
            events = list(self.events)
            self.events.clear()
            for lane in self.lanes.values():
                for reason, n in lane.failures.items():
                    self.failures[reason] += n
                lane.failures.clear()
        for _, out, mark in events:
            if self.on_closed is not None:
                self.on_closed(out, mark)

    def _sent(self, chunk: Chunk, by_reference: bool) -> None:
        """(A lane's thread, the lock held.) `chunk` went."""
        out, stats = chunk.out, self.lanes[chunk.out.link].stats
        self.chunks_in_place += by_reference
        self.chunks_payload += not by_reference
        out.num_chunks += 1
        out.last_sent_s = time.monotonic()
        self.bytes_sent += chunk.nbytes
        stats.bytes += chunk.nbytes
        stats.chunks += 1

    def chunk_blocks(self, link: str, block_bytes: int, most: int) -> int:
        """Blocks per new chunk on `link` (`block_bytes`: one block of one layer; `most`: the transport's
        bound): about CHUNK_QUANTUM_S of the link while chunks wait on it, else `most`."""
        with self.cond:
            lane = self.lanes.get(link)
            rate = lane.stats.rate(self.link_rate) if lane is not None else None
            if lane is None or not len(lane.queue) or not rate:
                return most
        return max(1, min(most, int(rate * CHUNK_QUANTUM_S) // block_bytes))

    def queued(self, xfer: str) -> int:
        with self.cond:
            return sum(lane.pending.get(xfer, 0) for lane in self.lanes.values())

    def landing_in_s(self, out, expedite: bool = True) -> float:
        """`out` is prefilled: its queued chunks are due (made so now, with `expedite`). When the last of them
        will have gone, from now (in policy order, at the link's rate now: `LinkStats.landing_rate`; 0 when
        nothing of it waits or the rate is unknown yet)."""
        with self.cond:
            lane = self.lanes.get(out.link)
            if lane is None:
                return 0.0
            if expedite:
                lane.queue.expedite(lambda it: it.key.out is out, time.monotonic())
            ahead = lane.queue.bytes_until(lambda it: it.key.out is out)
            rate = lane.stats.landing_rate(self.link_rate)
        return ahead / rate if ahead and rate else 0.0

    def link_rate_of(self, link: str) -> float | None:
        """`link`'s measured rate (its throttle's when set; None: not known yet)."""
        with self.cond:
            lane = self.lanes.get(link)
            return self.link_rate if lane is None else lane.stats.rate(self.link_rate)

    def link_backlog(self, link: str, tiers: set[str]) -> list[tuple[float, float | None]]:
        """[(bytes of `tiers` queued for `link`, its rate)]; an idle link whose rate is known: (0, its rate), so
        the first step after a pause is paced too (one step's KV can take a slow link many seconds)."""
        with self.cond:
            lane = self.lanes.get(link)
            rate = self.link_rate if lane is None else lane.stats.rate(self.link_rate)
            if lane is None or not len(lane.queue):
                return [(0.0, rate)] if rate else []
            return [(lane.queue.queued_bytes(tiers), rate)]

    def drop(self, out) -> int:
        """Forget a failed or aborted transfer's queued chunks; returns how many."""
        with self.cond:
            lane = self.lanes.get(out.link)
            if lane is None:
                return 0
            gone = lane.queue.drop(lambda it: it.key.out is not out)
            for item in gone:
                item.key.dequeued = True
            lane.pending.pop(out.xfer, None)
            lane.closes.pop(out.xfer, None)
            lane.controls = deque(c for c in lane.controls if not (isinstance(c, Close) and c.out is out))
            return len(gone)

    def idle(self) -> bool:
        """Nothing queued or being sent on any link, and every closed transfer heard of."""
        with self.cond:
            return not self.events and all(lane.idle() for lane in self.lanes.values())

    def link_report(self) -> dict:
        now = time.monotonic()
        with self.cond:
            return {link: lane.stats.as_dict(self.link_rate, now) for link, lane in self.lanes.items()}

    def stop(self) -> None:
        with self.cond:
            for lane in self.lanes.values():
                lane.stopped = True
            self.cond.notify_all()
