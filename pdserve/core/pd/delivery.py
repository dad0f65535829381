"""Delivery scheduling: which KV goes over a link next, and at what rate. One copy for both clocks.

A link (a prefill worker -> decode worker pair; in the simulator an engine's network port) carries the KV
of several transfers at once. Two policies (`--delivery`):

* `fifo` — today's baseline: the real sender sends chunks in the order they were produced; the simulator's
  link splits its bandwidth equally among the flows in the air;
* `scheduled` — by service tier and deadline. Each tier has a bandwidth share (`--link-share
  priority=0.5,default=0.4,flex=0.1`); a tier's share goes to its transfer with the earliest deadline (the
  conductor's predicted consumption time), then the next; share a tier does not use goes to the tiers with
  demand in proportion to their shares (work-conserving: the link never idles while anything waits).

A transfer's deadline is its predicted consumption. Once its prompt is prefilled, what is left of it is
**due**: due KV goes before KV still being produced, whatever the tiers (shares and deadlines order the due
KV among itself, and the rest among itself): a decode worker is waiting for it now, while KV in production
cannot be consumed before its prompt is done. A due transfer's landing estimate (`LinkQueue.bytes_until`,
the simulator's `LinkModel.eta`) then holds while new transfers arrive.

The real sender moves discrete chunks: `LinkQueue.pick` takes the next one by start-time fair queueing over
the tiers (the tier with the fewest bytes sent per unit of share goes next: over a busy period each tier
gets its share, a tier back from idle cannot claim the time it was idle), earliest deadline first within a
tier. The simulator moves fluid flows: `DeliveryPolicy.rates` splits a capacity among flows by the same
shares and order (water-filling: a flow capped by its production rate leaves the rest to the next one).
`TokenBucket` throttles a real link to a given rate (`--link-gbps`), to emulate a slower network.

Backpressure (`WaterLevel`): a link is backed up while it would need more than `--delivery-backlog-s` to
send what is queued (real: chunks queued; simulator: bytes of the flows in the air) of the tiers at or above
the best tier of the prompts bound for it (`counted_tiers`: a priority arrival is not held behind a flex
backlog). Production is paced per link by it (`pdserve.core.pd.production_pace`): a backed-up link's prompts
wait, below the level a chunk is cut to what the link takes before it, and a worker whose prompts all wait
pauses until delivery catches up, instead of piling up KV the links cannot carry.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdserve.core.service_tiers import SERVICE_TIERS
# the delivery settings' grammar (`--delivery`, `--link-share`) lives with the settings
from pdserve.core.settings import DEFAULT_SHARES, DeliverySettings, check_mode, default_of

RELAND_S = 0.001  # a prefilled transfer's landing estimate that moved by more than this is reported again
LANDING_RECHECK_S = 0.05  # while prefilled transfers are in the air, their landings are re-estimated this often
# "on time": a transfer's KV first consumed within +-5 ms of its predicted consumption (its deadline): the
# conductor's consumption tails, the simulator's and `pdserve bench`'s predictability shares
CONSUME_TOLERANCE_S = 0.005
_EPS = 1e-12


@dataclass(eq=False)
class Item:
    """One thing waiting for (or, in the simulator, moving over) a link."""
    key: object  # the caller's: a chunk, a flow
    tier: str = "default"
    deadline_s: float = float("inf")
    nbytes: float = 0.0
    seq: int = 0  # arrival order on the link
    cap: float = float("inf")  # fluid only: the most bytes/s it can take now (its production rate)
    due: bool = False  # its prompt is prefilled: it goes before what is still being produced


class DeliveryPolicy:
    def __init__(self, mode: str = default_of(DeliverySettings, "delivery"), shares: dict[str, float] | None = None
                 ) -> None:
        self.mode = check_mode(mode)
        self.shares = dict(DEFAULT_SHARES if shares is None else shares)

    @property
    def scheduled(self) -> bool:
        return self.mode == "scheduled"

    def share(self, tier: str) -> float:
        return self.shares.get(tier, 0.0)

    def order_key(self, item: Item) -> tuple:
        """Within a tier (scheduled) or the whole link (fifo)."""
        return (item.deadline_s, item.seq) if self.scheduled else (item.seq,)

    def rates(self, items: Iterable[Item], capacity: float) -> dict[Item, float]:
        """Split `capacity` bytes/s among fluid flows: fifo equally (each up to its cap, the rest shared
        again); scheduled by tier share, earliest deadline first within a tier."""
        items = list(items)
        if len(items) == 1 and capacity >= 1.0:  # alone on the link (the common case): up to its cap
            return {items[0]: max(0.0, min(items[0].cap, capacity))}  # (what either split below gives it)
        if not self.scheduled:
            return _equal_split(items, capacity)
        out = {it: 0.0 for it in items}
        left = capacity
        for due in (True, False):  # a prefilled transfer's rest first, then what is being produced
            left -= self._share_out([it for it in items if it.due == due], out, left)
        return out

    def _share_out(self, items: list[Item], out: dict[Item, float], capacity: float) -> float:
        """Give `capacity` to `items` by tier share (water-filling), earliest deadline first within a tier;
        returns what was given."""
        groups = _by_tier(items, self.order_key)
        left = capacity
        while left > _EPS * max(capacity, 1.0):
            wanting = {t: g for t, g in groups.items() if any(out[it] < it.cap for it in g)}
            if not wanting:
                break
            weights = {t: self.share(t) for t in wanting}
            total = sum(weights.values())
            if total <= 0:  # only unshared tiers wait: split equally among them
                weights, total = {t: 1.0 for t in wanting}, float(len(wanting))
            given = 0.0
            for tier, group in wanting.items():
                given += _fill_in_order(group, out, left * weights[tier] / total)
            if given <= _EPS * max(capacity, 1.0):
                break
            left -= given
        return capacity - left


def _by_tier(items: list[Item], key: Callable[[Item], tuple]) -> dict[str, list[Item]]:
    groups: dict[str, list[Item]] = {}
    for it in items:
        groups.setdefault(it.tier, []).append(it)
    return {t: sorted(g, key=key) for t, g in groups.items()}


def _fill_in_order(group: list[Item], out: dict[Item, float], budget: float) -> float:
    """Give `budget` to the items in order, each up to its cap; returns what was given."""
    given = 0.0
    for it in group:
        room = it.cap - out[it]
        if room <= 0:
            continue
        take = min(room, budget - given)
        out[it] += take
        given += take
        if budget - given <= 0:
            break
    return given


def _equal_split(items: list[Item], capacity: float) -> dict[Item, float]:
    out = {it: 0.0 for it in items}
    open_, left = sorted(items, key=lambda it: it.cap), capacity
    while open_:
        each = left / len(open_)
        it = open_[0]
        if it.cap - out[it] <= each:  # capped below an equal share: take the cap, share the rest again
            left -= it.cap - out[it]
            out[it] = it.cap
            open_.pop(0)
            continue
        for it in open_:
            out[it] += each
        break
    return out


class LinkQueue:
    """Chunks waiting for one real link, in policy order (`pick`). Kept per (tier, due) in heaps by the
    policy's order key, with lazy removal, so a link with tens of thousands of small chunks queued (a
    congested link's chunks are small: `Outbox.chunk_blocks`) costs O(log n) per push and pick, not O(n)."""

    def __init__(self, policy: DeliveryPolicy) -> None:
        self.policy = policy
        self.sent_per_share: dict[str, float] = {}  # virtual time per tier (scheduled)
        self._seq = itertools.count()
        self._items: dict[int, Item] = {}  # seq -> item, in push order
        self._heaps: dict[tuple[str, bool], list] = {}  # (tier, due) -> [(order key, item)]
        self._count: Counter = Counter()  # tier -> items queued
        self._due: Counter = Counter()  # tier -> due items queued
        self._bytes: Counter = Counter()  # tier -> bytes queued

    def __len__(self) -> int:
        return len(self._items)

    @property
    def items(self) -> list[Item]:
        return list(self._items.values())

    def queued_bytes(self, tiers: set[str]) -> float:
        """Bytes queued of `tiers`."""
        return sum(self._bytes[t] for t in tiers)

    def push(self, key: object, nbytes: float, tier: str = "default", deadline_s: float = float("inf")) -> Item:
        item = Item(key, tier, deadline_s, nbytes, next(self._seq))
        if self.policy.scheduled and not self._count[tier]:
            # back from idle: start at the busiest tier's virtual time, not where it stopped
            busy = [v for t, v in self.sent_per_share.items() if self._count[t]]
            self.sent_per_share[tier] = max(self.sent_per_share.get(tier, 0.0), min(busy, default=0.0))
        self._add(item)
        return item

    def _add(self, item: Item) -> None:
        self._items[item.seq] = item
        self._count[item.tier] += 1
        self._due[item.tier] += item.due
        self._bytes[item.tier] += item.nbytes
        self._enheap(item)

    def _enheap(self, item: Item) -> None:
        heapq.heappush(self._heaps.setdefault((item.tier, item.due), []), (self.policy.order_key(item), item))

    def _remove(self, item: Item) -> None:
        del self._items[item.seq]
        self._count[item.tier] -= 1
        self._due[item.tier] -= item.due
        self._bytes[item.tier] -= item.nbytes

    def _top(self, tier: str, due: bool) -> Item:
        """The first live item of (tier, due) in order (stale heap entries dropped on the way)."""
        heap = self._heaps[(tier, due)]
        while True:
            key, item = heap[0]
            if self._items.get(item.seq) is item and item.due == due and key == self.policy.order_key(item):
                return item
            heapq.heappop(heap)

    def pick(self) -> Item | None:
        """Remove and return the next item to send."""
        if not self._items:
            return None
        policy = self.policy
        if policy.scheduled:
            due = any(self._due.values())  # a prefilled transfer's rest first
            tiers = [t for t, n in (self._due if due else self._count).items() if n]
            tier = min(tiers, key=lambda t: (self.sent_per_share.get(t, 0.0), -policy.share(t), t))
            item = self._top(tier, due)
            self.sent_per_share[tier] = self.sent_per_share.get(tier, 0.0) + item.nbytes / self._share(tier)
        else:
            item = next(iter(self._items.values()))  # push order
        self._remove(item)
        return item

    def _share(self, tier: str) -> float:
        """The share a tier's virtual time advances by (a tier without one: a hundredth of the smallest)."""
        return self.policy.share(tier) or min((s for s in self.policy.shares.values() if s > 0), default=1.0) / 100

    def expedite(self, mine: Callable[[Item], bool], now: float) -> None:
        """The items `mine` picks are due from `now` on (a prefilled transfer's rest): among due items of a
        tier, the first due goes first."""
        for it in self._items.values():
            if mine(it):
                self._due[it.tier] += not it.due
                it.due, it.deadline_s = True, now
                self._enheap(it)  # its old heap entry is stale now

    def bytes_until(self, mine: Callable[[Item], bool]) -> float:
        """Bytes this link sends before the last of the items `mine` picks is out (in `pick` order, nothing
        new arriving): the link's estimate of when a transfer lands, times its rate. For a due transfer of one
        tier under `scheduled` (the case of a prefilled transfer), from the tiers' virtual times: exact but
        for at most one item per other tier; otherwise by replaying `pick`."""
        mine_items = [it for it in self._items.values() if mine(it)]
        if not mine_items:
            return 0.0
        if not self.policy.scheduled:
            last = max(it.seq for it in mine_items)
            return sum(it.nbytes for it in self._items.values() if it.seq <= last)
        tier = mine_items[0].tier
        if all(it.due and it.tier == tier for it in mine_items):
            return self._due_bytes_until(tier, max(self.policy.order_key(it) for it in mine_items))
        return self._replay_until(mine, len(mine_items))

    def _due_bytes_until(self, tier: str, last_key: tuple) -> float:
        """Due items go first, tiers interleaved by virtual time: `tier` sends its due bytes up to `last_key`;
        each other tier with due items, what its share allows until `tier`'s virtual time gets there."""
        key = self.policy.order_key
        own = sum(it.nbytes for it in self._items.values() if it.due and it.tier == tier and key(it) <= last_key)
        end = self.sent_per_share.get(tier, 0.0) + own / self._share(tier)
        due_bytes: Counter = Counter()
        for it in self._items.values():
            if it.due and it.tier != tier:
                due_bytes[it.tier] += it.nbytes
        others = sum(min(b, max(end - self.sent_per_share.get(t, 0.0), 0.0) * self._share(t))
                     for t, b in due_bytes.items())
        return own + others

    def _replay_until(self, mine: Callable[[Item], bool], left: int) -> float:
        trial = LinkQueue(self.policy)
        trial.sent_per_share = dict(self.sent_per_share)
        for it in self._items.values():
            trial._add(it)  # (the same items: pick only reads them)
        total = 0.0
        while left:
            item = trial.pick()
            total += item.nbytes
            left -= mine(item)
        return total

    def drop(self, keep: Callable[[Item], bool]) -> list[Item]:
        """Remove the items `keep` refuses (a failed or aborted transfer's); returns them."""
        gone = [it for it in self._items.values() if not keep(it)]
        for it in gone:
            self._remove(it)
        return gone


