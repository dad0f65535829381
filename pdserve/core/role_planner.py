"""How many prefill and how many decode workers the coming minutes' load needs, and when to move one.

One model for `pdserve plan`, the simulator and the conductor (`--role-switching auto`):

- **demand**: prompt tokens to compute and output tokens to emit per second. The planner buckets what arrives
  (`interval_s` buckets) and forecasts each rate `horizon_s` ahead with Holt's linear smoothing (level and
  trend), so a load that is shifting is met where it is going, not where it was; the work already queued
  (prompts not yet computed, outputs not yet emitted) is added as a rate that clears it within the horizon;
- **capacity**: what one prefill worker computes (prompt tokens/s) and one decode worker emits (tokens/s at
  its batch), measured from the workers' own step times (the admission model's fits) or, in `pdserve plan`,
  from the simulator's time model;
- **the split** (`best_split`): of `n` workers, the number of prefill workers that minimizes the busier role's
  utilization (demand / (workers x capacity));
- **when to move one** (`RolePlanner.decide`): only while the busier role's forecast utilization is above
  `busy` (below it the deployment keeps up: a move would only cost), the best split differs from the current
  one and moving one worker toward it lowers that utilization by at least `gain` (a share of it) **counting
  what the move costs**: the moved worker serves neither role while it drains and reloads (`move_s`: a prior,
  then the running mean of the moves measured from `started` to `moved`), so the utilization weighed is the
  mean over `payback_s` (how long the forecast load is taken to last) of the utilization during the move (its
  old role one worker short, its new one not yet helped) and after it — a move whose cost the forecast does
  not repay (a slow reload, a small gain) is not made; for `hold_s` in a row (a passing burst moves nothing);
  a move that reverses the last one also waits `cooldown_s` after that one completed (a moved worker is out
  while it drains and reloads: flapping would cost more than it gains), while a second move the same way needs
  only its own hold and may start while the first is under way — a load that shifted far is followed by
  several moves, not one worker per cooldown. The driver says when a move starts (`started`: a role it could
  not move a worker to starts nothing) and when it completes (`moved`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RoleLoad:
    prefill_tokens_s: float  # prompt tokens arriving per second (to compute)
    decode_tokens_s: float  # output tokens per second (to emit)
    prefill_capacity: float  # prompt tokens/s one prefill worker computes
    decode_capacity: float  # output tokens/s one decode worker emits


def role_utilization(demand: float, workers: int, capacity: float) -> float:
    """One role's demand / (workers x capacity): 0 without demand, inf with demand and no worker (or capacity)."""
    if demand <= 0:
        return 0.0
    return float("inf") if workers <= 0 or capacity <= 0 else demand / (workers * capacity)


def utilization(load: RoleLoad, prefill: int, decode: int) -> float:
    """The busier role's utilization with `prefill` + `decode` workers (inf if a role with demand has none)."""
    return max(role_utilization(load.prefill_tokens_s, prefill, load.prefill_capacity),
               role_utilization(load.decode_tokens_s, decode, load.decode_capacity))


def best_split(workers: int, load: RoleLoad) -> int:
    """Prefill workers (1 .. workers - 1) that minimize the busier role's utilization; ties: fewer prefill."""
    return min(range(1, workers), key=lambda p: (utilization(load, p, workers - p), p))


@dataclass
class Holt:
    """Holt's linear exponential smoothing of one rate, one observation per bucket, its trend damped by `phi`
    per step ahead: a forecast `steps` ahead adds phi + phi^2 + ... of the trend, at most phi / (1 - phi) of it,
    so the noise of a few arrivals per bucket (a low request rate) is not multiplied by the horizon."""
    alpha: float = 0.5
    beta: float = 0.3
    phi: float = 0.7
    level: float | None = None
    trend: float = 0.0

    def add(self, x: float) -> None:
        if self.level is None:
            self.level = x
            return
        last = self.level
        self.level = self.alpha * x + (1 - self.alpha) * (self.level + self.phi * self.trend)
        self.trend = self.beta * (self.level - last) + (1 - self.beta) * self.phi * self.trend

    def forecast(self, steps: float) -> float:
        damped = self.phi * (1 - self.phi ** steps) / (1 - self.phi) if self.phi < 1 else steps
        return max(0.0, (self.level or 0.0) + damped * self.trend)


