"""Which prompt an idle prefill worker computes ahead while its decode worker has no room (staging).

The conductor core's staging part (`Staging`: `reserve_waiting`, `staged`, `next`) asks `StagePlan.pick` when
a prefill worker may have become idle. A prefill worker advertises in its `ready` event how many blocks of staged
KV it can keep (`stage_blocks`: its host tier, else half its pool; 0 under `--delivery fifo`: no staging) and
the longest prompt it can reuse whole (`stage_max_blocks`: a long-context worker reuses at most its hot window).
One stage pass at a time per worker; the first waiting prompt in (tier rank, arrival) order whose decode worker
had no room; only while what the worker keeps staged (staged, not yet reserved) and this prompt fit. With no
prompt to stage and nothing routed to it, the worker warms a hot prefix it lacks instead (idle prewarm,
`pdserve.conductor.hot_prefixes`). `Staging` owns the plan and the hot prefixes; it sees the core's `Books`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from pdserve.conductor import wire
from pdserve.conductor.actions import Count, Send, stale
from pdserve.conductor.books import Books
from pdserve.conductor.flight_state import Stage
from pdserve.conductor.hot_prefixes import HotPrefixes
from pdserve.conductor.wire import Ready
from pdserve.core.pd.sensitivity import DEFAULT as DEFAULT_LABEL
from pdserve.core.service_tiers import ServiceTiers


class StagePlan:
    def __init__(self, tiers: ServiceTiers) -> None:
        self.tiers = tiers
        self.blocks: dict[str, int] = {}  # prefill worker -> blocks of staged KV it can keep (0: none)
        self.max_blocks: dict[str, int] = {}  # prefill worker -> the longest prompt (blocks) it reuses whole
        self.staging: dict[str, str] = {}  # prefill worker -> the request it is staging now

    def worker_ready(self, name: str, info: Ready) -> None:
        self.blocks[name] = info.stage_blocks
        self.max_blocks[name] = self.blocks[name] if info.stage_max_blocks is None else info.stage_max_blocks

    @property
    def any_room(self) -> bool:
        """Some prefill worker can keep staged (or warmed) KV at all (none under `--delivery fifo`)."""
        return any(self.blocks.values())

    def may_stage(self, prefill: str | None) -> bool:
        return prefill is not None and bool(self.blocks.get(prefill)) and prefill not in self.staging

    def pick(self, prefill: str, flights: Iterable, block_size: int):
        """The flight `prefill` should stage now (moved to STAGING), or None."""
        mine = [f for f in flights if f.prefill == prefill and f.kv_addr is None]  # (blocks not reserved yet)
        kept = sum(_blocks(f, block_size) for f in mine if f.stage in (Stage.STAGING, Stage.STAGED))
        waiting = [f for f in mine if f.stage is Stage.WAITING_ROOM
                   and _blocks(f, block_size) <= self.max_blocks[prefill]]
        if not waiting:
            return None
        f = min(waiting, key=lambda g: (self.tiers[g.tier].rank, g.arrival_s))
        if kept + _blocks(f, block_size) > self.blocks[prefill]:
            return None
        f.advance(Stage.STAGING)
        self.staging[prefill] = f.rid
        return f

    def running(self, prefill: str | None, rid: str) -> bool:
        """A stage pass of `rid` runs on `prefill` (one that began there; it may have been dispatched since)."""
        return prefill is not None and self.staging.get(prefill) == rid

    def done(self, prefill: str | None, rid: str) -> None:
        """`rid`'s stage pass on `prefill` ended, or is moot."""
        if self.running(prefill, rid):
            del self.staging[prefill]


