"""A circuit breaker per KV path: (this prefill worker, a receiver, a transport path). Pure: no I/O, no clock
(every time is passed in), so the real prefill worker's senders (`pdserve.transfer.paths`: `PathSender`'s path
choice and the one-path `OnePath`) drive the same rule.

* closed: sends go. A failed send or connect counts; `failures_to_open` in a row open the path, and so does one
  that took `slow_s` or longer (the transport's bounded deadline passed: a blackholed peer, a stalled link).
* open: the path takes nothing new: a send to it fails at once (`PathOpen`, counted as `path_open`). After a
  cool-down it goes half-open; each reopening without a success in between doubles the cool-down, up to
  `max_cool_s`.
* half-open: one probe send goes; its success closes the path (the cool-down back to `cool_s`), its failure
  opens it again. Others wait for the probe's answer (refused, as when open).

Every transition is counted by the state it went to (`transitions`), as the worker's stats report
(`pdserve_kv_path_state`, `pdserve_kv_path_transitions_total`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pdserve.core.settings import SupervisionSettings, default_of

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
STATE_CODES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}  # the gauge's value


@dataclass(frozen=True)
class BreakerPolicy:
    """The rule's numbers; the ones a user sets are `SupervisionSettings`' (`--kv-breaker-*`, `--kv-send-timeout-s`,
    `--kv-stage-grace-s`), whose defaults these are."""
    failures_to_open: int = default_of(SupervisionSettings, "kv_breaker_failures")  # failed sends in a row
    slow_s: float = 1.0  # a failed send or connect that took this long (a deadline passed) opens at once
    cool_s: float = default_of(SupervisionSettings, "kv_breaker_cool_s")  # open this long before the first probe
    max_cool_s: float = 60.0
    # the transports' deadline for one connect or send: well below --kv-timeout-s, so a blackholed peer holds a
    # link's sender this long at most, not for the whole lease
    send_bound_s: float = default_of(SupervisionSettings, "kv_send_timeout_s")
    # a transfer lost to its path (failed, or refused by an open breaker): its prompt's KV stays pinned in the
    # prefill worker's prefix cache this long, so the request re-routed through this worker finds it there
    grace_s: float = default_of(SupervisionSettings, "kv_stage_grace_s")

    SETTINGS = ("kv_send_timeout_s", "kv_breaker_failures", "kv_breaker_cool_s", "kv_stage_grace_s")

    @classmethod
    def of(cls, settings) -> BreakerPolicy:
        """The policy a config sets (any object with `SupervisionSettings`' breaker fields)."""
        return cls(failures_to_open=settings.kv_breaker_failures, cool_s=settings.kv_breaker_cool_s,
                   send_bound_s=settings.kv_send_timeout_s, grace_s=settings.kv_stage_grace_s)

    def bound(self, kv_timeout_s: float) -> float:
        """One connect's or send's deadline under a lease of `kv_timeout_s`."""
        return min(self.send_bound_s, kv_timeout_s / 3)


def breaker_settings(config) -> dict:
    """`config`'s breaker settings (`BreakerPolicy.SETTINGS`), as a worker spec takes them."""
    return {name: getattr(config, name) for name in BreakerPolicy.SETTINGS}


@dataclass
class Breaker:
    policy: BreakerPolicy = field(default_factory=BreakerPolicy)
    state: str = CLOSED
    failures: int = 0  # in a row
    cool_s: float = 0.0  # the current open spell's cool-down
    probe_at: float = 0.0  # open: half-open from then
    probing: bool = False  # half-open: the probe went and has not answered
    transitions: Counter = field(default_factory=Counter)  # state -> times entered

    def allow(self, now: float) -> bool:
        """Whether a send may go now (half-open: this one is the probe)."""
        if self.state == OPEN and now >= self.probe_at:
            self._to(HALF_OPEN)
        if self.state == HALF_OPEN and not self.probing:
            self.probing = True
            return True
        return self.state == CLOSED

    def succeeded(self) -> None:
        self.failures = 0
        self.probing = False
        if self.state != CLOSED:
            self.cool_s = 0.0
            self._to(CLOSED)

    def failed(self, now: float, seconds: float = 0.0) -> None:
        """A send or connect failed after `seconds`."""
        self.failures += 1
        self.probing = False
        if self.state == HALF_OPEN or self.failures >= self.policy.failures_to_open or seconds >= self.policy.slow_s:
            self._open(now)

    def _open(self, now: float) -> None:
        p = self.policy
        self.cool_s = p.cool_s if self.cool_s <= 0 else min(self.cool_s * 2, p.max_cool_s)
        self.probe_at = now + self.cool_s
        if self.state != OPEN:
            self._to(OPEN)

    def _to(self, state: str) -> None:
        self.state = state
        self.transitions[state] += 1


class Breakers:
    """The breakers of one sender, by (receiver address, path)."""

    def __init__(self, policy: BreakerPolicy | None = None) -> None:
        self.policy = policy or BreakerPolicy()
        self.by_path: dict[tuple[str, str], Breaker] = {}
        self.refused: Counter = Counter()  # path -> sends refused by an open breaker (`path_open`)

    def of(self, dest: str, path: str) -> Breaker:
        b = self.by_path.get((dest, path))
        if b is None:
            b = self.by_path.setdefault((dest, path), Breaker(self.policy))
        return b

    def allow(self, dest: str, path: str, now: float) -> bool:
        ok = self.of(dest, path).allow(now)
        if not ok:
            self.refused[path] += 1
        return ok

    def up(self, dest: str, path: str, now: float) -> bool:
        """Whether `path` to `dest` would take a new transfer now (no probe taken)."""
        b = self.of(dest, path)
        return b.state == CLOSED or (b.state == OPEN and now >= b.probe_at) or (b.state == HALF_OPEN and not b.probing)

    def report(self) -> dict[str, dict]:
        """`dest|path` -> {state, transitions}: what the worker's stats carry."""
        return {f"{dest}|{path}": {"state": b.state, "transitions": dict(b.transitions)}
                for (dest, path), b in list(self.by_path.items())}

    def open_dests(self, now: float) -> set[str]:
        """Receivers with no path that would take a transfer now: what the conductor routes around. One due
        for its probe is not among them (a transfer routed there is the probe)."""
        up: dict[str, bool] = {}
        for (dest, path) in list(self.by_path):
            up[dest] = up.get(dest, False) or self.up(dest, path, now)
        return {d for d, ok in up.items() if not ok}