@dataclass
class RolePlanner:
    interval_s: float = 10.0  # demand is bucketed this long
    horizon_s: float = 60.0  # and forecast this far ahead (about what a moved worker is out for)
    busy: float = 0.8  # moves are considered only while the busier role's utilization is above this
    gain: float = 0.25  # a move must lower the busier role's utilization by this share of it
    hold_s: float = 30.0  # ... for this long in a row
    cooldown_s: float = 120.0  # and this long after the last move
    payback_s: float = 300.0  # a move must pay for itself within this long (the forecast load taken to last)
    move_s: float = 20.0  # what a move takes (drain + reload): this prior, then a running mean of measured moves
    prompt: Holt = field(default_factory=Holt)
    output: Holt = field(default_factory=Holt)
    _bucket_start: float | None = None
    _bucket: list = field(default_factory=lambda: [0, 0])  # prompt tokens, output tokens in this bucket
    _wanted_since: float | None = None
    _last_move_s: float = float("-inf")
    _last_role: str | None = None  # the role the last move went to
    output_share: float = 1.0  # of the output tokens requested (max_tokens), the share requests produce
    view: RoleLoad | None = None  # the load `decide` weighed last (demand with backlog, capacities)
    _moves: list = field(default_factory=list)  # when the moves under way started

    def arrived(self, now: float, prompt_tokens: int, max_tokens: int) -> None:
        """A request arrived: its prompt tokens to compute, and the output tokens it will likely ask for (its
        max_tokens times the share finished requests used), counted now, when the demand is made."""
        self._roll(now)
        self._bucket[0] += prompt_tokens
        self._bucket[1] += max_tokens * self.output_share

    def finished(self, requested: int, produced: int) -> None:
        """A request ended with `produced` of its `requested` output tokens."""
        if requested > 0:
            self.output_share += 0.05 * (min(produced / requested, 1.0) - self.output_share)

    def forecast(self, now: float) -> tuple[float, float]:
        """(prompt tokens/s, output tokens/s) `horizon_s` ahead."""
        self._roll(now)
        steps = self.horizon_s / self.interval_s
        return self.prompt.forecast(steps), self.output.forecast(steps)

    def decide(self, now: float, prefill: int, decode: int, prefill_capacity: float | None,
               decode_capacity: float | None, backlog: tuple[float, float] = (0.0, 0.0)) -> str | None:
        """The role one worker should move to ("prefill" or "decode"), or None (stay). `backlog`: work already
        in the system (prompt tokens not yet computed, output tokens not yet emitted), to clear within the
        horizon on top of what arrives."""
        if prefill_capacity is None or decode_capacity is None or prefill + decode < 2 or self.prompt.level is None:
            return None
        p_s, d_s = self.forecast(now)
        load = RoleLoad(p_s + backlog[0] / self.horizon_s, d_s + backlog[1] / self.horizon_s, prefill_capacity,
                        decode_capacity)
        self.view = load
        target = best_split(prefill + decode, load)
        step = 0 if target == prefill else (1 if target > prefill else -1)
        now_util = utilization(load, prefill, decode)
        worth = step != 0 and now_util >= self.busy and self.weighed(load, prefill, decode, step) <= (
            1 - self.gain) * now_util
        if not worth:
            self._wanted_since = None
            return None
        if self._wanted_since is None:
            self._wanted_since = now
        role = "prefill" if step > 0 else "decode"
        reverses = self._last_role is not None and role != self._last_role
        if now - self._wanted_since < self.hold_s or (reverses and now - self._last_move_s < self.cooldown_s):
            return None
        return role

    def weighed(self, load: RoleLoad, prefill: int, decode: int, step: int) -> float:
        """The busier role's mean utilization over `payback_s` if one worker moves (`step` +1: decode -> prefill,
        -1: prefill -> decode): for `move_s` its old role is one short and its new one not yet helped, then the
        new split."""
        during = utilization(load, prefill - (step < 0), decode - (step > 0))
        after = utilization(load, prefill + step, decode - step)
        cost = min(self.move_s, self.payback_s)
        if cost <= 0:
            return after
        return (cost * during + (self.payback_s - cost) * after) / self.payback_s

    def started(self, role: str, now: float | None = None) -> None:
        """The driver moves a worker to `role` (what `decide` said): the next move is held again from scratch;
        `now` starts the clock of what the move takes."""
        self._wanted_since, self._last_role = None, role
        if now is not None:
            self._moves.append(now)

    def moved(self, now: float) -> float | None:
        """A move completed (the worker serves in its new role): a move back waits `cooldown_s` from now; ->
        how long it took (from its `started`; moves complete in the order they started), which `move_s`
        follows (an exponential mean, half its weight on the latest)."""
        self._last_move_s = now
        if not self._moves:
            return None
        took = now - self._moves.pop(0)
        self.move_s += 0.5 * (took - self.move_s)
        return took

    def _roll(self, now: float) -> None:
        if self._bucket_start is None:
            self._bucket_start = now
        while now - self._bucket_start >= self.interval_s:
            self.prompt.add(self._bucket[0] / self.interval_s)
            self.output.add(self._bucket[1] / self.interval_s)
            self._bucket = [0, 0]
            self._bucket_start += self.interval_s
