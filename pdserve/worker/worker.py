"""A worker process: one engine loop in a prefill, decode or colocated role, driven over ZeroMQ.

    python -m pdserve.worker.worker '<WorkerSpec JSON>'

Commands (gateway -> worker) and events (worker -> gateway) are `pdserve.conductor.wire` messages, packed by
`pdserve.worker.wire_codec`: commands generate, reserve, prefill, stage, warm, abort, kv_failed, redirect,
renew, unpin, peer_gone, shutdown (and for a joined worker welcome, release, leave, refused); events ready,
reserved, reserve_waiting, prefilled, staged, consumed, relanded, tokens, error, transfer, checkpointed, stats,
leaving, left (and, from a thread of their own, beat). The loop never blocks while it has
work: it drains commands and KV messages, grants reservations, settles transfers, runs one engine step and
reports; idle, it waits on its sockets for at most 20 ms.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import traceback

import zmq

from pdserve.worker.joined import Departure
from pdserve.worker.spec import WorkerSpec
from pdserve.conductor.commands import carry_out
from pdserve.conductor.wire import (Beat, Checkpointed, Error, KvCache, Leave, Ready, Refused, Release, Shutdown,
                                  Stats, Welcome, WireError)
from pdserve.worker.wire_codec import pack, unpack
from pdserve.worker.worker_commands import WorkerCommands
from pdserve.worker.worker_reports import WorkerReports
from pdserve.worker.step_times import StepTimes
from pdserve.worker.worker_stats import worker_stats
from pdserve.core.sched.decode_cadence import DecodeCadence, plain_decode
from pdserve.core.pd.delivery import LANDING_RECHECK_S
from pdserve.core.kvstore.cache_events import CacheEvents, pool_written, tier_slots
from pdserve.core.kvstore.kv_tiers import capacity_blocks
from pdserve.core.sched.stage_passes import stage_capacity
from pdserve.errors import PdserveError
from pdserve.transfer import capabilities as transport_capabilities
from pdserve.transfer.zmq_auth import Refusals, secure_client, secure_server

STATS_INTERVAL_S = 0.25
HEARTBEAT_S = 0.5  # how often the heartbeat thread reports
LEFT_FLUSH_S = 2.0  # how long a leaving worker waits at exit for its last events (`left`) to be sent
IDLE_STEP_MS = 2  # a prefill worker whose last step had nothing runnable looks again this soon


def _die_with_parent() -> None:
    """Linux: get SIGTERM when the gateway process dies, so no worker outlives it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Worker:
    replaces = False  # a joining worker restarted under its name (Ray): its dead self is replaced at once
    def __init__(self, spec: WorkerSpec) -> None:
        from pdserve.engine.pd import DecodeSide, PrefillSide
        from pdserve.engine.worker_engine import build_worker_engine

        self.spec = spec
        self.ctx = zmq.Context.instance()
        # every socket speaks CurveZMQ with this deployment's keys (`pdserve.transfer.zmq_auth`)
        self.cmds = self.ctx.socket(zmq.PULL)
        secure_server(self.cmds)
        self.cmds.bind(spec.cmd_addr)
        self.cmd_addr = self.cmds.getsockopt(zmq.LAST_ENDPOINT).decode()  # (a joined worker binds port *)
        self.cmd_refusals = Refusals(self.cmds)
        self.events = self.ctx.socket(zmq.PUSH)
        self.events.setsockopt(zmq.LINGER, 1000)
        secure_client(self.events)
        self.events.connect(spec.event_addr)
        # A prefill worker's KV pool in shared memory when its transport sends by reference: a decode worker on
        # this host reads delivered blocks straight from it (shm, auto).
        shared_kv = spec.role == "prefill" and transport_capabilities(spec.transport).zero_copy
        self.engine, self.executor = build_worker_engine(spec.model_dir, spec.engine, shared_kv, spec.name,
                                                           long_context=_long_context(spec))
        self.calibration = self._calibrate()  # before the KV pool has other users
        layers = self.executor.kv_pool.layers
        self.prefill = self.decode = None
        if spec.role == "prefill":
            from pdserve.core.pd.delivery import DeliveryPolicy, WaterLevel
            from pdserve.core.pd.wire_format import WireFormat
            from pdserve.core.pd.breaker import BreakerPolicy
            from pdserve.transfer import make_sender
            sender = make_sender(spec.transport, spec.ring_mb, spec.kv_timeout_s, BreakerPolicy.of(spec),
                                 spec.mooncake_protocol)
            self.prefill = PrefillSide(self.engine, sender,
                                       layers, lease_s=spec.kv_timeout_s,
                                       policy=DeliveryPolicy(spec.delivery, spec.link_share),
                                       link_rate=spec.link_bytes_s, water=WaterLevel(spec.delivery_backlog_s),
                                       wire=WireFormat(spec.kv_wire_dtype))
            self.executor.layer_observer = self.prefill.on_layer
        else:  # decode and colocated workers can both receive KV (colocated: for the no-prefill fallback)
            from pdserve.transfer import make_receiver
            receiver = make_receiver(spec.transport, spec.kv_addr, spec.kv_host, spec.mooncake_protocol)
            self.decode = DecodeSide(self.engine, receiver, layers, spec.kv_timeout_s, hold_lapsed=True)
            disk = getattr(getattr(self.executor, "kv_io", None), "disk", None)
            tiers = self.engine.tiers
            if tiers is not None and (tiers.disk is not None and disk is not None or tiers.remote is not None):
                from pdserve.engine.checkpoints import KVCheckpoints
                every = spec.engine.get("kv_checkpoint_tokens", 0)
                self.decode.checkpoints = KVCheckpoints(self.engine, disk, every)
        self.poller = zmq.Poller()
        self.poller.register(self.cmds, zmq.POLLIN)
        if self.decode is not None and self.decode.receiver.wakeup is not None:
            self.poller.register(self.decode.receiver.wakeup, zmq.POLLIN)  # shm doorbells
        self.running = True
        self.exit_code = 0
        self.bad_commands = 0  # commands that did not decode (reported in stats)
        self.departure = Departure(self, spec.drain_timeout_s, spec.join_timeout_s, welcomed=not spec.joined)
        self.loop_s = time.monotonic()  # the main loop's last pass (the heartbeat thread reports its age)
        self._recheck_s = 0.0  # when prefilled transfers' landings are next looked at
        threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()
        self._last_stats = 0.0
        self._held_since: float | None = None
        self._idle_step = False
        # the steps run since the last stats; the first stats carry the profile's
        self.step_times = StepTimes([row.reported() for row in self.calibration.steps])
        self.cadence = DecodeCadence() if spec.role == "decode" and spec.decode_cadence == "steady" else None
        self.reports = WorkerReports(self.emit, spec.name, self.engine, self.prefill, self.decode)
        self.commands = WorkerCommands(self.engine, self.prefill, self.decode, self.reports)

    def emit(self, event) -> None:
        self.events.send(pack(event))

    def serve(self) -> None:
        info = self.executor.info
        sched = self.engine.scheduler
        self.ready_event = Ready(
            self.spec.name, self.spec.role, pid=os.getpid(), kv_addr=self.decode.receiver.address if self.decode else "",
            num_blocks=info.num_kv_blocks, block_size=info.block_size,
            kv_capacity_blocks=capacity_blocks(self.engine.block_manager, self.engine.tiers),
            max_model_len=sched.max_model_len, max_num_batched_tokens=sched.config.max_num_batched_tokens,
            max_num_seqs=sched.config.max_num_seqs, **self._stage_capacity(), **self._join_fields(),
            kv_block_bytes=self.prefill.block_bytes if self.prefill else 0)
        self.emit(self.ready_event)
        self.cache_events = CacheEvents()  # (its first `kv_cache` lists all it holds)
        self._maybe_stats()  # at once: its profile steps calibrate admission before the first request
        while self.running:
            sched = self.engine.scheduler
            busy = self._has_work(sched) and not self._held()
            # a prefill step that found nothing runnable (its links' headroom is spent): no busy spinning
            if not busy or self._idle_step:  # the loop waits: a step's time does not run on through the wait
                self.step_times.waited()
            self.poller.poll(0 if busy and not self._idle_step else IDLE_STEP_MS if busy else self._idle_ms())
            self._drain_commands()
            self.engine.poll_kv()
            if self.decode is not None:
                self.reports.decode_bookkeeping()
            if self._has_work(sched) and not self._held():
                self._step()
            if self.prefill is not None:
                self.prefill.pump()
                self._recheck_landings()
                self.prefill.keepalive()
                self.reports.cancel_failed_deliveries()
                self.prefill.release_lent()
            self._maybe_stats()
            self.loop_s = time.monotonic()
            self.departure.step()
            if not self.spec.joined and os.getppid() == 1:  # orphaned (PDEATHSIG unavailable)
                break

    @staticmethod
    def _has_work(sched) -> bool:
        """Requests to step, or a reservation's host tier hits to load (an idle decode worker loads them now,
        while the KV is still on its way, not in the first step after it lands)."""
        return sched.num_running + sched.num_waiting > 0 or sched.has_pending_loads

    def _step(self) -> None:
        start, began = time.perf_counter(), time.monotonic()
        self.step_times.started(start)
        outputs = self.engine.step()
        end = time.perf_counter()
        seconds = end - start
        scheduled = self.engine.last_scheduled
        self._idle_step = self.prefill is not None and scheduled.is_empty
        self.step_times.ended(scheduled, seconds, end)
        if self.cadence is not None and scheduled.chunks:  # its tokens go out at the cadence's period
            self._hold(scheduled, start, seconds)
        if self.decode is not None:
            self.reports.consumed(began)
        self.reports.outputs(outputs)

    def _hold(self, scheduled, start: float, seconds: float) -> None:
        """--decode-cadence steady: hold a step (begun at `start`, perf_counter; `seconds` long) until its period
        is up, serving commands and delivered KV meanwhile (`pdserve.core.sched.decode_cadence`)."""
        sched = self.engine.scheduler
        until = start + self.cadence.pace(start, seconds, plain_decode(scheduled),
                                          sched.step_budget.tightest_tpot_s(sched.running))
        if until > time.perf_counter():
            self.step_times.waited()  # (a hold is not the step's cost)
        while self.running and (left := until - time.perf_counter()) > 0:
            self.poller.poll(max(1, int(left * 1000)) if left >= 0.001 else 0)
            self._drain_commands()
            self.engine.poll_kv()
            self.reports.decode_bookkeeping()

    def _recheck_landings(self) -> None:
        """Every LANDING_RECHECK_S while prefilled transfers are in the air: those whose landing moved as their
        link went (slower than estimated: another sender on the decode worker's port, a loaded transport) are
        reported again."""
        now = time.monotonic()
        if self.prefill.landings and now >= self._recheck_s:
            self._recheck_s = now + LANDING_RECHECK_S
            self.reports.relanded()

    def _join_fields(self) -> dict:
        """What a joining worker's `ready` adds: where the gateway sends it commands, which model it serves."""
        if not self.spec.joined:
            return {}
        from pdserve.model.config import model_fingerprint
        return {"cmd_addr": self.cmd_addr, "model": model_fingerprint(self.spec.model_dir), "replaces": self.replaces}

    def _stage_capacity(self) -> dict:
        scheduled = self.prefill is not None and self.prefill.outbox.policy.scheduled
        return stage_capacity(self.engine.scheduler, self.engine.tiers, scheduled)

    def _held(self) -> bool:
        """A prefill worker whose links are all backed up produces nothing now (backpressure); otherwise the
        next step is paced per link (`pdserve.core.pd.production_pace`)."""
        if self.prefill is None:
            return False
        now = time.monotonic()
        pace = self.engine.scheduler.pace = self.prefill.pace()
        held = pace.hold_s > 0
        if held and self._held_since is not None:
            self.prefill.paused_s += now - self._held_since
        self._held_since = now if held else None
        return held

    def _idle_ms(self) -> int:
        if self.decode is not None:
            return self.decode.wait_ms(20)
        return 20  # (a prefill worker's links send on their own threads: nothing to pump for them here)

    # ---- commands ---------------------------------------------------------------------------------------
    def _drain_commands(self) -> None:
        for raw in _waiting(self.cmds):
            try:
                cmd = unpack(raw)
            except WireError as e:  # (only the gateway sends here, CurveZMQ-authenticated: a version mismatch)
                self.bad_commands += 1
                print(f"pdserve: a command that does not decode was dropped: {e}", file=sys.stderr, flush=True)
                continue
            try:
                self._handle(cmd)
            except PdserveError as e:
                self.emit(Error(getattr(cmd, "rid", None), e.status_code, str(e), e.error_type, e.code, e.param))

    def _handle(self, cmd) -> None:
        if isinstance(cmd, (Shutdown, Welcome, Release, Leave, Refused)):
            self._membership(cmd)
        else:
            carry_out(cmd, self.commands)

    def _membership(self, cmd) -> None:
        if isinstance(cmd, Shutdown):
            self.running = False
        elif isinstance(cmd, (Welcome, Release)):
            setattr(self.departure, "welcomed" if isinstance(cmd, Welcome) else "released", True)
        elif isinstance(cmd, Leave):  # the conductor moves it to another role (role switching): drain, then go
            self.departure.ask()
        else:  # refused: a joining worker the gateway did not take
            print(f"pdserve: the gateway refused this worker: {cmd.message}", file=sys.stderr, flush=True)
            self.running, self.exit_code = False, 2

    def _calibrate(self):
        """Profile steps at load (`pdserve.engine.calibration`): its step budget learns them now, the conductor's
        admission model with its first stats, as every step it runs."""
        from pdserve.engine.calibration import calibrate
        spec = self.spec
        calibration = calibrate(self.engine, spec.role, spec.calibration, spec.model_dir)
        print(f"pdserve: worker {spec.name}: {calibration.describe()}", file=sys.stderr, flush=True)
        budget = self.engine.scheduler.step_budget
        for row in calibration.steps:
            budget.learn(row)
        budget.refresh_cap()
        return calibration

    def _maybe_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats < STATS_INTERVAL_S:
            return
        self._last_stats = now
        self.emit(self.stats())
        stored, evicted = self.cache_events.take(tier_slots(self.engine.block_manager, self.engine.tiers),
                                                 pool_written(self.engine.tiers))
        if stored or evicted:
            self.emit(KvCache(self.spec.name, stored, evicted))
        checkpoints = self.decode and self.decode.checkpoints
        if checkpoints and checkpoints.every and (due := checkpoints.due()):
            self.emit(Checkpointed(self.spec.name, due))

    def stats(self) -> Stats:
        return Stats(self.spec.name, self.spec.role, worker_stats(self))

    def _beat(self) -> None:
        """Heartbeat, from its own thread and socket: the process is alive (a stopped or swapped-out one sends
        none), and how long ago its main loop last came round (a wedged loop shows as a growing age; a long
        step too, so the gateway's timeout must exceed the longest step). `pdserve.server.supervisor`."""
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)  # a gateway that is behind needs only the latest beats
        secure_client(sock)
        sock.connect(self.spec.event_addr)
        while self.running:
            try:
                sock.send(pack(Beat(self.spec.name, time.monotonic() - self.loop_s)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            time.sleep(HEARTBEAT_S)
        sock.close()

    def close(self) -> None:
        self.emit(self.stats())
        if self.prefill is not None:
            self.prefill.outbox.stop()  # its links' lanes send nothing more
        for side in (self.prefill and self.prefill.sender, self.decode and self.decode.receiver):
            if side is not None:
                side.close()
        self.cmd_refusals.close()
        self.cmds.close(linger=0)
        leaving = self.departure.asked_s is not None
        # the final stats, if the gateway still listens (not when it stops us); a leaving worker's `left` must
        # reach it: the process ends in os._exit, which drops whatever zmq's I/O thread has not sent yet, so
        # it waits (at most LEFT_FLUSH_S) for the context to send what its closed sockets hold
        self.events.close(linger=int(LEFT_FLUSH_S * 1000) if leaving else 100)
        if leaving:
            flush = threading.Thread(target=self.ctx.term, name="flush", daemon=True)
            flush.start()
            flush.join(LEFT_FLUSH_S)


def _long_context(spec: WorkerSpec) -> bool:
    """Contexts may outgrow the device pool everywhere but on a decode worker whose pool is not in host
    memory (its long prompts' heads are received straight into the host tier; CPU pools only)."""
    from pdserve.engine.model_executor import pick_device
    return spec.role != "decode" or pick_device(spec.engine.get("device", "auto")).type == "cpu"


def _waiting(sock: zmq.Socket):
    """The messages waiting on `sock` now, without blocking."""
    while True:
        try:
            yield sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return


def main(argv: list[str] | None = None) -> int:
    spec = WorkerSpec.from_json((argv or sys.argv[1:])[0])
    return run(spec)


def run(spec: WorkerSpec) -> int:
    """A worker process's life: serve until stopped, then exit the process (never returns)."""
    if not spec.joined:
        _die_with_parent()
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the gateway decides when workers stop
    try:
        worker = Worker(spec)
    except PdserveError as e:  # a setting found bad at load (an attention backend that cannot run here): one line
        print(f"error: {e.message}", file=sys.stderr, flush=True)
        os._exit(2)
    if spec.joined:  # it decides when it leaves, and leaves cleanly
        signal.signal(signal.SIGTERM, worker.departure.ask)
        signal.signal(signal.SIGINT, worker.departure.ask)
    code = serve_until_done(worker)
    # The OS frees the pools at once; the interpreter's teardown of torch and of gigabytes of tensors
    # takes about a second, at every stop and restart.
    os._exit(code)


def serve_until_done(worker: Worker) -> int:
    """Run `worker`'s loop until it stops (shutdown, left, refused, SIGTERM) or crashes; close it; -> exit code."""
    code = 0
    try:
        worker.serve()
        code = worker.exit_code
    except SystemExit as e:  # SIGTERM: the gateway stops it
        code = e.code if isinstance(e.code, int) else 0
    except BaseException:  # noqa: BLE001 - a crash: its traceback goes to the log the gateway shows
        traceback.print_exc()
        code = 1
    finally:
        worker.close()
        kv_io = getattr(worker.executor, "kv_io", None)
        if kv_io is not None:
            kv_io.close()  # what the tiers' I/O thread has queued (disk writes) is done first
        sys.stdout.flush()
        sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
