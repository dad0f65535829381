"""`pdserve simulate --role-switching auto`: the conductor core's role planner moving engines between prefill and
decode in simulated time, as the gateway moves workers (`pdserve.conductor.membership.plan_roles`).

Every `interval_s` the core plans (`plan_roles`); a `Switch` marks an engine leaving (routing passes it by).
Once the core finds it drained, the engine is gone (`worker_left`) and, `switch_s` later (a restarted worker
loading its weights), a fresh engine of the new role (an empty KV pool, named `<role>-<n>`) joins and is
routed to.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.conductor.actions import Switch
from pdserve.sim.events import MESSAGE


class SimRoleSwitching:
    def __init__(self, conductor, make_engine: Callable[[str, str], object], interval_s: float = 5.0,
                 switch_s: float = 20.0) -> None:
        self.conductor = conductor
        self.make_engine = make_engine
        self.interval_s, self.switch_s = interval_s, switch_s
        self.moving: dict[str, str] = {}  # engine -> the role its replacement takes
        self.counts: dict[str, int] = {}
        self.switches: list[tuple[float, str, str]] = []  # (time, engine that left, engine that joined)

    def start(self) -> None:
        for role, engines in self.conductor.engines.items():
            self.counts[role] = len(engines)
        self.conductor.loop.at(self.conductor.loop.now + self.interval_s, self._tick, prio=MESSAGE)

    def _tick(self) -> None:
        c = self.conductor
        now = c.loop.now
        actions = c.core.plan_roles(now)
        for a in actions:
            if isinstance(a, Switch):
                self.moving[a.worker] = a.role
        c._act([a for a in actions if not isinstance(a, Switch)])
        for name in c.core.drained():
            if name in self.moving:
                self._retire(name, self.moving.pop(name), now)
        if len(c.loop) or self.moving:  # (nothing else left to happen: the run is over)
            c.loop.at(now + self.interval_s, self._tick, prio=MESSAGE)

    def _retire(self, name: str, role: str, now: float) -> None:
        c = self.conductor
        old = c.by_name[name]
        c.engines[old.role].remove(old)
        c._act(c.core.worker_left(name, now, drained=True))
        new = f"{role}-{self.counts.get(role, 0)}"
        self.counts[role] = self.counts.get(role, 0) + 1
        self.switches.append((now, name, new))
        c.loop.at(now + self.switch_s, self._join, new, role, prio=MESSAGE)

    def _join(self, name: str, role: str) -> None:
        c = self.conductor
        engine = self.make_engine(name, role)
        c._act(c.core.worker_joined(name, role, c.loop.now))
        engine.load = c.core.workers[name]
        c.add_engine(engine)
