"""The simulated cluster around the conductor: the real `ConductorCore` decides, on simulated time.

Every conductor decision (route, admit or reject, dispatch the prefill once blocks are reserved, abort) is
made by `pdserve.conductor.conductor_core.ConductorCore`, the same object the gateway drives. This module
feeds it the simulated workers' events and carries out its actions on them, with the real workers' code
where the decision is the workers':
* commands: each simulated worker carries out a command's fields (`pdserve.sim.worker_commands.SimCommands`,
  the same `pdserve.conductor.commands` the real worker implements) at its engine's next step boundary;
* a decode engine's reservations, their grant (and whether a prefill worker is needed at all), the waiting
  reports, settlement and first-read consumption: the real decode worker's books (`pdserve.core.pd.decode_books`);
* a prefill engine's pushes (`pdserve.core.pd.push_range`, as `PrefillSide.on_layer`), its pacing, the flows over
  the link model and their landings: the KV path (`pdserve.sim.kv_push.SimKVPath`);
* stage passes and warm passes: `pdserve.sim.staging` (as the real prefill worker's `StagePasses`).
Serial loops: the real gateway takes requests in one at a time, and a decode worker takes in delivered
transfers one at a time, each a loop pass; an idle worker starts a step at the first message it sees, so of a
burst (requests of the same instant, the transfers one prefill step closes) only the first may make that step
(measured on this project's 2-vCPU Xeon, the conversation trace: a burst's requests reach the conductor 6-19 ms
apart, and of 4 prefill steps whose transfers landed on an idle decode worker 3 were consumed by two decode steps,
the first alone). Here the k-th message of a burst reaches the gateway's intake, and a decode engine's take-in of
landings, `control_latency_s` after the one before it (`_serial`; 0: a burst arrives together, as before).
The prefill step that samples the first token ends the prefill; once every flow has landed the decode engine
settles the transfer (delivered with that token, the request's first output; or recomputed there for an
injected failure) and its next step consumes the KV, reported to the core, which checks its prediction
(`Observe("kv_consumption_error")`, per block). A request may be aborted by a TTFT timeout (the client gives
up); its delivered-but-unread KV is waste. The simulator models no lease lapses (`renew`, `redirect` are
counted, not carried out).
"""

from __future__ import annotations

import random
from collections import Counter

from pdserve.bench.metrics import RequestRecord
from pdserve.conductor.admission import Admission
from pdserve.conductor.consumption import CONSUME_TOLERANCE_S
from pdserve.conductor.conductor_core import ConductorCore, Count, Fail, Observe, Send
from pdserve.conductor.routing import RoutingPolicy
from pdserve.conductor.commands import carry_out
from pdserve.conductor.wire import Ready
from pdserve.core.kvstore.cache_events import REPORT_EVERY_S, CacheEvents, pool_written, tier_slots
from pdserve.core.pd.decode_books import DecodeBooks
from pdserve.core.pd.delivery import WaterLevel
from pdserve.core.sched.online_fit import StepRow
from pdserve.core.sampling_params import SamplingParams, params_dict
from pdserve.core.service_tiers import ServiceTiers
from pdserve.sim.engine import EngineHooks, SimEngine
from pdserve.sim.events import MESSAGE
from pdserve.sim.flight import Flight, Lifecycle
from pdserve.sim.kv_push import SimKVPath
from pdserve.sim.link import LinkModel
from pdserve.sim.staging import SimStaging, engine_capacity
from pdserve.sim.worker_commands import SimCommands

__all__ = ["CONSUME_TOLERANCE_S", "Flight", "Lifecycle", "SimConductor"]


