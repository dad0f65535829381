"""Link model for KV delivery: latency + bytes / bandwidth, with contention.

Each engine has a network port (`Link`) of `bandwidth` bytes/s: a prefill engine's egress and a decode
engine's ingress. A flow crosses both ports of its pair; each port splits its bandwidth among its active
flows by the delivery policy (`pdserve.core.pd.delivery.DeliveryPolicy.rates`, the code the real sender orders
its chunks by: `fifo` equally, `scheduled` by service tier share and earliest deadline), and a flow runs at
the smaller of its two allocations. While its data is still being produced (layer-by-layer push during a
prefill step), a flow that has caught up with its production is also capped at the production rate, so it
cannot finish before the step does. A transfer's next chunk joins its flow still in the air (`extend`), as
the real sender queues a transfer's chunks in order: a link carries one flow per transfer, not one per
prefill step (production paced to a link's headroom cuts prompts into many small chunks).
Rates are recomputed whenever a flow starts or ends; the loop gets one wake-up for the earliest completion
or cap change. A finished flow's callback runs `latency_s` later.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.core.pd.delivery import DeliveryPolicy, Item
from pdserve.core.pd.prefill_books import Landings
from pdserve.sim.events import MESSAGE, EventLoop

ALLOCATION_ROUNDS = 3


@dataclass(eq=False)
class Link:
    name: str
    bandwidth: float
    flows: dict = field(default_factory=dict)  # insertion-ordered (a set's order would vary by run)
    bytes: float = 0.0
    busy_s: float = 0.0  # time with at least one active flow
    demand_s: float = 0.0  # time with a backlog: a flow this link holds back (not production-bound)
    demand_bytes: float = 0.0  # carried meanwhile


@dataclass(eq=False)
class Flow:
    links: tuple[Link, ...]
    nbytes: float
    remaining: float
    cap_rate: float  # production rate while producing
    cap_until: float
    on_done: Callable[[], None]
    item: Item
    rate: float = 0.0
    limit: float = float("inf")  # its production rate now (inf once produced)
    bottleneck: Link | None = None  # the link that gives it the least


class LinkModel:
    def __init__(self, loop: EventLoop, latency_s: float = 20e-6, policy: DeliveryPolicy | None = None) -> None:
        self.loop = loop
        self.latency_s = latency_s
        self.policy = policy or DeliveryPolicy("fifo")
        self._seq = itertools.count()
        self.links: dict[str, Link] = {}
        self.flows: dict[Flow, None] = {}
        self._last = 0.0
        self._version = itertools.count()
        self._current = -1

    def link(self, name: str, bandwidth: float) -> Link:
        return self.links.setdefault(name, Link(name, bandwidth))

    def start(self, links: tuple[Link, ...], nbytes: float, produce_s: float, on_done: Callable[[], None],
              tier: str = "default", deadline_s: float = float("inf")) -> Flow | None:
        """Move `nbytes` over `links`, produced evenly over the next `produce_s` seconds; `tier` and
        `deadline_s` (its predicted consumption) for the delivery policy."""
        now = self.loop.now
        self._advance(now)
        if nbytes <= 0:
            self.loop.at(now + self.latency_s, on_done, prio=MESSAGE)
            return None
        cap = nbytes / produce_s if produce_s > 0 else float("inf")
        flow = Flow(links, nbytes, nbytes, cap, now + produce_s, on_done,
                    Item(None, tier, deadline_s, nbytes, next(self._seq)))
        self.flows[flow] = None
        for link in links:
            link.flows[flow] = None
        self._reschedule(now)
        return flow

    def extend(self, flow: Flow, nbytes: float, produce_s: float) -> bool:
        """`nbytes` more for `flow`, produced evenly over the next `produce_s` seconds, after what it still
        has to send; False if it has landed (start a new one)."""
        if flow not in self.flows:
            return False
        now = self.loop.now
        self._advance(now)
        unproduced = flow.cap_rate * (flow.cap_until - now) if now < flow.cap_until else 0.0
        flow.nbytes += nbytes
        flow.remaining += nbytes
        flow.item.nbytes += nbytes
        flow.cap_rate = (unproduced + nbytes) / produce_s if produce_s > 0 else float("inf")
        flow.cap_until = now + produce_s
        self._reschedule(now)
        return True

    def _advance(self, now: float) -> None:
        dt = now - self._last
        if dt > 0:
            for flow in self.flows:
                flow.remaining -= flow.rate * dt
            for link in self.links.values():
                if link.flows:
                    link.busy_s += dt
                    if any(f.bottleneck is link and f.rate < f.limit * (1 - 1e-9) for f in link.flows):
                        link.demand_s += dt
                        link.demand_bytes += sum(f.rate for f in link.flows) * dt
        self._last = now

    def _wake(self, version: int) -> None:
        if version != self._current:
            return
        now = self.loop.now
        self._advance(now)
        for flow in [f for f in self.flows if f.remaining <= 1e-9 * f.nbytes + 1e-6]:
            del self.flows[flow]
            for link in flow.links:
                del link.flows[flow]
                link.bytes += flow.nbytes
            self.loop.at(now + self.latency_s, flow.on_done, prio=MESSAGE)
        self._reschedule(now)

    def _rates(self, flows, now: float, remaining: dict | None = None) -> dict[Flow, float]:
        """Each flow's rate now: the smaller of its allocations at its links (the delivery policy's). A flow
        held back at one of its links leaves the rest of its allocation at the other to the next flows: the
        allocation is repeated with each flow capped by what its other link gave it, a few rounds.
        `remaining`: bytes left per flow, if not the flows' own (a look ahead)."""
        prod = {f: production_cap(f, f.remaining if remaining is None else remaining[f], now) for f in flows}
        links = list(dict.fromkeys(link for flow in flows for link in flow.links))
        given: dict = {}  # (flow, link) -> allocation
        asked: dict = {}  # link -> the caps its last allocation was made with (the same caps: the same shares)
        for _ in range(ALLOCATION_ROUNDS if len(links) > 1 else 1):
            for link in links:
                mine = [f for f in link.flows if f in prod]
                caps = []
                for f in mine:
                    f.item.cap = min([prod[f]] + [given[f, o] for o in f.links if o is not link and (f, o) in given])
                    caps.append(f.item.cap)
                if asked.get(link) == caps:
                    continue
                asked[link] = caps
                shares = self.policy.rates([f.item for f in mine], link.bandwidth)
                for f in mine:
                    given[f, link] = shares[f.item]
        total = {link: sum(given[f, link] for f in link.flows if f in prod) / link.bandwidth for link in links}
        rates = {}
        for f in flows:  # of the links giving it the least, the fullest
            least = min(given[f, link] for link in f.links)
            bottleneck = max((link for link in f.links if given[f, link] <= least * (1 + 1e-9)),
                             key=lambda link: total[link])
            rates[f] = given[f, bottleneck]
            if remaining is None:  # (a look ahead leaves the flows' present state alone: `_advance` reads it)
                f.bottleneck = bottleneck
        return rates

    def _reschedule(self, now: float) -> None:
        nxt = float("inf")
        rates = self._rates(self.flows, now)
        for flow in self.flows:
            flow.rate = rates[flow]
            flow.limit = production_cap(flow, flow.remaining, now)
            if flow.rate > 0:
                nxt = min(nxt, now + max(flow.remaining, 0.0) / flow.rate)
            if now < flow.cap_until:
                nxt = min(nxt, flow.cap_until, now + catch_up_s(flow, flow.remaining, flow.rate, now))
                # (its cap lifts then, or it has caught up with its production: the allocation may change)
        self._current = next(self._version)
        if nxt < float("inf"):
            self.loop.at(max(nxt, now), self._wake, self._current, prio=MESSAGE)

    def queued_bytes(self, link: Link, tiers: set[str]) -> float:
        """Bytes of `tiers` still to cross `link` (of the flows in the air on it)."""
        self._advance(self.loop.now)
        return sum(max(f.remaining, 0.0) for f in link.flows if f.item.tier in tiers)

    def eta(self, targets, expedite: bool = True) -> float:
        """`targets` (a prefilled transfer's flows) are due (made so now, with `expedite`): seconds from now
        until they have landed, if no other flow started meanwhile."""
        now = self.loop.now
        self._advance(now)
        if expedite:
            for f in targets:  # due from now on: after the transfers that were due before (as `expedite`)
                f.item.due, f.item.deadline_s = True, now
            self._reschedule(now)
        left = {f: f.remaining for f in self.flows}
        caps = {f: f.item.cap for f in left}  # the look ahead's allocations set them: put back after
        waiting = [f for f in targets if f in left]
        t = now
        while waiting:
            rates = self._rates(list(left), t, left)
            dt = min([left[f] / r for f, r in rates.items() if r > 0]
                     + [min(f.cap_until - t, catch_up_s(f, left[f], rates[f], t)) for f in left if f.cap_until > t],
                     default=float("inf"))
            if dt == float("inf"):
                break
            t += dt
            for f, r in rates.items():
                left[f] -= r * dt
            for f in [f for f, b in left.items() if b <= 1e-9 * f.nbytes + 1e-6]:
                del left[f]
            waiting = [f for f in waiting if f in left]
        for f, cap in caps.items():
            f.item.cap = cap
        return t - now + self.latency_s

    def stats(self, duration_s: float) -> dict:
        """Per-link bytes, utilization over the run, and effective utilization while busy; bytes carried and
        time while it had a backlog (`demand_*`)."""
        out = {}
        for link in self.links.values():
            if link.bytes or link.busy_s:
                out[link.name] = {"bytes": link.bytes, "busy_s": link.busy_s, "bandwidth": link.bandwidth,
                                  "demand_s": link.demand_s, "demand_bytes": link.demand_bytes,
                                  "utilization": link.bytes / (link.bandwidth * duration_s) if duration_s else 0.0,
                                  "effective_utilization": link.bytes / (link.bandwidth * link.busy_s)
                                  if link.busy_s else 0.0}
        return out


