"""The simulated KV path of a prompt, owned by `SimKVPath`: the prefill engine's backpressure (paced per link,
as the real prefill worker), the push of each prefill step's new blocks over the link model, the close of a
transfer after its last chunk landed, landings and their re-estimates while in the air, and the bytes and
blocks the decode step that first reads delivered KV consumes. Which blocks a step pushes, when a transfer
closes and which landings moved are the prefill worker's books (`pdserve.core.pd.prefill_books`), one per
prefill engine, driven here as the real prefill worker drives its own.

It owns every engine's network port and the landing watch; it sees the link model, the event loop, the
lifecycle counters, and two callbacks of its conductor: `report(event, *args)` (a core event, whose actions
the conductor carries out) and `landed(flight, delay_s)` (the transfer is complete: its decode engine settles
it, `delay_s` later).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.conductor.wire import Prefill
from pdserve.core.pd.delivery import LANDING_RECHECK_S, WaterLevel
from pdserve.core.pd.prefill_books import Outbound, PrefillBooks
from pdserve.core.pd.production_pace import ProductionPace
from pdserve.core.pd.wire_format import COMPACT, POOL, LinkView, WireFormat, tiers_ahead
from pdserve.sim.engine import SimEngine
from pdserve.sim.flight import Flight, Lifecycle
from pdserve.sim.link import LandingWatch, LinkModel


@dataclass
class SimWire:
    """The wire format policy (`--kv-wire-dtype`), the pool's codec name, and a format's bytes per pool byte."""
    policy: WireFormat = field(default_factory=WireFormat)
    pool: str = "auto"
    ratio: Callable[[str], float] = lambda fmt: 1.0


class SimKVPath:
    def __init__(self, links: LinkModel, water: WaterLevel, life: Lifecycle, block_size: int, block_bytes: int,
                 control_s: float, report: Callable[..., None], landed: Callable[[Flight, float], None]) -> None:
        self.links, self.loop, self.water, self.life = links, links.loop, water, life
        self.block_size, self.block_bytes, self.control_s = block_size, block_bytes, control_s
        self.report, self.landed = report, landed
        self.ports: dict = {}  # engine -> its network port (`LinkModel.link`)
        self.books: dict[str, PrefillBooks] = {}  # prefill engine -> its books (the real prefill worker's)
        self.landings = LandingWatch(links, lambda engine: self.books_of(engine).landings)
        self._rechecking: set[str] = set()  # prefill engines whose landings are rechecked periodically
        self.wire = SimWire()  # (`pdserve.sim.cluster.build` sets the run's)

    def add_port(self, engine: str, bandwidth: float) -> None:
        self.ports[engine] = self.links.link(engine, bandwidth)

    def link_report(self, engine: str, decodes: list[str]) -> dict:
        """`engine`'s links to `decodes` as a real prefill worker's stats carry them (`kv_links`), each with its
        `capacity`: the slower of the two ports (as a real link's with `--link-gbps`)."""
        mine = self.ports[engine]
        return {d: {"capacity": min(mine.bandwidth, self.ports[d].bandwidth)} for d in decodes if d in self.ports}

    def books_of(self, engine: str) -> PrefillBooks:
        """`engine`'s prefill books (no lease lapses are modelled: its leases never run out)."""
        books = self.books.get(engine)
        if books is None:
            books = self.books[engine] = PrefillBooks(self.block_size, float("inf"))
        return books

    def open(self, engine: str, f: Flight, cmd: Prefill) -> None:
        """`engine` took `f`'s prefill command: its transfer, from the command's fields, in the format the wire
        policy chooses from the link's state now (as the real prefill worker's `PrefillSide.add`)."""
        out = self.books_of(engine).open(Outbound(f.rid, cmd.dest, cmd.xfer, cmd.first_block, len(cmd.prompt),
                                                  cmd.link, f.tier, f.deadline_s))
        wire = self.wire
        if wire.policy.mode == POOL:
            return
        egress, ingress = self.ports[engine], self.ports[cmd.link]
        blocks = -(-len(cmd.prompt) // self.block_size) - cmd.first_block
        consume = None if f.read_s is None else f.read_s - self.loop.now
        ahead = tiers_ahead(f.tier)
        queued = self.links.queued_bytes(egress, ahead) + self.books_of(engine).unproduced_bytes(
            cmd.link, ahead, self.block_bytes, but=out)  # on the link, and taken but not yet computed
        out.wire_format = wire.policy.choose(f.tier, wire.pool, blocks * self.block_bytes,
                                             LinkView(queued, min(egress.bandwidth, ingress.bandwidth)), consume,
                                             wire.ratio(COMPACT))
        f.wire_ratio = wire.ratio(out.wire_format)

    def abort(self, engine: str, rid: str) -> None:
        """`rid` ended on `engine` before its KV left: its transfer (if any) ends there."""
        if engine in self.books:
            self.books[engine].finish(rid, prefilled=False, queued=False)

    # ---- production ------------------------------------------------------------------------------------------
    def hold_production_s(self, engine: SimEngine, flight_of: Callable[[str], Flight | None]) -> float:
        """As the real prefill worker: its next step is paced per link (`pdserve.core.pd.production_pace`), here
        the pair of ports a prompt's KV crosses; no step while every prompt's pair is backed up."""
        egress = self.ports[engine.name]

        def link_of(rid: str) -> str | None:
            f = flight_of(rid)
            return None if f is None or f.decode is None else f.decode.name

        def backlog(dest: str, tiers: set[str]) -> list[tuple[float, float]]:
            # (an idle port too: the first step after a pause is paced, as the real worker's `link_backlog`)
            return [(self.links.queued_bytes(p, tiers) if p.flows else 0.0, p.bandwidth)
                    for p in (egress, self.ports[dest])]

        pace = engine.scheduler.pace = ProductionPace.build(
            engine.scheduler.requests.values(), link_of, backlog, self.water, self.block_bytes / self.block_size,
            self.block_size, self.life.production_paced)
        self.life.production_paused_s += pace.hold_s
        return pace.hold_s

    # ---- delivery --------------------------------------------------------------------------------------------
    def push(self, p: SimEngine, f: Flight, end: int, duration_s: float) -> None:
        """A prefill step of `duration_s` computed `f`'s prompt up to token `end`: its new blocks go."""
        pushed = self.books_of(p.name).push(f.rid, end)
        if pushed is None:
            return
        span = pushed[1]
        if span.num_blocks:
            nbytes = span.num_blocks * self.block_bytes * f.wire_ratio
            self.life.bytes_sent += nbytes
            ports = (self.ports[p.name], self.ports[f.decode.name])
            last = f.in_air[-1] if f.in_air else None  # the transfer's flow still in the air takes the chunk
            if last is not None and last.links == ports and self.links.extend(last, nbytes, duration_s):
                return
            f.flows += 1
            sent: list = []  # the flow, whose bytes grow with the chunks that join it
            flow = self.links.start(ports, nbytes, duration_s,
                                    lambda: self._arrived(f, sent[0].nbytes if sent else nbytes), f.tier, f.deadline_s)
            if flow is not None:
                sent.append(flow)
                f.in_air.append(flow)

    def _arrived(self, f: Flight, nbytes: float) -> None:
        f.flows -= 1
        f.delivered += nbytes
        self.life.bytes_delivered += nbytes
        books = self.books.get(f.prefill.name) if f.prefill is not None else None
        out = None if books is None or f.flows else books.closing.get(f.rid)
        if out is not None and books.drained(out):  # its last chunk landed: the transfer closes
            self._close(f, 0.0)

    def _close(self, f: Flight, delay_s: float) -> None:
        if not f.finished:
            self.landed(f, delay_s)

    def prefilled(self, engine: SimEngine, f: Flight, now: float) -> None:
        """`f`'s prompt is prefilled on `engine` (its first token sampled): the core hears when its KV lands
        (the prefill worker's link's estimate); the others' estimates that moved are reported again."""
        f.in_air = [fl for fl in f.in_air if fl in self.links.flows]
        landing = self.links.eta(f.in_air) if f.in_air else 0.0
        self.report("prefilled", f.rid, now + self.control_s, landing - self.control_s)
        self._reland(engine, f, landing, now)
        out, close_now = self.books_of(engine.name).finish(f.rid, True, f.flows > 0, f.first_token)
        if out is not None and close_now:  # nothing left on the link: closes now (else after its last chunk)
            self._close(f, self.links.latency_s)

    # ---- landing estimates -----------------------------------------------------------------------------------
    def _reland(self, engine: SimEngine, f: Flight, landing: float, now: float) -> None:
        """As the real prefill worker (`PrefillSide.relanded`): `f` became due on this engine's link; the
        other prefilled transfers in the air there whose landing estimate moved are reported again — and
        those of other prefill engines sharing a port with `f` (its decode engine's), whose senders see their
        measured rate drop (the real worker rechecks its landings every `LANDING_RECHECK_S` at the rate its
        transport sent at lately: `LinkStats.landing_rate`)."""
        others = [e for e in self.landings.sharing(f) if e != engine.name]
        moved = self.landings.moved(engine.name, f, landing, now)
        for name in others:
            moved += self.landings.recheck(name, now)
        self._relanded(moved, now)
        if engine.name not in self._rechecking and self.landings.soon.get(engine.name):
            self._rechecking.add(engine.name)
            self.loop.at(now + LANDING_RECHECK_S, self._recheck, engine.name)

    def _relanded(self, moved: list[tuple[str, float]], now: float) -> None:
        for rid, eta in moved:
            self.report("relanded", rid, now + self.control_s, eta - self.control_s)

    def _recheck(self, name: str) -> None:
        """As the real prefill worker's loop: every LANDING_RECHECK_S while its prefilled transfers are in the
        air, the landings that moved since last reported (a flow sharing their port ended, or began)."""
        now = self.loop.now
        self._relanded(self.landings.recheck(name, now), now)
        if self.landings.soon.get(name):
            self.loop.at(now + LANDING_RECHECK_S, self._recheck, name)
        else:
            self._rechecking.discard(name)

    # ---- consumption -----------------------------------------------------------------------------------------
    def consumed(self, f: Flight, start_s: float) -> None:
        """The decode step beginning at `start_s` read `f`'s delivered KV first."""
        blocks = round(f.delivered / (self.block_bytes * f.wire_ratio))
        self.life.bytes_consumed += f.delivered
        self.life.blocks_consumed += blocks
        self.report("consumed", f.rid, start_s)