class SimConductor(EngineHooks):
    def __init__(self, mode: str, policy: RoutingPolicy, links: LinkModel, block_size: int, block_bytes: int,
                 failure_rate: float = 0.0, ttft_timeout_s: float | None = None, seed: int = 0,
                 control_latency_s: float = 0.0, tiers: ServiceTiers | None = None,
                 admission: Admission | None = None, water: WaterLevel | None = None,
                 idle_prewarm: bool = True) -> None:
        self.mode, self.links = mode, links
        self.core = ConductorCore(mode, policy, tiers, admission, block_size, idle_prewarm)
        self.counts: Counter = Counter()  # the core's Count actions: (metric, labels) -> n
        self.decisions: list | None = None  # set to [] to record (event, actions) pairs
        # the live step times admission's and the consumption prediction's models learn from
        self.observe_steps = admission is not None and (admission.predict or mode == "pd")
        self.control_s = control_latency_s  # one gateway <-> worker message
        self.loop = links.loop
        self.block_size = block_size
        self.failure_rate, self.ttft_timeout_s = failure_rate, ttft_timeout_s
        self._rng = random.Random(seed)
        self.flights: dict[str, Flight] = {}
        self.books: dict[str, DecodeBooks] = {}  # each decode engine's (the real decode worker's books)
        self.xfers: dict[str, str] = {}  # transfer -> request id, as reserved (a command may name only the first)
        self.life = Lifecycle()
        self.num_finished = 0
        self.cache_events: dict[str, CacheEvents] = {}  # per engine, as a real worker's (its `kv_cache` events)
        self._reported_s: dict[str, float] = {}  # when each engine last reported (`REPORT_EVERY_S`)
        self._free_s: dict = {}  # serial loop -> when it takes its next message (`_serial`)
        self.staging = SimStaging(self.life)
        self.kv = SimKVPath(links, water or WaterLevel(), self.life, block_size, block_bytes, control_latency_s,
                            self._report, self._landed)

    def attach(self, engines: dict[str, list[SimEngine]], port_bw: float) -> None:
        """Take the engines (they were built with this conductor as their hooks), one port each."""
        self.engines, self.port_bw = engines, port_bw
        self.by_name, self.ready, self.commands = {}, {}, {}
        for e in [e for es in engines.values() for e in es]:
            e.load = self.core.add_worker(e.name, e.role, e.load)
            self._register(e)

    def add_engine(self, e: SimEngine) -> None:
        """An engine that joined while the run goes on (role switching), registered with the core already."""
        self.engines.setdefault(e.role, []).append(e)
        self._register(e)

    def _register(self, e: SimEngine) -> None:
        self.by_name[e.name] = e
        self.commands[e.name] = SimCommands(self, e)
        config = e.scheduler.config
        self.core.worker_ready(e.name, Ready(e.name, e.role, block_size=self.block_size, max_num_seqs=config.max_num_seqs,
                                             max_num_batched_tokens=config.max_num_batched_tokens,
                                             num_blocks=e.scheduler.blocks.num_blocks,
                                             kv_block_bytes=self.kv.block_bytes if e.role == "prefill" else 0,
                                             **engine_capacity(e, self.links.policy.scheduled)))
        self.cache_events[e.name] = CacheEvents()
        self.kv.add_port(e.name, self.port_bw)
        if e.role == "decode":
            # A request that ended at the gateway is dropped from the reservations at once (its abort is
            # still on its way to the engine).
            self.books[e.name] = DecodeBooks(e.scheduler, self.block_size, gone=self._gone)
            self.ready[e.name] = []

    def _gone(self, rid: str) -> bool:
        return rid not in self.flights

    # ---- intake -----------------------------------------------------------------------------------------
    def submit(self, rid: str, prompt, output_len: int, record: RequestRecord, priority: int = 0,
               tier: str | None = None) -> None:
        """A request arrives (its record's start); the gateway's intake takes it now, or after the requests
        before it of a burst (`_serial`)."""
        at = self._serial("intake", self.loop.now)
        if at > self.loop.now:
            self.loop.at(at, self._submit, rid, prompt, output_len, record, priority, tier, prio=MESSAGE)
        else:
            self._submit(rid, prompt, output_len, record, priority, tier)

    def _serial(self, loop: str, at_s: float) -> float:
        """When a serial loop (the gateway's `intake`, a decode engine's take-in of landed KV) takes a message
        that reaches it at `at_s`: then, or `control_s` after the message it took before (no control latency:
        then, whatever came before)."""
        if not self.control_s:
            return at_s
        at = max(at_s, self._free_s.get(loop, at_s))
        self._free_s[loop] = at + self.control_s
        return at

    def _submit(self, rid: str, prompt, output_len: int, record: RequestRecord, priority: int,
                tier: str | None) -> None:
        f = Flight(rid, prompt, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True), record,
                   priority, tier or "default")
        record.service_tier = tier
        actions = self._core("arrive", rid, prompt, params_dict(f.params), self.loop.now, tier=f.tier,
                             priority=priority)
        state = self.core.flights.get(rid)
        if state is None:  # refused on arrival
            f.finished = True
            self._ended(f, actions)
            return
        f.decode, f.prefill = self.by_name[state.decode], self.by_name.get(state.prefill)
        self.flights[rid] = f
        if self.ttft_timeout_s is not None:
            self.loop.at(max(record.start_s + self.ttft_timeout_s, self.loop.now), self._timeout, f)
        self._act(actions)

    # ---- the core's actions -------------------------------------------------------------------------------
    def _core(self, event: str, *args, **kwargs) -> list:
        actions = getattr(self.core, event)(*args, **kwargs)
        if self.decisions is not None:
            self.decisions.append((event, args, kwargs, actions))
        return actions

    def _act(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, Send):
                self._command(self.by_name[action.worker], action.cmd)
            elif isinstance(action, Count):
                self.counts[(action.metric, action.labels)] += 1
            elif isinstance(action, Observe):
                self.life.observe(action.metric, action.value, action.weight,
                                  dict(action.labels).get("service_tier", "default"), self.loop.now)
            elif isinstance(action, Fail) and action.rid in self.flights:
                f = self.flights[action.rid]
                self._finish(f)
                self._ended(f, [action])

    def _ended(self, f: Flight, actions: list) -> None:
        """A request refused or failed by the core: its record says why."""
        for action in actions:
            if isinstance(action, Count):
                self.counts[(action.metric, action.labels)] += 1
            elif isinstance(action, Fail):
                rec = f.record
                rec.error = f"HTTP {action.status}: {action.message}"
                rec.end_s, rec.rejected = self.loop.now, action.status == 429

    def _command(self, engine: SimEngine, cmd) -> None:
        """What a worker does with a command (`pdserve.sim.worker_commands`)."""
        carry_out(cmd, self.commands[engine.name])

    # ---- decode side: reservations and settlement (before each decode step) ------------------------------
    def has_pending(self, engine: SimEngine) -> bool:
        books = self.books.get(engine.name)
        return books is not None and bool(books.pending)

    def hold_production_s(self, engine: SimEngine) -> float:
        return self.kv.hold_production_s(engine, self.flights.get) if engine.role == "prefill" else 0.0

    def _report(self, event: str, *args) -> None:
        """A core event from the KV path: its actions carried out."""
        self._act(self._core(event, *args))

    def _landed(self, f: Flight, delay_s: float) -> None:
        """`f`'s transfer is complete: its decode engine settles it at its next boundary (the transfers of a burst
        one after another, `_serial`)."""
        d, now = f.decode, self.loop.now
        at = self._serial(f"landings:{d.name}", now + delay_s)
        d.post(lambda: self.ready[d.name].append(f), at - now)

    def before_step(self, engine: SimEngine) -> None:
        if engine.role != "decode":
            return
        self._grant(engine)
        ready, self.ready[engine.name] = self.ready[engine.name], []
        for f in ready:
            self._settle(engine, f)

    def _grant(self, engine: SimEngine) -> None:
        """The books grant what blocks allow; the core hears of each grant, and once of each reservation left
        waiting for room (as the real decode worker reports them)."""
        books = self.books[engine.name]
        for g in books.grant():
            f = self.flights[g.reservation.request.request_id]
            if not g.needs_prefill:
                self.ready[engine.name].append(f)
            self._act(self._core("reserved", f.rid, g.reservation.xfer, g.needs_prefill, engine.name,
                                 g.first_block, self.loop.now))
        for res in books.newly_waiting():
            self._act(self._core("reserve_waiting", res.request.request_id, res.xfer, self.loop.now))

    def _settle(self, engine: SimEngine, f: Flight) -> None:
        """Its KV landed (or none was needed): the books settle it, delivered or (an injected failure)
        recomputed."""
        if f.finished or engine.scheduler.requests.get(f.rid) is None:
            return
        self.life.transfers += f.delivered > 0
        failed = bool(f.delivered) and self._rng.random() < self.failure_rate
        self.life.transfer_failures += failed
        _, req = self.books[engine.name].settle(f.rid, not failed, f.first_token, f.delivered, "failed_injected")
        if req is not None and f.first_token is not None:  # the first output token is out now, no step here
            self._token(engine, f, [f.first_token], req.is_finished, self.loop.now)

    def _periodic_reports(self, engine: SimEngine, now: float) -> None:
        """As a real worker with its stats (every `REPORT_EVERY_S`): what its cache stored and evicted (`kv_cache`)
        and, a prefill engine, its links' rates (`kv_links`: the link model's)."""
        if now - self._reported_s.get(engine.name, float("-inf")) < REPORT_EVERY_S:
            return
        self._reported_s[engine.name] = now
        stored, evicted = self.cache_events[engine.name].take(tier_slots(engine.scheduler.blocks, engine.tiers),
                                                              pool_written(engine.tiers))
        if stored or evicted:
            self._act(self._core("worker_cache", engine.name, stored, evicted))
        if engine.role == "prefill" and self.mode == "pd":
            decodes = [e.name for e in self.engines.get("decode", [])]
            self._core("worker_links", engine.name, self.kv.link_report(engine.name, decodes))

    def on_step_start(self, engine: SimEngine, scheduled, start_s: float, duration_s: float) -> None:
        self._periodic_reports(engine, start_s)
        if self.observe_steps:  # the live step times admission's model learns from, as a real worker reports
            self._core("worker_steps", engine.name, [StepRow.of(scheduled, duration_s).reported()],
                       engine.scheduler.step_budget.last_cap)
        if engine.role == "prefill":
            for chunk in scheduled.chunks:
                f = self.flights.get(chunk.request_id)
                if f is not None and not f.finished:
                    self.kv.push(engine, f, chunk.start_pos + chunk.num_tokens, duration_s)
        elif engine.role == "decode" and self.books[engine.name].unread:
            self._read(engine, (chunk.request_id for chunk in scheduled.chunks), start_s)

    # ---- outputs ----------------------------------------------------------------------------------------
    def on_step_end(self, engine: SimEngine, scheduled, outputs, end_s: float) -> None:
        for out in outputs:
            f = self.flights.get(out.request_id)
            if f is None:
                staged = self.staging.ended(engine, out.request_id, out.finish_reason == "prefilled") if (
                    engine.role == "prefill") else None
                if staged is not None:  # (the core ignores a request it no longer tracks)
                    self._act(self._core("staged", staged, out.finish_reason == "prefilled", end_s + self.control_s))
                continue
            if out.finish_reason == "prefilled":
                self.staging.done(engine, f.rid)
                f.first_token = out.token_ids[-1] if out.token_ids else None
                self.kv.prefilled(engine, f, end_s)
                continue
            self._token(engine, f, out.token_ids, out.finished, end_s)

    def _token(self, engine: SimEngine, f: Flight, token_ids, finished: bool, at_s: float) -> None:
        at_s += self.control_s  # the token event's way to the gateway
        rec = f.record
        rec.token_times.append(at_s)
        if rec.first_token_s is None:
            rec.first_token_s = at_s
            books = self.books.get(engine.name)
            if books is not None:  # how its KV arrived: a real worker's usage, kept until its first token
                books.kv_usage(f.rid, 0, 0)
        if rec.first_token_s == at_s or finished:  # the core hears of the first and the last token
            self._act(self._core("token", f.rid, len(token_ids) - 1, finished, at_s))
        if finished:
            rec.output_tokens = len(token_ids)
            rec.end_s = at_s
            self._finish(f)

    def on_decode_run(self, engine: SimEngine, requests, ends: list[float], start_s: float) -> None:
        for req in requests:
            f = self.flights.get(req.request_id)
            if f is not None:
                f.record.token_times.extend(e + self.control_s for e in ends)
        if engine.role == "decode" and self.books[engine.name].unread:  # the run's first step read them
            self._read(engine, (req.request_id for req in requests), start_s)

    def _read(self, engine: SimEngine, rids, start_s: float) -> None:
        """A step beginning at `start_s` read these requests: those whose delivered KV it read first are
        consumed (a request that ended meanwhile is not)."""
        for rid in self.books[engine.name].consumed(rids):
            f = self.flights.get(rid)
            if f is not None:
                self.kv.consumed(f, start_s)

    # ---- endings ----------------------------------------------------------------------------------------
    def _finish(self, f: Flight) -> None:
        """The simulator's own bookkeeping of an ended request (the core keeps its own)."""
        if f.finished:
            return
        f.finished = True
        del self.flights[f.rid]
        self.xfers.pop(f.xfer, None)
        self.num_finished += 1

    def fail(self, f: Flight, message: str) -> None:
        f.record.error = message
        f.record.end_s = self.loop.now
        self._abort_everywhere(f)

    def _timeout(self, f: Flight) -> None:
        if f.finished or f.record.first_token_s is not None:
            return
        self.life.aborted += 1
        self.fail(f, f"aborted: no first token within {self.ttft_timeout_s} s")

    def _abort_everywhere(self, f: Flight) -> None:
        self._act(self._core("abort", f.rid))
        self._finish(f)
