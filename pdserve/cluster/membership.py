"""Workers that join a running deployment, and leave it without losing a request (the conductor core's part).

A worker started on any host (`pdserve worker --join`) registers with its `ready` event; the core takes it
as a new worker of its role (`worker_joined`), and routing sends it work like any other. To leave (SIGTERM),
a worker first says so (`worker_leaving`): it is then passed by for new work (`WorkerLoad.leaving`), and
finishes what it holds: the requests decoding there, the prompts routed there (their KV delivered). Once
nothing the conductor routed there is left (`drained`), the gateway releases it; the worker sends what its
links still queue and says it left (`worker_left`). A worker that leaves early (its drain timed out) or is
lost (silent past the heartbeat timeout) hands what it still had to the others as a dead worker's requests
are moved (`pdserve.cluster.recovery`): nothing is lost either way.

The same steps serve role switching: drain a worker, then let it join again in its new role.
"""

from __future__ import annotations

from pdserve.cluster.actions import Count


class MembershipEvents:
    """Mixed into `ConductorCore` (which provides `workers`, `flights`, `hot`, `stage`, `orphans`,
    `add_worker`, `_migrate`, `_recover`, `_route`, `_fail_orphans`)."""

    def worker_joined(self, name: str, role: str) -> list:
        """A worker registered while the deployment runs (a name that left before may come back)."""
        self.add_worker(name, role)
        return [Count("workers_joined", (("role", role),))]

    def worker_leaving(self, name: str) -> list:
        """It will leave: no new work goes there; what it has, it finishes."""
        self.workers[name].leaving = True
        return []

    def drained(self) -> list[str]:
        """Leaving workers with nothing left that the conductor routed to them: they may go."""
        busy = {w for f in self.flights.values() for w in (f.decode, f.prefill)}
        return [name for name, load in self.workers.items()
                if load.leaving and load.alive and load.outstanding <= 0 and name not in busy]

    def worker_left(self, name: str, now: float, drained: bool) -> list:
        """It is gone: released once drained, or early (its drain timed out; whatever it still had moves to
        the others as from a dead worker)."""
        load = self.workers[name]
        return [Count("workers_left", (("role", load.role), ("how", "drained" if drained else "handed_off")))
                ] + self._worker_gone(name, now, "worker_left", restarting=False)

    def _worker_gone(self, name: str, now: float, reason: str, restarting: bool) -> list:
        """A worker is gone (died, hung, left): its requests and prompts move to the others."""
        load = self.workers[name]
        load.alive = False
        actions: list = []
        for rid in self.hot.worker_gone(name) if self.hot is not None else ():
            self.stage.done(name, rid)
        for f in list(self.flights.values()):
            if f.decode == name:
                actions += self._migrate(f, reason, restarting)
            elif f.prefill == name:
                actions += self._recover(f, now)
        if self.orphans and not restarting and self._route(())[0] is None:
            actions += self._fail_orphans()  # no worker that could take them is alive, and this one stays dead
        return actions