class TokenBucket:
    """A link throttled to `rate` bytes/s with a burst of `burst` bytes (`--link-gbps`): `wait_s(now)` is how
    long until the next send may start; a send may take the bucket below zero (whole chunks go at once), the
    debt is paid back before the next one."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.last_s = burst, None

    def _refill(self, now: float) -> None:
        if self.last_s is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.last_s) * self.rate)
        self.last_s = now

    def wait_s(self, now: float) -> float:
        self._refill(now)
        wait = -self.tokens / self.rate
        return wait if wait > 1e-9 else 0.0  # (a rounding residue is no debt)

    def take(self, nbytes: float, now: float) -> None:
        self._refill(now)
        self.tokens -= nbytes


@dataclass(frozen=True)
class WaterLevel:
    """Pause production above `high_s` seconds of queued delivery."""
    high_s: float = default_of(DeliverySettings, "delivery_backlog_s")

    def hold_s(self, queued_bytes: float, rate: float | None) -> float:
        """How long production should wait (0: go on)."""
        if not rate or self.high_s <= 0:
            return 0.0
        hold = queued_bytes / rate - self.high_s
        return hold if hold > 1e-6 else 0.0  # (a microsecond is no wait: time must move on)


def counted_tiers(requests) -> set[str]:
    """The tiers whose queued KV holds back production for these requests: the best one's and above."""
    best = min((SERVICE_TIERS.index(r.service_tier) if r.service_tier in SERVICE_TIERS else len(SERVICE_TIERS) for r in requests),
               default=None)
    return set() if best is None else set(SERVICE_TIERS[:best + 1])
