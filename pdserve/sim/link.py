"""Link model for KV delivery: latency + bytes / bandwidth, with contention.

Each engine has a network port (`Link`) of `bandwidth` bytes/s: a prefill engine's egress and a decode
engine's ingress. A flow crosses both ports of its pair; each port splits its bandwidth equally among its
active flows, and a flow runs at the smaller of its two shares. While its data is still being produced
(layer-by-layer push during a prefill step), a flow is also capped at the production rate, so it cannot
finish before the step does. Rates are recomputed whenever a flow starts or ends; the loop gets one wake-up
for the earliest completion or cap change. A finished flow's callback runs `latency_s` later.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.sim.events import MESSAGE, EventLoop


@dataclass(eq=False)
class Link:
    name: str
    bandwidth: float
    flows: dict = field(default_factory=dict)  # insertion-ordered (a set's order would vary by run)
    bytes: float = 0.0
    busy_s: float = 0.0  # time with at least one active flow


@dataclass(eq=False)
class Flow:
    links: tuple[Link, ...]
    nbytes: float
    remaining: float
    cap_rate: float  # production rate while producing
    cap_until: float
    on_done: Callable[[], None]
    rate: float = 0.0


class LinkModel:
    def __init__(self, loop: EventLoop, latency_s: float = 20e-6) -> None:
        self.loop = loop
        self.latency_s = latency_s
        self.links: dict[str, Link] = {}
        self.flows: dict[Flow, None] = {}
        self._last = 0.0
        self._version = itertools.count()
        self._current = -1

    def link(self, name: str, bandwidth: float) -> Link:
        return self.links.setdefault(name, Link(name, bandwidth))

    def start(self, links: tuple[Link, ...], nbytes: float, produce_s: float, on_done: Callable[[], None]) -> None:
        """Move `nbytes` over `links`, produced evenly over the next `produce_s` seconds."""
        now = self.loop.now
        self._advance(now)
        if nbytes <= 0:
            self.loop.at(now + self.latency_s, on_done, prio=MESSAGE)
            return
        cap = nbytes / produce_s if produce_s > 0 else float("inf")
        flow = Flow(links, nbytes, nbytes, cap, now + produce_s, on_done)
        self.flows[flow] = None
        for link in links:
            link.flows[flow] = None
        self._reschedule(now)

    def _advance(self, now: float) -> None:
        dt = now - self._last
        if dt > 0:
            for flow in self.flows:
                flow.remaining -= flow.rate * dt
            for link in self.links.values():
                if link.flows:
                    link.busy_s += dt
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

    def _reschedule(self, now: float) -> None:
        nxt = float("inf")
        for flow in self.flows:
            share = min(link.bandwidth / len(link.flows) for link in flow.links)
            producing = now < flow.cap_until
            flow.rate = min(share, flow.cap_rate) if producing else share
            nxt = min(nxt, now + max(flow.remaining, 0.0) / flow.rate)
            if producing and flow.cap_rate < share:
                nxt = min(nxt, flow.cap_until)
        self._current = next(self._version)
        if nxt < float("inf"):
            self.loop.at(max(nxt, now), self._wake, self._current, prio=MESSAGE)

    def stats(self, duration_s: float) -> dict:
        """Per-link bytes, utilization over the run, and effective utilization while busy."""
        out = {}
        for link in self.links.values():
            if link.bytes or link.busy_s:
                out[link.name] = {"bytes": link.bytes, "busy_s": link.busy_s,
                                  "utilization": link.bytes / (link.bandwidth * duration_s) if duration_s else 0.0,
                                  "effective_utilization": link.bytes / (link.bandwidth * link.busy_s)
                                  if link.busy_s else 0.0}
        return out
