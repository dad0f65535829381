"""`--cluster ray`: whether Ray has placed each worker actor, as Ray reports it.

A worker actor asks for resources (its torch threads as CPUs; one GPU where the cluster has GPUs). Ray places
it on a node that has them free, else it waits for one, saying nothing to the caller. `Placements` follows
every worker actor from its placement until it joins the gateway:

1. **infeasible**: no node of the cluster has the resources at all (`ray.nodes()`: each live node's totals):
   it is refused before it is placed (`ClusterTooSmall`: a 409 to `POST /v1/cluster/workers`, one line at
   start-up), naming what it asks for and what the nodes have;
2. **starting**: Ray gave it a worker process (its actor table entry has a pid): it loads the model and joins;
3. **pending**: Ray has no process for it yet, and its free resources (`ray.available_resources()`) do not
   fit it: it waits for the resources `waiting_for` names (shown by `/health` and the POST's answer; named in
   the one-line error of a start-up whose workers were not all ready within `--ready-timeout-s`);
4. **unplaced**: pending for the ready timeout (`--ready-timeout-s`): given up, its actor ended, counted
   (`pdserve_workers_unplaced_total{reason="timeout"}`), still shown by `/health` with what it waited for;
5. **dead**: its actor died before it joined and Ray will not start it again (the Ray logs of the actor say why);
6. once it has joined, it is the supervisor's like any worker that joined, and no longer here.

Ray's own view of the actor is its GCS actor table (`ray._private.state.actors`): the state API
(`ray.util.state`) needs Ray's dashboard, which a deployment that started its own Ray cluster runs without.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.errors import PdserveError

CHECK_EVERY_S = 1.0  # how often Ray is asked about the actors not yet joined


class ClusterTooSmall(PdserveError):
    """No node of the Ray cluster has the resources a worker actor asks for: it could never be placed."""

    status_code = 409
    code = "insufficient_cluster_resources"


@dataclass
class Placing:
    """A worker actor placed and not joined yet."""

    name: str
    role: str
    actor_id: str  # its Ray actor id (hex)
    since: float  # placed then (the clock of `Placements`)
    state: str = "starting"  # starting | pending | unplaced | dead
    available: dict = field(default_factory=dict)  # of what it asks for: what the cluster had free when last asked

    def health(self, asks: dict) -> dict:
        out = {"name": self.name, "role": self.role, "pid": None, "state": self.state, "restarts": 0}
        if self.state in ("pending", "unplaced"):
            out |= {"waiting_for": asks, "available": self.available}
        return out


class Placements:
    def __init__(self, ray, asks: dict[str, float], timeout_s: float, clock=time.monotonic) -> None:
        self.ray = ray
        self.asks = {k: v for k, v in asks.items() if v}  # e.g. {"CPU": 1}
        self.timeout_s = timeout_s
        self.clock = clock
        self.placing: dict[str, Placing] = {}
        self._asked_s = float("-inf")

    def check_feasible(self, role: str) -> None:
        """Refuse (`ClusterTooSmall`) a worker no live node of the cluster could ever hold."""
        nodes = [n["Resources"] for n in self.ray.nodes() if n.get("Alive")]
        if any(all(node.get(k, 0) >= v for k, v in self.asks.items()) for node in nodes):
            return
        largest = {k: max((node.get(k, 0) for node in nodes), default=0) for k in self.asks}
        total = {k: self.ray.cluster_resources().get(k, 0) for k in self.asks}
        raise ClusterTooSmall(f"the Ray cluster can never place a {role} worker: it asks for {_say(self.asks)} "
                              f"(--num-threads as CPUs) and no node has that (the largest: {_say(largest)}; the "
                              f"cluster in all: {_say(total)})", param="role")

    def add(self, name: str, role: str, actor) -> None:
        self.placing[name] = Placing(name, role, actor._actor_id.hex(), self.clock())

    async def settle(self, name: str, wait_s: float = 2.0) -> dict:
        """What the POST answers for `name`: {"state": "starting"} once Ray gave it a process (waiting up to
        `wait_s` for Ray to decide), else pending with the resources it waits for."""
        import asyncio
        deadline = self.clock() + wait_s
        while self._look(self.placing[name]) == "pending" and self.clock() < deadline:
            await asyncio.sleep(0.1)
        p = self.placing[name]
        return {k: v for k, v in p.health(self.asks).items() if k in ("state", "waiting_for", "available")}

    def joined(self, names) -> None:
        for name in names:
            self.placing.pop(name, None)

    def overdue(self) -> list[Placing]:
        """Ask Ray (at most every CHECK_EVERY_S) about the actors not joined yet; those pending for longer than
        the ready timeout are marked unplaced and returned (the caller ends their actors and counts them)."""
        now = self.clock()
        if now - self._asked_s < CHECK_EVERY_S:
            return []
        self._asked_s = now
        late = []
        for p in self.placing.values():
            if self._look(p) == "pending" and now - p.since > self.timeout_s:
                p.state = "unplaced"
                late.append(p)
        return late

    def waiting(self) -> str:
        """What the workers Ray has not placed wait for ("" if none): said when the start-up timed out."""
        pending = [p for p in self.placing.values() if self._look(p) == "pending"]
        if not pending:
            return ""
        return (f"; Ray could not place {', '.join(p.name for p in pending)}: each asks for {_say(self.asks)} "
                f"(--num-threads as CPUs), the cluster has {_say(pending[-1].available)} free")

    def health(self) -> list[dict]:
        return [p.health(self.asks) for p in self.placing.values()]

    def _look(self, p: Placing) -> str:
        """Ask Ray about `p`: starting once it has a worker process; pending while it has none and the
        cluster's free resources do not fit it (free ones: Ray is placing it)."""
        if p.state in ("unplaced", "dead"):  # (its actor ended: it stays what it was when it ended)
            return p.state
        entry = self.ray._private.state.actors(p.actor_id) or {}
        free = self.ray.available_resources()
        p.available = {k: free.get(k, 0) for k in self.asks}
        fits = all(p.available[k] >= v for k, v in self.asks.items())
        if entry.get("State") == "DEAD":  # its process died and Ray will not start it again
            p.state = "dead"
        else:
            p.state = "starting" if entry.get("Pid") or fits else "pending"
        return p.state


def _say(resources: dict) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in resources.items()) or "nothing"
