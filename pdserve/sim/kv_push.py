"""The simulated KV path of a prompt, a mixin of `pdserve.sim.conductor.SimConductor`: the prefill engine's
backpressure (paced per link, as the real prefill worker), the layer-by-layer push of each prefill step's new
blocks over the link model, landings and their re-estimates while in the air, and the decode step that first
consumes delivered KV.

Uses the conductor's `flights`, `links`, `ports`, `water`, `landings`, `ready`, `life`, `loop`, `block_size`,
`block_bytes`, `control_s`, `_rechecking`, `_act` and `_core`.
"""

from __future__ import annotations

from pdserve.core.delivery import LANDING_RECHECK_S
from pdserve.core.production_pace import ProductionPace
from pdserve.core.push_range import push_range
from pdserve.sim.engine import SimEngine
from pdserve.sim.flight import Flight


class KVPush:
    def hold_production_s(self, engine: SimEngine) -> float:
        """As the real prefill worker: its next step is paced per link (`pdserve.core.production_pace`), here
        the pair of ports a prompt's KV crosses; no step while every prompt's pair is backed up."""
        if engine.role != "prefill":
            return 0.0
        egress = self.ports[engine.name]

        def link_of(rid: str) -> str | None:
            f = self.flights.get(rid)
            return None if f is None or f.decode is None else f.decode.name

        def backlog(dest: str, tiers: set[str]) -> list[tuple[float, float]]:
            return [(self.links.queued_bytes(p, tiers), p.bandwidth) for p in (egress, self.ports[dest]) if p.flows]

        pace = engine.scheduler.pace = ProductionPace.build(
            engine.scheduler.requests.values(), link_of, backlog, self.water, self.block_bytes / self.block_size,
            self.block_size, self.life.production_paced)
        self.life.production_paused_s += pace.hold_s
        return pace.hold_s

    def _push(self, p: SimEngine, f: Flight, end: int, duration_s: float) -> None:
        span = push_range(f.next_block, end, len(f.prompt), self.block_size, self.links.policy.scheduled)
        if span.num_blocks:
            nbytes = span.num_blocks * self.block_bytes
            if span.superseded:
                f.superseded += self.block_bytes
            self.life.bytes_sent += nbytes
            ports = (self.ports[p.name], self.ports[f.decode.name])
            last = f.in_air[-1] if f.in_air else None  # the transfer's flow still in the air takes the chunk
            if last is not None and last.links == ports and self.links.extend(last, nbytes, duration_s):
                f.next_block = span.next_block
                return
            f.flows += 1
            sent: list = []  # the flow, whose bytes grow with the chunks that join it
            flow = self.links.start(ports, nbytes, duration_s,
                                    lambda: self._landed(f, sent[0].nbytes if sent else nbytes), f.tier, f.deadline_s)
            if flow is not None:
                sent.append(flow)
                f.in_air.append(flow)
        f.next_block = span.next_block

    def _landed(self, f: Flight, nbytes: float) -> None:
        f.flows -= 1
        f.delivered += nbytes
        self.life.bytes_delivered += nbytes
        self._maybe_done(f, 0.0)

    def _maybe_done(self, f: Flight, delay_s: float) -> None:
        if f.prefilled and f.flows == 0 and not f.done_sent and not f.finished:
            f.done_sent = True
            d = f.decode
            d.post(lambda: self.ready[d.name].append(f), delay_s)

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
            self._act(self._core("relanded", rid, now + self.control_s, eta - self.control_s))

    def _recheck(self, name: str) -> None:
        """As the real prefill worker's loop: every LANDING_RECHECK_S while its prefilled transfers are in the
        air, the landings that moved since last reported (a flow sharing their port ended, or began)."""
        now = self.loop.now
        self._relanded(self.landings.recheck(name, now), now)
        if self.landings.soon.get(name):
            self.loop.at(now + LANDING_RECHECK_S, self._recheck, name)
        else:
            self._rechecking.discard(name)

    def _consumed(self, f: Flight, start_s: float) -> None:
        blocks = round((f.delivered - f.superseded) / self.block_bytes)
        self.life.bytes_consumed += f.delivered - f.superseded
        self.life.blocks_consumed += blocks
        self._act(self._core("consumed", f.rid, start_s))
