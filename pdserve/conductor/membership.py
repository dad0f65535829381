"""Workers that join a running deployment, and leave it without losing a request (the conductor core's part).

A worker started on any host (`pdserve worker --join`) registers with its `ready` event; the core takes it
as a new worker of its role (`worker_joined`), and routing sends it work like any other. To leave (SIGTERM),
a worker first says so (`worker_leaving`): it is then passed by for new work (`WorkerLoad.leaving`), and
finishes what it holds: the requests decoding there, the prompts routed there (their KV delivered). Once
nothing the conductor routed there is left (`drained`), the gateway releases it; the worker sends what its
links still queue and says it left (`worker_left`). A worker that leaves early (its drain timed out) or is
lost (silent past the heartbeat timeout) hands what it still had to the others as a dead worker's requests
are moved (`pdserve.conductor.recovery`): nothing is lost either way.

Role switching (`--role-switching auto`, `plan_roles`) uses the same steps: the planner
(`pdserve.core.role_planner`) picks a role that needs one more worker; the least busy worker of the other role
drains (`Switch`), and once drained the driver replaces it with a worker of the new role, which joins.

`Membership` owns the moves under way and the role planner; it sees the core's `Books`
(`pdserve.conductor.books`) and admission's step models. The core calls it, and moves a gone worker's requests
(`pdserve.conductor.recovery`).
"""

from __future__ import annotations

from pdserve.conductor.actions import Count, Level, Observe, Switch
from pdserve.conductor.admission import Admission
from pdserve.conductor.books import Books
from pdserve.conductor.flight_state import Stage
from pdserve.conductor.wire import Ready
from pdserve.core.role_planner import RolePlanner, role_utilization


