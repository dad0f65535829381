"""Worker supervision in the gateway: death, hangs, restarts, and the state `/health` reports.

Every 0.2 s the supervisor looks at each worker process:

* a process that ended is **dead**: the conductor hears of it (`Conductor.worker_died`: the prefill workers
  forget it, its requests move to live workers, `pdserve.conductor.recovery`, its prompts to another prefill
  worker) and, with `--restart-workers` (the default), it is started again after a backoff (1 s, doubling per
  restart of that worker, at most 30 s), at most `--max-restarts` times;
* a **ready** worker is taken for hung when for `--heartbeat-timeout-s` it sent no heartbeat (a thread of its
  own sends one every 0.5 s: a stopped or swapped-out process sends none), or when its heartbeats say its
  main loop has not come round for `STUCK_FACTOR` times that (wedged: a busy worker's long steps on an
  overloaded host are work, not a hang, and chaos.py showed a 10 s bound killing busy workers); never while
  the gateway has events it has not read yet (then the gateway is behind, not the worker). It is killed
  (SIGKILL) and handled as dead, its requests moving the same way (`reason="worker_hung"`);
* a restarted worker is **starting** until its `ready` event; then it registers with the conductor again
  (routing passes it by until then) and takes work; one not ready within `--ready-timeout-s` is killed and
  handled as dead again (`worker_start_timeout`), with the next backoff;
* once the server is stopping (SIGTERM/SIGINT: it takes no new connections, the requests in flight finish
  for at most `--drain-timeout-s`), the ready workers are **draining** and no worker is restarted;
* a worker that **joined** (`pdserve worker --join`, no process of the gateway's) is watched by its
  heartbeats alone: silent for `--heartbeat-timeout-s`, it is **lost** (its requests move as a dead worker's;
  it is not restarted: whoever started it does that, and it joins again); while it leaves it is **draining**,
  and once it has nothing left the conductor releases it (`Conductor.release_drained`); then it has **left**.

`health()` is what `GET /health` answers: each worker's name, role, pid, state and restarts, and 503 while no
decode-capable worker (decode, or colocated) is ready, or while draining. Under `--cluster ray` it also lists the
worker actors placed and not joined yet (`pdserve.worker.ray_placement`): **starting**, or **pending** with the
resources Ray has no node for (`waiting_for`, `available`), or **unplaced** (given up after `--ready-timeout-s`,
counted in `pdserve_workers_unplaced_total{reason="timeout"}`).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from dataclasses import dataclass

BACKOFF_S = 1.0
BACKOFF_MAX_S = 30.0
TICK_S = 0.2
STUCK_FACTOR = 6  # a main loop that has not come round for this many heartbeat timeouts is wedged


@dataclass
class WorkerState:
    name: str
    role: str
    state: str = "starting"  # starting | ready | draining | dead; joined workers: ... | lost | left
    pid: int | None = None
    restarts: int = 0
    restart_at: float | None = None  # dead, to be started again then
    started_at: float | None = None  # restarted then, not ready yet
    joined: bool = False  # it joined the running deployment: no process of ours


class Supervisor:
    def __init__(self, conductor, procs, restart: bool = True, max_restarts: int = 5,
                 heartbeat_timeout_s: float = 20.0, ready_timeout_s: float = 600.0, clock=time.monotonic,
                 plan_every_s: float | None = None) -> None:
        self.conductor, self.procs = conductor, procs
        self.restart, self.max_restarts = restart, max_restarts
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.draining = False
        self.clock = clock
        self.plan_every_s = plan_every_s  # --role-switching auto: how often the conductor plans roles
        self._planned_s = clock()
        self.workers = {s.name: WorkerState(s.name, s.role) for s in procs.specs}
        for w in self.workers.values():  # (at start the gateway serves once every worker is ready)
            info = conductor.workers[w.name].info
            if info:
                w.state, w.pid = "ready", info.get("pid")

    def health(self) -> tuple[int, dict]:
        workers = [{"name": w.name, "role": w.role, "pid": w.pid, "state": w.state, "restarts": w.restarts}
                   for w in self.workers.values()]
        placing = [p for p in self.procs.placements.health() if p["name"] not in self.workers] \
            if hasattr(self.procs, "placements") else []  # (joined: the supervisor's, once it has ticked)
        serving = any(w.state == "ready" and w.role in ("decode", "colocated") for w in self.workers.values())
        whole = all(w.state in ("ready", "left") for w in self.workers.values()) and \
            all(p["state"] == "unplaced" for p in placing)
        workers += placing
        status = "ok" if whole else "degraded" if serving else "unavailable"
        if self.draining:
            return 503, {"status": "draining", "workers": workers}
        return (200 if serving else 503), {"status": status, "workers": workers}

    async def run(self, stopping=lambda: False) -> None:
        """Tick until cancelled; `stopping()` true: the server is shutting down (drain)."""
        while True:
            if stopping() and not self.draining:
                self.drain()
            self.tick()
            await asyncio.sleep(TICK_S)

    def drain(self) -> None:
        """The server is stopping: its workers finish what they have; none is started again."""
        self.draining = True
        for w in self.workers.values():
            if w.state == "ready":
                w.state = "draining"

    def tick(self) -> None:
        now = self.clock()
        self.conductor.count_refusals()
        self._watch_joined(now)
        self._watch_placing()
        self._plan_roles(now)
        for w in list(self.workers.values()):
            if w.joined or w.state == "left":
                continue
            proc = self.procs.procs.get(w.name)
            if w.name in self.conductor.switching and (proc is None or proc.poll() is not None):
                self._switched(w, now)
            elif w.state == "ready" and self.conductor.workers[w.name].load.leaving:
                w.state = "draining"  # (moving to another role)
            elif w.state != "dead" and (proc is None or proc.poll() is not None):
                self._died(w, now, "worker_died")
            elif w.state == "starting" and self.conductor.workers[w.name].info:
                w.state, w.pid, w.started_at = "ready", self.conductor.workers[w.name].info.get("pid"), None
            elif w.state == "starting" and w.started_at is not None and now - w.started_at > self.ready_timeout_s:
                print(f"pdserve: worker {w.name} not ready after {self.ready_timeout_s:g} s: killed",
                      file=sys.stderr, flush=True)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                self._died(w, now, "worker_start_timeout")
            elif w.state == "ready" and (why := self._hung(w.name, now)):
                print(f"pdserve: worker {w.name} {why}: killed as hung", file=sys.stderr, flush=True)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                self._died(w, now, "worker_hung")
            elif w.state == "dead" and w.restart_at is not None and now >= w.restart_at and not self.draining:
                self._start_again(w)

    def _plan_roles(self, now: float) -> None:
        if self.plan_every_s is None or self.draining or now - self._planned_s < self.plan_every_s:
            return
        self._planned_s = now
        self.conductor.plan_roles(self._movable)

    def _movable(self, name: str) -> bool:
        """A worker the supervisor can replace in another role: started here, or placed through Ray."""
        return not self.conductor.workers[name].joined or hasattr(self.procs, "add")

    def _switched(self, w: WorkerState, now: float) -> None:
        """A worker moving to another role left and exited: a worker of that role starts in its place."""
        handle = self.conductor.workers[w.name]
        if handle.load.alive:  # its exit seen before its `left` event
            self.conductor.worker_left(w.name, drained=handle.released)
        w.state = "left"
        role = self.conductor.switching.pop(w.name)
        spec = self.procs.replace(w.name, role)
        if spec is not None:  # (Ray: the new actor joins by itself)
            self.conductor.replace_worker(spec.name, role, spec.cmd_addr)
            self.workers[spec.name] = WorkerState(spec.name, role, "starting", self.procs.procs[spec.name].pid,
                                                  started_at=now)
        print(f"pdserve: worker {w.name} moved to {role}" + (f" as {spec.name}" if spec else ""), flush=True)

    def _watch_joined(self, now: float) -> None:
        """Workers that joined: taken in, watched by heartbeat, released once drained, gone once left."""
        for name, handle in self.conductor.workers.items():
            w = self.workers.get(name)
            if handle.joined and handle.load.alive and (w is None or w.state in ("lost", "left")):
                again = 0 if w is None else w.restarts + (w.state == "lost")  # (lost, then joined again)
                self.workers[name] = w = WorkerState(name, handle.load.role, "ready", handle.info.get("pid"),
                                                     again, joined=True)
            if w is None or not w.joined or w.state in ("lost", "left"):
                continue
            if not handle.load.alive:
                w.state = "left"
                self.procs.left(name)
                if name in self.conductor.switching:
                    self.procs.replace(name, self.conductor.switching.pop(name))
                continue
            if handle.info.get("pid") not in (None, w.pid):  # it was started again and joined again
                w.pid, w.restarts = handle.info["pid"], w.restarts + 1
            if (why := self._hung(name, now)) and not self.draining:
                print(f"pdserve: joined worker {name} {why}: lost", file=sys.stderr, flush=True)
                w.state = "lost"
                self.conductor.worker_died(name, "worker_lost", restarting=False)
                self.procs.lost(name)
            elif handle.load.leaving:
                w.state = "draining"
        self.conductor.release_drained()

    def _watch_placing(self) -> None:
        """--cluster ray: workers placed that joined leave `placements`; those Ray could not place within the
        ready timeout are given up (their actors ended), counted."""
        if not hasattr(self.procs, "placements"):
            return
        self.procs.placements.joined([n for n, h in self.conductor.workers.items() if h.joined])
        for p in self.procs.give_up():
            print(f"pdserve: worker {p.name} not placed by Ray after {self.ready_timeout_s:g} s (it waits for "
                  f"{p.health(self.procs.placements.asks)['waiting_for']}): given up", file=sys.stderr, flush=True)
            self.conductor.metrics.workers_unplaced.labels(role=p.role, reason="timeout").inc()

    def _hung(self, name: str, now: float) -> str:
        """Why `name` is taken for hung ("": it is not). Silent (no heartbeat: stopped, swapped out) for the
        timeout; or its main loop has not come round for STUCK_FACTOR x the timeout (a step that long is no
        work any more: wedged). Not while the gateway itself is behind on its events."""
        handle = self.conductor.workers[name]
        if self.conductor.events_pending():
            return ""
        if now - handle.last_seen > self.heartbeat_timeout_s:
            return f"sent no heartbeat for {self.heartbeat_timeout_s:g} s"
        if handle.loop_age_s > STUCK_FACTOR * self.heartbeat_timeout_s:
            return f"has been in one step for {handle.loop_age_s:.0f} s"
        return ""

    def _died(self, w: WorkerState, now: float, reason: str) -> None:
        print(f"pdserve: worker {w.name} died:\n{self.procs.log_tail(w.name)}", file=sys.stderr, flush=True)
        w.state = "dead"
        again = self.restart and w.restarts < self.max_restarts
        w.restart_at = now + min(BACKOFF_S * 2 ** w.restarts, BACKOFF_MAX_S) if again else None
        self.conductor.worker_died(w.name, reason, restarting=again)

    def _start_again(self, w: WorkerState) -> None:
        w.restarts += 1
        w.restart_at = None
        self.conductor.worker_restarting(w.name)
        self.procs.restart(w.name)
        w.state, w.pid, w.started_at = "starting", self.procs.procs[w.name].pid, self.clock()
        print(f"pdserve: worker {w.name} restarted (restart {w.restarts} of at most {self.max_restarts})",
              file=sys.stderr, flush=True)
