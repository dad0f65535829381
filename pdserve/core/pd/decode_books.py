"""The decode worker's books of prefill/decode disaggregation: torch-free decisions both clocks run.

A decode worker told to `reserve` a prompt whose KV another worker produces keeps the reservation in its
queue policy's order (fcfs: arrival; priority: lowest value first) until blocks are free, so a reservation
queue never undoes the order the waiting queue would keep; the head waits for room and later ones do not
overtake it. A `grant` says from which block the KV must come and how many blocks: none when every prompt token
but the last (after a restore: but the checkpoint's tail) is cached here, and the rest is computed here with no
prefill worker. Reservations left waiting are reported once each (the conductor may stage the prompt
meanwhile). Each ended transfer is settled: delivered (the request decodes on from the prefill worker's first
token) or recomputed here; the step that first reads delivered KV is reported as its consumption. A transfer
whose lease lapsed (its sender silent for the timeout) may be *held* live for the conductor's choice instead of
recomputed at once (`hold`: renew, redirect, or give up → `lapse_failed`), counted once however often it lapses.
How each request's prompt KV arrived (delivered, recomputed and why, cached, from a checkpoint) is kept until its
first token reports it (`kv_usage`, `pdserve.core.pd.kv_arrival`).

The real decode worker (`pdserve.engine.pd_decode.DecodeSide`: transports, torch pools, leases) and the
simulator (`pdserve.sim.conductor`: the link model) drive these same books; each moves the bytes its own way.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable

from pdserve.core.pd.kv_arrival import DELIVERED, RECOMPUTED, KvArrival
from pdserve.core.sched.kv_reservations import LOOKING
from pdserve.core.sched.policy import insert_in_order
from pdserve.core.request import Request


@dataclass(eq=False)
class Reservation:
    request: Request
    xfer: str
    local: int = 1  # prompt tokens this worker computes itself when the rest is cached here (restore: more)


@dataclass(frozen=True)
class Grant:
    reservation: Reservation
    first_block: int  # block-table index of the first block to deliver (those before it are cached here)
    num_blocks: int  # blocks the prefill worker delivers; 0: none needed, the uncached tail is computed here

    @property
    def needs_prefill(self) -> bool:
        return self.num_blocks > 0


@dataclass
class Held:
    """A lapsed transfer kept live."""
    xfer: str
    request_id: str
    lapses: int  # how often its lease lapsed (renewed in between)


@dataclass
class DecodeStats:
    failures: Counter = field(default_factory=Counter)  # by TransferState value; outcome: recompute or held
    wasted_bytes: Counter = field(default_factory=Counter)  # received and verified, never consumed: by reason
    bytes_received: int = 0
    chunks_received: int = 0
    chunks_transcoded: int = 0  # arrived in another KV format than this pool's
    transfers_completed: int = 0
    checkpoint_fallbacks: int = 0  # restores short of blocks: recomputed by a prefill worker (or here)


class DecodeBooks:
    def __init__(self, scheduler, block_size: int, gone: Callable[[str], bool] | None = None) -> None:
        """`gone(request_id)`: a request that ended elsewhere before its abort reached this worker (the
        simulator, which knows it at once, drops its reservation when it reaches the head)."""
        self.scheduler = scheduler
        self.block_size = block_size
        self.gone = gone
        self.pending: list[Reservation] = []  # waiting for blocks, in the queue policy's order
        self.unread: set[str] = set()  # delivered, not yet read by a step
        self.stats = DecodeStats()
        self._told_waiting: set[str] = set()  # xfers of pending reservations already reported
        self._looking: set[str] = set()  # the one whose prefix is being read from a lower tier (not reported)
        self.held: dict[str, Held] = {}  # lapsed transfers, still live, waiting for the conductor's choice
        self.arrivals: dict[str, KvArrival] = {}  # request id -> how its prompt KV arrived, until its first token
        self.given_up: dict[str, str] = {}  # request id -> the conductor's reason its KV will not come

    def reserve(self, request: Request, xfer: str, local: int = 1, checkpoint: int = 0) -> Reservation:
        """Queue a reservation; `grant` grants it when blocks are free. Raises for a request that could never
        be served (fail fast, before queueing). `checkpoint`: prompt tokens adopted from a checkpoint."""
        self.scheduler.check_new(request)
        res = Reservation(request, xfer, local)
        self.arrivals[request.request_id] = KvArrival(checkpoint=checkpoint)
        insert_in_order(self.pending, res, _request_of, self.scheduler.policy)
        return res

    def grant(self) -> list[Grant]:
        """Grant queued reservations in policy order while blocks last; one whose prefix is being read from a
        lower tier (disk, the shared pool) is passed over until it is there, not counted as short of room."""
        granted = []
        self._looking = set()
        i = 0
        while i < len(self.pending):
            res = self.pending[i]
            if self.gone is not None and self.gone(res.request.request_id):
                self.pending.pop(i)
                continue
            cached = self.scheduler.reserve_kv(res.request)
            if cached == LOOKING:
                self._looking.add(res.xfer)
                i += 1
                continue
            if cached is None:
                break
            self.pending.pop(i)
            granted.append(self._grant(res, cached))
        return granted

    def _grant(self, res: Reservation, cached: int) -> Grant:
        prompt, first = res.request.num_prompt_tokens, cached // self.block_size
        needed = 0 if cached >= prompt - res.local else -(-prompt // self.block_size) - first
        self.stats.checkpoint_fallbacks += needed > 0 and res.local > 1
        return Grant(res, first, needed)

    def newly_waiting(self) -> list[Reservation]:
        """Reservations left waiting for room, each reported once."""
        new = [r for r in self.pending if r.xfer not in self._told_waiting and r.xfer not in self._looking
               and (self.gone is None or not self.gone(r.request.request_id))]
        self._told_waiting = {r.xfer for r in self.pending if r.xfer not in self._looking}
        return new

    def settle(self, request_id: str, delivered: bool, first_token: int | None, num_bytes: float,
               failure: str = "failed") -> tuple[str, Request | None]:
        """An ended transfer: `delivered` (every expected block verified, the first token sampled) or failed
        (`failure`: why). -> (outcome, request): "delivered" with the decoding request (ended already if its
        first token stopped it), "recompute" (the prompt is computed here), or "aborted" (the request ended
        first; what arrived is wasted)."""
        if request_id not in self.scheduler.requests:
            self.stats.wasted_bytes["aborted"] += num_bytes
            self.arrivals.pop(request_id, None)
            return "aborted", None
        arrival = self.arrivals.setdefault(request_id, KvArrival())
        if delivered:
            if first_token is not None:  # (none: nothing had to come, the tail is computed here)
                arrival.how = DELIVERED
            req = self.scheduler.kv_delivered(request_id, first_token)
            self.stats.transfers_completed += 1
            if num_bytes and not req.is_finished:
                self.unread.add(request_id)
            return "delivered", req
        self.stats.failures[failure] += 1
        self.stats.wasted_bytes[failure] += num_bytes  # dropped, never consumed
        arrival.how, arrival.reason = RECOMPUTED, self.given_up.pop(request_id, failure)
        self.scheduler.kv_failed(request_id)
        return "recompute", None

    def give_up(self, request_id: str, reason: str) -> None:
        """The conductor says the KV of `request_id`'s live transfer will not come (`reason`); it ends failed."""
        self.given_up[request_id] = reason

    def kv_usage(self, request_id: str, prompt_tokens: int, cached: int) -> dict:
        """Its first token is out: how its prompt KV arrived (`KvArrival.usage`), forgotten here."""
        self.given_up.pop(request_id, None)
        return self.arrivals.pop(request_id, KvArrival()).usage(prompt_tokens, cached)

    def restored(self, request_id: str, tokens: int) -> None:
        """A request run here whole (colocated) adopted `tokens` prompt tokens from a checkpoint."""
        self.arrivals[request_id] = KvArrival(checkpoint=tokens)

    def consumed(self, request_ids: Iterable[str]) -> list[str]:
        """Of the requests a step just read, those whose delivered KV it read first."""
        if not self.unread:
            return []
        rids = [rid for rid in request_ids if rid in self.unread]
        self.unread.difference_update(rids)
        return rids

    def hold(self, held: Held, failure: str) -> None:
        """`held.xfer`'s lease lapsed: held live (blocks reserved, late chunks still landing) until the conductor
        chooses. Its first lapse is counted as a `failure`; a renewed transfer lapsing again is the same one."""
        if held.lapses == 1:
            self.stats.failures[failure] += 1
        self.held[held.xfer] = held

    def unhold(self, xfer: str) -> Held | None:
        """The conductor chose for `xfer` (or it ended): no longer held. None if it was not."""
        return self.held.pop(xfer, None)

    def redirected(self, was_held: bool, num_bytes: float) -> None:
        """A transfer restarted from another prefill worker: what arrived under the old one is overwritten."""
        self.stats.wasted_bytes["failed_timeout" if was_held else "redirected"] += num_bytes

    def lapse_failed(self, held: Held, num_bytes: float, reason: str = "failed_timeout") -> None:
        """The conductor gave up on a held transfer (`num_bytes` of it arrived; `reason`: why): dropped, never
        consumed; the prompt is computed here."""
        self.stats.wasted_bytes["failed_timeout"] += num_bytes
        self.arrivals[held.request_id] = KvArrival(RECOMPUTED, reason,
                                                   self.arrivals.get(held.request_id, KvArrival()).checkpoint)
        if held.request_id in self.scheduler.requests:
            self.scheduler.kv_failed(held.request_id)

    def abort(self, request_id: str) -> None:
        self.unread.discard(request_id)
        self.arrivals.pop(request_id, None)
        self.given_up.pop(request_id, None)
        self.pending = [r for r in self.pending if r.request.request_id != request_id]
        self.held = {x: h for x, h in self.held.items() if h.request_id != request_id}


def _request_of(res: Reservation) -> Request:
    return res.request