def production_cap(f: Flow, remaining: float, now: float) -> float:
    """The most bytes/s `f` can send now: its production rate once it has caught up with its production
    (nothing it has left is produced yet), else unbounded (produced bytes wait)."""
    if now >= f.cap_until:
        return float("inf")
    unproduced = f.cap_rate * (f.cap_until - now)
    return f.cap_rate if remaining - unproduced <= _slack(f) else float("inf")


def _slack(f: Flow) -> float:
    """Bytes of a flow's lead over its production taken as caught up (float noise of its byte counts: a
    tighter test makes ever smaller catch-up wake-ups that never arrive)."""
    return 1e-6 * f.nbytes + 1.0


def catch_up_s(f: Flow, remaining: float, rate: float, now: float) -> float:
    """Seconds until `f`, sending at `rate` with produced bytes waiting, has caught up with its production
    (inf if it is production-bound already or never catches up)."""
    ahead = remaining - f.cap_rate * (f.cap_until - now)
    if ahead <= _slack(f) or rate <= f.cap_rate:
        return float("inf")
    return ahead / (rate - f.cap_rate)


class LandingWatch:
    """Per prefill engine, its prefilled transfers still in the air and the landing time last reported for
    each (the real worker's books: `pdserve.core.pd.prefill_books.Landings`): which estimates moved when another
    transfer became due — on its own link, or on a decode engine's port it shares with another prefill
    engine's transfers (a real sender sees that as its link's measured rate dropping)."""

    def __init__(self, links: LinkModel, landings_of: Callable[[str], Landings] | None = None) -> None:
        """`landings_of(engine)`: that engine's books' landings (default: the watch keeps its own)."""
        self.links = links
        own: dict[str, Landings] = {}
        self.landings_of = landings_of or (lambda engine: own.setdefault(engine, Landings()))
        self.soon: dict[str, dict] = {}  # engine -> rid -> flight, of the landings reported

    def moved(self, engine: str, f, landing: float, now: float) -> list[tuple[str, float]]:
        """`f` (a flight with `in_air` flows) was prefilled now, landing in `landing` s: [(rid, new ETA)] of
        the others on `engine`'s link whose landing moved by more than `RELAND_S`."""
        out = self.recheck(engine, now)
        if f.in_air:
            self.soon[engine][f.rid] = f
            self.landings_of(engine).report(f.rid, now + landing)
        return out

    def sharing(self, f) -> list[str]:
        """The prefill engines with other prefilled transfers in the air over a port of `f`'s flows."""
        ports = {link for fl in f.in_air for link in fl.links}
        return [e for e, soon in self.soon.items() if soon and any(
            link in ports for g in soon.values() if g is not f for fl in g.in_air for link in fl.links)]

    def recheck(self, engine: str, now: float) -> list[tuple[str, float]]:
        """[(rid, new ETA)] of `engine`'s prefilled transfers in the air whose landing moved by more than
        `RELAND_S` since last reported."""
        soon = self.soon.setdefault(engine, {})

        def landing_in_s(rid: str) -> float | None:
            g = soon[rid]
            g.in_air = [fl for fl in g.in_air if fl in self.links.flows]
            if not g.in_air or g.finished:
                del soon[rid]
                return None
            return self.links.eta(g.in_air, expedite=False)
        return self.landings_of(engine).moved(now, landing_in_s)
