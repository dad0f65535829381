"""Production paced by delivery, per link: how many prompt tokens a prefill step may compute for each.

`WaterLevel` says a link is backed up when it needs more than `--delivery-backlog-s` to send what is queued
for it. Holding the whole prefill worker then (as `pdserve.core.pd.delivery` did alone) has two faults: one slow
link holds the prompts bound for every other decode worker, and one step (a 2,048-token chunk of a
135M-parameter model is ~90 MB of fp32 KV) overshoots the water level by far more than the link sends
meanwhile. The pace works per link (a prefill -> decode worker pair; in the simulator the pair of ports):

* a **held** link (above the water level) gets no prompt tokens this step: its running prefills pause at the
  chunk boundary, keeping their blocks, and its waiting prompts step aside so that prompts bound for other
  links start (`Scheduler._admit_waiting`);
* below it, a step computes at most the tokens whose KV fills the **headroom**, (water level - backlog
  seconds) x the link's rate: the prefill chunk shrinks as the link congests and the queue overshoots the
  water level by at most `min_tokens` (one KV block: a prompt keeps moving while there is any headroom);
* a request with no link (a stage or warm pass: its KV goes to the host tier), a link whose rate is not known
  yet and a water level of 0 are not paced.

The worker is held as a whole (`hold_s`) only when every request it has is bound for a held link. The tiers
counted on a link are those at or above the best tier among the prompts bound for it (`counted_tiers`): a
priority prompt is not held behind a flex backlog. One copy for both clocks: the real prefill worker builds the
pace from its outbox (`PrefillSide.pace`), the simulator from its ports (`SimConductor.pace`); each step's
scheduler takes its grants (`Scheduler.pace`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from pdserve.core.pd.delivery import WaterLevel, counted_tiers

# (queued bytes of the counted tiers, rate in bytes/s or None) of each constraint on a link: the real link
# has one, a simulated pair two (the sender's egress port and the receiver's ingress port)
Backlog = Callable[[str, set], Iterable[tuple[float, float | None]]]


class ProductionPace:
    def __init__(self, bytes_per_token: float, min_tokens: int, link_of: Callable[[str], str | None],
                 counts: Counter | None = None) -> None:
        self.bytes_per_token = bytes_per_token
        self.min_tokens = min_tokens
        self.link_of = link_of
        self.headroom: dict[str, float] = {}  # link -> bytes this step may still add (absent: not paced)
        self.held: dict[str, float] = {}  # link -> seconds until it is below the water level again
        self.hold_s = 0.0  # the whole worker: > 0 only when all its requests are bound for held links
        self.granted: set[str] = set()  # links a chunk got tokens for this step
        self.counts = counts if counts is not None else Counter()  # chunks `capped`, prompts `held`

    @classmethod
    def build(cls, requests, link_of: Callable[[str], str | None], backlog: Backlog, water: WaterLevel,
              bytes_per_token: float, min_tokens: int, counts: Counter | None = None) -> ProductionPace:
        pace = cls(bytes_per_token, min_tokens, link_of, counts)
        by_link: dict[str, list] = {}
        unpaced = False
        for req in requests:
            link = link_of(req.request_id)
            unpaced |= link is None
            if link is not None:
                by_link.setdefault(link, []).append(req)
        for link, reqs in by_link.items():
            pace._measure(link, backlog(link, counted_tiers(reqs)), water)
        if by_link and not unpaced and len(pace.held) == len(by_link):
            pace.hold_s = min(pace.held.values())
        return pace

    def _measure(self, link: str, constraints, water: WaterLevel) -> None:
        room = None
        for queued, rate in constraints:
            hold = water.hold_s(queued, rate)
            if hold > 0:
                self.held[link] = max(hold, self.held.get(link, 0.0))
            if rate and water.high_s > 0:
                left = max(water.high_s * rate - queued, 0.0)
                room = left if room is None else min(room, left)
        if link in self.held:
            self.headroom[link] = 0.0
        elif room is not None:
            self.headroom[link] = room

    def blocked(self, request_id: str) -> bool:
        """No tokens for `request_id` this step: its link is held, or its headroom went to earlier chunks."""
        link = self.link_of(request_id)
        if link is None:
            return False
        return link in self.held or (link in self.granted and self.headroom[link] < self.bytes_per_token)

    def cap(self, request_id: str, n: int) -> int:
        """At most `n` tokens for a chunk of `request_id`: what its link's headroom takes (the link's first
        chunk of the step at least `min_tokens`; 0 when `blocked`)."""
        link = self.link_of(request_id)
        room = None if link is None else self.headroom.get(link)
        if room is None:
            return n
        if self.blocked(request_id):  # held: other links' prompts run; capped: the step's headroom is spent
            self.counts["held" if link in self.held else "capped"] += 1
            return 0
        floor = 0 if link in self.granted else self.min_tokens
        got = min(n, max(int(room // self.bytes_per_token), floor))
        if got < n:
            self.counts["capped"] += 1
        return got

    def spend(self, request_id: str, tokens: int) -> None:
        """A chunk of `tokens` was scheduled: its KV takes that much of its link's headroom."""
        link = self.link_of(request_id)
        if link is not None and link in self.headroom and tokens:
            self.granted.add(link)
            self.headroom[link] = max(self.headroom[link] - tokens * self.bytes_per_token, 0.0)