class Membership:
    """The conductor core's membership part. Owns the role moves under way (`switching`: the roles moving
    workers' replacements will take; `arriving`: replacements started and loading -> their role), each
    worker's batch room (from its `ready`) and the role planner (`roles`, None unless `--role-switching
    auto`); sees the core's `Books` (workers, flights, backlog) and admission's step models."""

    def __init__(self, books: Books, admission: Admission | None, roles: RolePlanner | None = None) -> None:
        self.books, self.admission, self.roles = books, admission, roles
        self.batch_room: dict[str, tuple[int, int]] = {}  # worker -> (max_num_seqs, KV pool tokens)
        self.switching: list[str] = []
        self.arriving: dict[str, str] = {}

    def worker_joined(self, name: str, role: str, now: float | None = None, loaded: bool = True) -> list:
        """A worker registered while the deployment runs (a name that left before may come back). One that
        takes a moving worker's place completes the move once it serves: now if it joined `loaded` (a worker
        that joins says so once its model is loaded), else at its `ready` (a replacement the gateway just
        started); the planner counts its cooldown, and learns what the move took, from then."""
        self.books.add_worker(name, role)
        actions: list = [Count("workers_joined", (("role", role),))]
        if role in self.switching and name not in self.arriving:
            if loaded:
                actions += self._move_done(role, now)
            else:
                self.arriving[name] = role
        return actions

    def worker_ready(self, name: str, info: Ready, now: float | None) -> list:
        """Its `ready`: its batch room is known; a replacement's completes its role move."""
        self.batch_room[name] = (info.max_num_seqs, info.num_blocks * info.block_size)
        return self._move_done(self.arriving.pop(name), now) if name in self.arriving else []

    def _move_done(self, role: str, now: float | None) -> list:
        self.switching.remove(role)
        if self.roles is not None and now is not None and (took := self.roles.moved(now)) is not None:
            return [Observe("role_move_seconds", (("role", role),), took)]
        return []

    def worker_leaving(self, name: str) -> list:
        """It will leave: no new work goes there; what it has, it finishes — except prompts routed to a prefill
        worker and not dispatched there yet (their decode worker has not reserved their blocks): those move to
        another prefill worker now rather than hold the leaving one."""
        books = self.books
        books.workers[name].leaving = True
        for f in books.flights.values():
            if f.prefill == name and f.stage in (Stage.RESERVING, Stage.WAITING_ROOM):
                other = books.pick("prefill", ())
                if other is None:
                    break
                rank = books.tiers[f.tier].rank
                books.backlog[name].tokens[rank] -= f.queued_tokens
                books.backlog[other.name].tokens[rank] += f.queued_tokens
                books.workers[name].outstanding -= 1
                other.outstanding += 1
                f.prefill = other.name
        return []

    def drained(self) -> list[str]:
        """Leaving workers with nothing left that the conductor routed to them: they may go."""
        busy = {w for f in self.books.flights.values() for w in (f.decode, f.prefill)}
        return [name for name, load in self.books.workers.items()
                if load.leaving and load.alive and load.outstanding <= 0 and name not in busy]

    def worker_left(self, name: str, drained: bool) -> list:
        """It is gone: released once drained, or early (its drain timed out; whatever it still had moves to
        the others as from a dead worker: the core's `worker_gone`)."""
        how = "drained" if drained else "handed_off"
        return [Count("workers_left", (("role", self.books.workers[name].role), ("how", how)))]

    def worker_gone(self, name: str, restarting: bool) -> None:
        """A replacement that never served (died, and is not started again): its move is off."""
        if not restarting and name in self.arriving:
            self.switching.remove(self.arriving.pop(name))

    def plan_roles(self, now: float, movable=None) -> list:
        """--role-switching auto, called every few seconds: move one worker between prefill and decode when the
        planner says the coming load needs it (`movable(name)`: whether the driver can start a replacement for
        that worker, default all). Workers under way to a role count in it; while moves are under way, only
        another one the same way may start (each held on its own: a load that shifted far is followed by
        several moves at once, a reversal waits for them to end and for the cooldown)."""
        books = self.books
        if self.roles is None or books.mode != "pd":
            return []
        usable = {r: [w for w in books.workers.values() if w.role == r and w.usable] for r in ("prefill", "decode")}
        share = self.roles.output_share
        outputs_left = (max((f.params.get("max_tokens") or 0) * share - f.num_tokens, 0)
                        for f in books.flights.values())
        backlog = (sum(sum(b.tokens.values()) for b in books.backlog.values()), sum(outputs_left))
        counts = {r: len(usable[r]) + self.switching.count(r) for r in usable}
        to = self.roles.decide(now, counts["prefill"], counts["decode"],
                               *self.role_capacity(usable["prefill"], usable["decode"]), backlog)
        seen = _levels(self.roles.view, counts)
        if to is None or any(r != to for r in self.switching):
            return seen
        other = usable["decode" if to == "prefill" else "prefill"]
        source = [w for w in other if movable is None or movable(w.name)]
        if len(other) < 2 or not source:
            return seen
        name = min(source, key=lambda w: (w.outstanding, w.name)).name
        self.roles.started(to, now)
        self.worker_leaving(name)
        self.switching.append(to)
        return seen + [Switch(name, to), Count("role_switches", (("role", to),))]

    def role_capacity(self, prefill: list, decode: list) -> tuple[float | None, float | None]:
        """(prompt tokens/s of one prefill worker, output tokens/s of one decode worker), from their step-time
        fits (admission's models); None until they have some. A decode worker's rate is at the batch its
        sequences and KV allow, or the largest batch whose step meets the tightest TPOT SLO if that is smaller
        (what it emits within the SLO, not what it could at any pace). A prefill worker without a fit yet (fewer
        than `MIN_SAMPLES` steps: a minute for a slow CPU worker) counts for its observed prompt tokens/s."""
        if self.admission is None:
            return None, None
        slo = min((t.tpot_ms / 1000.0 for t in self.books.tiers.tiers.values() if t.tpot_ms is not None),
                  default=None)
        rates_p, rates_d = [], []
        for w in prefill:
            m = self.admission.model(w.name)
            if t := m.prefill_s(m.budget):
                rates_p.append(m.budget / t)
            elif rate := m.observed_prefill_rate():  # its fit is not there yet (a slow worker's first steps)
                rates_p.append(rate)
        for w in decode:
            m = self.admission.model(w.name)
            slots, tokens = self.batch_room.get(w.name, (256, 0))  # the batch its seqs and its KV allow
            batch = _within(m.decode_s, max(1, min(slots, int(tokens / m.mean_context) if tokens and m.mean_context
                                                   else slots)), slo)
            if t := m.decode_s(batch):
                rates_d.append(batch / t)
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        return mean(rates_p), mean(rates_d)


def _levels(load, counts: dict) -> list:
    """The planner's view as gauges: each role's forecast demand (backlog included), one worker's capacity and
    the role's utilization with the workers it has (or is getting), all in tokens/s; none before it has one."""
    if load is None:
        return []
    out = []
    for role, demand, capacity in (("prefill", load.prefill_tokens_s, load.prefill_capacity),
                                   ("decode", load.decode_tokens_s, load.decode_capacity)):
        out += [Level("role_demand", (("role", role),), demand), Level("role_capacity", (("role", role),), capacity),
                Level("role_utilization", (("role", role),), role_utilization(demand, counts[role], capacity))]
    return out


def _within(step_s, batch: int, slo_s: float | None) -> int:
    """The largest batch up to `batch` whose predicted step (`step_s`, rising with the batch) takes at most
    `slo_s` (1 if none does); `batch` when there is no SLO or no prediction yet."""
    if slo_s is None or (t := step_s(batch)) is None or t <= slo_s:
        return batch
    lo, hi = 1, batch  # step_s(hi) > slo_s
    while lo < hi - 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if (step_s(mid) or 0.0) <= slo_s else (lo, mid)
    return lo