class Staging:
    """The conductor core's staging and idle-prewarm part. Owns the `StagePlan` (which stage pass runs where),
    the hot prefixes (`HotPrefixes`, None when idle prewarm is off) and the warm pass ids; sees the core's
    `Books` (its flights, workers and backlog)."""

    def __init__(self, books: Books, plan: StagePlan, hot: HotPrefixes | None) -> None:
        self.books, self.plan, self.hot = books, plan, hot
        self._warms = itertools.count()

    def worker_ready(self, name: str, info: Ready) -> None:
        self.plan.worker_ready(name, info)

    def arrived(self, hashes, prompt: list, now: float, label: str = DEFAULT_LABEL) -> list:
        """A request was placed: its prefix is counted (`HotPrefixes.observe`), and an idle prefill worker may
        warm a prefix that became hot."""
        if self.hot is None or not self.plan.any_room:  # (no worker could ever warm what it counts)
            return []
        self.hot.observe(hashes, prompt, self.books.block_size, now, label)
        actions: list = []
        for w in self.books.role("prefill"):
            actions += self._warm(w.name, now)
        return actions

    def worker_gone(self, name: str) -> None:
        """Its warm passes died with it (its stage passes end as its flights move: `Books.release_prefill`)."""
        for rid in self.hot.worker_gone(name) if self.hot is not None else ():
            self.plan.done(name, rid)

    # ---- staging: prompts computed ahead while their decode worker has no room ----------------------------
    def reserve_waiting(self, rid: str, xfer: str, now: float = 0.0) -> list:
        """The decode worker has no room for this request's blocks now: its prefill worker may stage it."""
        f = self.books.flights.get(rid)
        if f is None or f.xfer != xfer:
            return stale("reserve_waiting")
        if f.stage is Stage.RESERVING:  # (elsewhere: a repeat, or it is no longer waiting for blocks)
            f.advance(Stage.WAITING_ROOM)
        return self.next(f.prefill, now)

    def staged(self, rid: str, ok: bool, now: float = 0.0) -> list:
        """The prefill worker finished (or dropped) its stage pass of `rid`: only the prompt's last token is
        left to compute when it is dispatched."""
        if self.hot is not None and rid in self.hot.warming:
            return self._warmed(rid, ok, now)
        f = self.books.flights.get(rid)
        if f is None:
            return stale("staged")
        if not self.plan.running(f.prefill, rid):
            return []  # (moot: its prompt was found cached on its decode worker, recomputed there, or moved)
        self.plan.done(f.prefill, rid)
        if f.stage is Stage.STAGING:  # (else dispatched meanwhile: its prefill takes what was staged)
            f.advance(Stage.STAGED if ok else Stage.WAITING_ROOM)
        if ok and f.queued_tokens > 1:
            backlog, rank, left = self.books.backlog[f.prefill], self.books.tiers[f.tier].rank, f.queued_tokens - 1
            backlog.tokens[rank] -= left
            if f.dispatched_s is not None:
                backlog.dispatched[rank] -= left
            f.queued_tokens = 1
        return self.next(f.prefill, now)

    def next(self, prefill: str | None, now: float = 0.0) -> list:
        """An idle prefill worker (nothing dispatched, nothing staging) may stage a waiting prompt
        (`StagePlan`), else warm a hot prefix it lacks."""
        if (not self.plan.may_stage(prefill) or not self.books.workers[prefill].usable
                or any(self.books.backlog[prefill].dispatched.values())):
            return []
        f = self.plan.pick(prefill, self.books.flights.values(), self.books.block_size)
        if f is None:
            return self._warm(prefill, now)
        return [Count("kv_staged", (("service_tier", f.tier),)),
                Send(prefill, wire.Stage(**f.request_fields()))]

    # ---- idle prewarm: hot prefixes computed ahead on an idle prefill worker -------------------------------
    def _warm(self, prefill: str, now: float) -> list:
        """A prefill worker with nothing routed to it waiting and no stage pass computes the hot prefix it
        lacks that is worth the most (`pdserve.conductor.hot_prefixes`)."""
        if (self.hot is None or not self.plan.may_stage(prefill) or not self.books.workers[prefill].usable
                or any(self.books.backlog[prefill].tokens.values())):
            return []
        room = min(self.plan.blocks[prefill], self.plan.max_blocks[prefill])
        p = self.hot.pick(self.books.workers[prefill], room, now)
        if p is None:
            return []
        rid = f"warm-{next(self._warms)}"
        self.hot.start(rid, prefill, p)
        self.plan.staging[prefill] = rid
        return [Send(prefill, wire.Warm(rid, p.tokens, p.label))]

    def _warmed(self, rid: str, ok: bool, now: float) -> list:
        prefill, p = self.hot.end(rid)
        self.plan.done(prefill, rid)
        if ok:
            self.books.workers[prefill].remember(p.hashes)  # routing counts its prefix as cached there now
        return ([Count("kv_idle_prewarms", (("worker", prefill), ("outcome", "done" if ok else "dropped")))]
                + self.next(prefill, now))


def _blocks(f, block_size: int) -> int:
    return -(-len(f.resumed_prompt) // block_size)
