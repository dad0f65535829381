"""The prefill worker's books of prefill/decode disaggregation: torch-free decisions both clocks run.

A prefill worker producing a prompt's KV for a decode worker keeps one `Outbound` record per transfer: where it
goes (the far end, its link, its service tier and delivery deadline), which block-table index is the first not
yet delivered in full (`push`: the blocks each computed layer sends, `pdserve.core.pd.push_range`), and whether
it failed. When its request ends here, a prefilled transfer whose chunks still wait for the link is *closing*:
its closing record (with the first token) goes after its last chunk (`drained`); any other closes at once.
Blocks the receiver reads in place stay *lent* after the close, until the receiver says it took them or the
lease runs out (`release`). The receiver's lease of each transfer is renewed with an `alive` record whenever the
transfer sent nothing for a third of it (`keepalive_due`): waiting for a link here is not a failed delivery; a
dead or hung sender is (its leases lapse). Landing estimates reported for prefilled transfers still on the link
are re-reported when they move by more than `RELAND_S` (`Landings`).

The real prefill worker (`pdserve.engine.pd.PrefillSide`: pools, transports, the outbox) and the simulator
(`pdserve.sim.kv_push.SimKVPath`: the link model) drive these books; each moves the bytes its own way. Every
method takes the time it runs at (`now`): the books read no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pdserve.core.pd.delivery import RELAND_S
from pdserve.core.pd.push_range import PushRange, push_range
from pdserve.core.pd.sensitivity import DEFAULT as DEFAULT_LABEL


@dataclass(eq=False)
class Outbound:
    rid: str
    dest: str  # the receiving worker's transfer address
    xfer: str
    next_block: int  # first block-table index not yet delivered in full
    num_tokens: int = 0  # the prompt's
    link: str = ""  # the receiving worker's name (the link's far end): its queue and metrics
    tier: str = "default"
    deadline_s: float = float("inf")  # predicted first consumption (the books' clock)
    by_copy: bool = False  # a prompt longer than the hot window: its blocks leave the pool as it goes
    num_chunks: int = 0
    failed: str | None = None
    held: set[int] = field(default_factory=set)  # blocks the receiver reads in place: kept until it took them
    last_sent_s: float = 0.0  # when a record of this transfer last went out (a chunk or an `alive`)
    wire_format: str | None = None  # the KV format it travels in (`pdserve.core.pd.wire_format`)
    first_token: int | None = None  # sampled here; sent with the closing record
    logprobs: dict | None = None  # and its logprobs, the prompt's, when asked for
    sensitivity: str = DEFAULT_LABEL  # its KV's label: in every chunk's header (`pdserve.core.pd.sensitivity`)

    @property
    def holder(self) -> str:
        return f"xfer:{self.xfer}"


@dataclass
class Lent:
    holder: str
    dest: str
    mark: int  # the sender's position after the transfer's last record
    deadline_s: float


class Landings:
    """The landing time last reported for each prefilled transfer still on its link: which estimates moved by
    more than `RELAND_S` since (another transfer became due on the link, or the link's rate changed)."""

    def __init__(self) -> None:
        self.reported: dict[str, float] = {}  # rid -> landing time last reported

    def __bool__(self) -> bool:
        return bool(self.reported)

    def report(self, rid: str, at_s: float) -> None:
        self.reported[rid] = at_s

    def moved(self, now: float, landing_in_s: Callable[[str], float | None]) -> list[tuple[str, float]]:
        """[(rid, landing from now)] of the transfers whose landing moved; `landing_in_s(rid)` None: no longer
        on the link (forgotten)."""
        out = []
        for rid, last in list(self.reported.items()):
            landing = landing_in_s(rid)
            if landing is None:
                del self.reported[rid]
            elif abs(now + landing - last) > RELAND_S:
                self.reported[rid] = now + landing
                out.append((rid, landing))
        return out


class PrefillBooks:
    def __init__(self, block_size: int, lease_s: float) -> None:
        self.block_size = block_size
        self.lease_s = lease_s
        self.outbound: dict[str, Outbound] = {}  # producing here (or queued for a step)
        self.closing: dict[str, Outbound] = {}  # prefilled here, chunks still queued for the link
        self.lent: list[Lent] = []
        self.landings = Landings()
        self.keepalives_sent = 0

    def open(self, out: Outbound) -> Outbound:
        self.outbound[out.rid] = out
        return out

    def live(self) -> Iterable[Outbound]:
        """Every transfer this worker holds: producing, queued, or closing."""
        return [*self.outbound.values(), *self.closing.values()]

    def push(self, rid: str, end: int, cold: int = 0, advance: bool = True) -> tuple[Outbound, PushRange] | None:
        """A step computed `rid`'s prompt up to token `end` (one layer of it): which blocks go now; None for a
        request with no live transfer. `cold`: blocks of a long prompt that already left the pool (sent when
        computed). `advance`: the step's last layer (the next step starts after what this one sent)."""
        out = self.outbound.get(rid)
        if out is None or out.failed:
            return None
        span = push_range(out.next_block, end, out.num_tokens, self.block_size, cold)
        if advance:
            out.next_block = span.next_block
        return out, span

    def keepalive_due(self, now: float) -> list[Outbound]:
        """The live transfers that sent nothing for a third of the lease: an `alive` renews the receiver's lease."""
        return [out for out in self.live() if not out.failed and now - out.last_sent_s >= self.lease_s / 3]

    def sent(self, out: Outbound, now: float, alive: bool = False) -> None:
        """A record of `out` went out at `now` (`alive`: a keepalive)."""
        out.last_sent_s = now
        self.keepalives_sent += alive

    def finish(self, rid: str, prefilled: bool, queued: bool, first_token: int | None = None,
               logprobs: dict | None = None) -> tuple[Outbound | None, bool]:
        """`rid` ended here (`prefilled`: its first token sampled; `queued`: chunks still wait for the link).
        -> (its transfer or None, close now): a prefilled transfer with chunks queued closes after the last."""
        out = self.outbound.pop(rid, None) or self.closing.pop(rid, None)
        if out is None:
            return None, False
        out.logprobs = logprobs
        if prefilled and not out.failed and queued:
            out.first_token, self.closing[rid] = first_token, out
            return out, False
        return out, True

    def drained(self, out: Outbound) -> bool:
        """`out`'s last queued chunk left: True when it was closing (its closing record goes now)."""
        if self.closing.get(out.rid) is not out:
            return False
        del self.closing[out.rid]
        return True

    def lend(self, out: Outbound, mark: int, now: float) -> None:
        """`out` closed; the blocks the receiver reads in place stay until it took them, or the lease ends."""
        if out.held:
            self.lent.append(Lent(out.holder, out.dest, mark, now + self.lease_s))

    def release(self, now: float, consumed: Callable[[Lent], bool]) -> list[Lent]:
        """The lent transfers the receiver has taken (`consumed`) or whose lease ran out: their blocks go free."""
        done = [lent for lent in self.lent if consumed(lent) or now > lent.deadline_s]
        self.lent = [lent for lent in self.lent if lent not in done]
        return done

    def peer_gone(self, dest: str) -> tuple[list[Outbound], list[Lent]]:
        """The receiver at `dest` died: its transfers end here without a word to it, and what was lent to it
        goes free. -> (the transfers ended, the loans ended)."""
        gone = [out for out in self.live() if out.dest == dest]
        for out in gone:
            self.outbound.pop(out.rid, None)
            self.closing.pop(out.rid, None)
            self.landings.reported.pop(out.rid, None)
        lent = [lent for lent in self.lent if lent.dest == dest]
        self.lent = [lent for lent in self.lent if lent.dest != dest]
        return gone, lent

    def unproduced_bytes(self, link: str, tiers: set[str], block_bytes: float, but: Outbound | None = None) -> float:
        """KV this worker took for `link` (transfers of `tiers`, other than `but`) and has not produced yet: the
        backlog the link will carry beyond what is queued on it now."""
        return sum((-(-out.num_tokens // self.block_size) - out.next_block) * block_bytes
                   for out in self.outbound.values()
                   if out is not but and out.link == link and out.tier in tiers and not out.failed)

    def failed_requests(self) -> list[str]:
        return [rid for rid, out in self.outbound.items() if out.failed]
