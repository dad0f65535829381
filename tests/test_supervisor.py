"""`Supervisor` decisions on a simulated clock, with fake processes and a fake conductor (the seams it talks
through): death and restart with backoff, a restarted worker that never gets ready, a hung one, and the drain
(no restarts, `/health` 503 "draining"). The real processes: `test_worker_death_serve.py`, `test_drain_serve.py`."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from types import SimpleNamespace

from pdserve.server.supervisor import Supervisor


class FakeProc:
    def __init__(self, pid: int) -> None:
        self.pid, self.code, self.signals = pid, None, []

    def poll(self):
        return self.code

    def send_signal(self, sig) -> None:
        self.signals.append(sig)
        self.code = -sig

    def wait(self):
        return self.code


@dataclass
class FakeProcs:
    specs: list
    procs: dict = field(default_factory=dict)
    started: list = field(default_factory=list)

    def restart(self, name: str) -> None:
        self.procs[name] = FakeProc(100 + len(self.started))
        self.started.append(name)

    def left(self, name: str) -> None:
        pass

    def lost(self, name: str) -> None:
        pass

    def log_tail(self, name: str) -> str:
        return ""


class FakeConductor:
    def __init__(self, names) -> None:
        self.workers = {n: SimpleNamespace(info={"pid": 1}, last_seen=0.0, loop_age_s=0.0, joined=False,
                                           load=SimpleNamespace(alive=True, leaving=False)) for n in names}
        self.switching: dict[str, str] = {}
        self.deaths: list[tuple[str, str, bool]] = []
        self.released: list[str] = []

    def join(self, name: str, role: str) -> SimpleNamespace:
        """A worker joins (as `Conductor._join` registers one)."""
        self.workers[name] = w = SimpleNamespace(info={"pid": 7}, last_seen=0.0, loop_age_s=0.0, joined=True,
                                                 load=SimpleNamespace(role=role, alive=True, leaving=False))
        return w

    def release_drained(self) -> list[str]:
        names = [n for n, w in self.workers.items() if w.joined and w.load.leaving and n not in self.released]
        self.released += names
        return names

    def events_pending(self) -> bool:
        return False

    def count_refusals(self) -> None:
        pass

    def worker_died(self, name: str, reason: str, restarting: bool) -> None:
        self.deaths.append((name, reason, restarting))
        if self.workers[name].joined:
            self.workers[name].load.alive = False

    def worker_restarting(self, name: str) -> None:
        self.workers[name].info = {}


def _setup(**kw):
    clock = [0.0]
    specs = [SimpleNamespace(name="prefill-0", role="prefill"), SimpleNamespace(name="decode-0", role="decode")]
    procs = FakeProcs(specs, {s.name: FakeProc(i + 1) for i, s in enumerate(specs)})
    conductor = FakeConductor([s.name for s in specs])
    sup = Supervisor(conductor, procs, clock=lambda: clock[0], **kw)
    return sup, procs, conductor, clock


def _beat(conductor, clock) -> None:
    for w in conductor.workers.values():
        w.last_seen = clock[0]


def test_a_dead_worker_is_restarted_after_its_backoff_and_ready_once_it_reports():
    sup, procs, conductor, clock = _setup()
    procs.procs["decode-0"].code = -9
    sup.tick()
    assert conductor.deaths == [("decode-0", "worker_died", True)]
    assert sup.health() == (503, {"status": "unavailable", "workers": [
        {"name": "prefill-0", "role": "prefill", "pid": 1, "state": "ready", "restarts": 0},
        {"name": "decode-0", "role": "decode", "pid": 1, "state": "dead", "restarts": 0}]})
    clock[0] = 0.5
    sup.tick()
    assert procs.started == []  # backoff: 1 s
    clock[0] = 1.0
    sup.tick()
    assert procs.started == ["decode-0"] and sup.workers["decode-0"].state == "starting"
    conductor.workers["decode-0"].info = {"pid": 100}
    _beat(conductor, clock)
    sup.tick()
    assert sup.workers["decode-0"].state == "ready" and sup.workers["decode-0"].pid == 100
    assert sup.health()[0] == 200


def test_a_restarted_worker_not_ready_in_time_is_killed_and_tried_again_after_a_longer_backoff():
    sup, procs, conductor, clock = _setup(ready_timeout_s=60.0)
    procs.procs["decode-0"].code = -9
    sup.tick()
    clock[0] = 1.0
    sup.tick()  # restarted; it never reports ready
    stuck = procs.procs["decode-0"]
    for t in (30.0, 61.5):
        clock[0] = t
        _beat(conductor, clock)
        sup.tick()
    assert stuck.signals == [signal.SIGKILL]
    assert conductor.deaths[-1] == ("decode-0", "worker_start_timeout", True)
    clock[0] = 63.0
    sup.tick()
    assert procs.started == ["decode-0"]  # the second backoff is 2 s
    clock[0] = 63.5
    sup.tick()
    assert procs.started == ["decode-0", "decode-0"] and sup.workers["decode-0"].restarts == 2


def test_a_silent_worker_is_killed_as_hung():
    sup, procs, conductor, clock = _setup(heartbeat_timeout_s=4.0)
    clock[0] = 3.0
    _beat(conductor, clock)
    conductor.workers["prefill-0"].last_seen = 0.0  # silent since 0
    clock[0] = 4.5
    sup.tick()
    assert procs.procs["prefill-0"].signals == [signal.SIGKILL]
    assert conductor.deaths == [("prefill-0", "worker_hung", True)]


def test_while_draining_nothing_is_restarted_and_health_says_so():
    sup, procs, conductor, clock = _setup()
    sup.drain()
    assert sup.health() == (503, {"status": "draining", "workers": [
        {"name": "prefill-0", "role": "prefill", "pid": 1, "state": "draining", "restarts": 0},
        {"name": "decode-0", "role": "decode", "pid": 1, "state": "draining", "restarts": 0}]})
    procs.procs["decode-0"].code = 0
    sup.tick()
    clock[0] = 100.0
    sup.tick()
    assert procs.started == [] and sup.workers["decode-0"].state == "dead"


def test_a_joined_worker_is_watched_by_heartbeat_released_when_leaving_and_never_restarted():
    sup, procs, conductor, clock = _setup(heartbeat_timeout_s=4.0)
    j = conductor.join("decode-j", "decode")
    sup.tick()
    assert sup.workers["decode-j"].state == "ready" and sup.workers["decode-j"].pid == 7
    j.load.leaving = True  # it said it is leaving
    sup.tick()
    assert sup.workers["decode-j"].state == "draining" and conductor.released == ["decode-j"]
    j.load.alive = False  # its `left` event came
    sup.tick()
    assert sup.workers["decode-j"].state == "left"
    _beat(conductor, clock)
    assert sup.health()[1]["status"] == "ok"  # a worker that left is no gap
    conductor.join("decode-j", "decode")  # it comes back under the same name
    clock[0] = 10.0
    _beat(conductor, clock)
    sup.tick()
    assert sup.workers["decode-j"].state == "ready"
    clock[0] = 15.0  # silent for more than the heartbeat timeout
    conductor.workers["prefill-0"].last_seen = conductor.workers["decode-0"].last_seen = 15.0
    sup.tick()
    assert sup.workers["decode-j"].state == "lost"
    assert conductor.deaths == [("decode-j", "worker_lost", False)]
    assert sup.health()[1]["status"] == "degraded"
    clock[0] = 100.0
    sup.tick()
    assert procs.started == [] and sup.workers["decode-j"].state == "lost"  # not ours to start again
