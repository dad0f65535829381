"""The conductor's decisions, sans I/O: events in, actions out; one copy for the gateway and the simulator.

No asyncio, sockets or wall clock here (the caller passes `now`). The gateway (`server/conductor_driver.py`) drives
it with ZeroMQ events and the real clock; the simulator (`sim/conductor.py`) with its event loop and
simulated time. What it decides:

* **route** a request (the routing policy over `WorkerLoad`s: outstanding counts, remembered prefixes);
* **admit or reject** it: no live worker (503), a full queue or a predicted SLO miss (429 with Retry-After,
  `pdserve.conductor.admission`);
* in PD mode, ask the decode worker to **reserve** KV blocks, then **dispatch** the prefill to the prefill
  worker once they are reserved (or not at all, when the decode worker has every prompt token but the last);
* react to **failures** (`pdserve.conductor.recovery`): a dead decode worker's requests move to a live one
  with their outputs so far (nothing lost, no token changed); a dead prefill worker's prompts move to another
  prefill worker unless recomputing on the decode worker is predicted faster or none is left; a transfer
  whose lease lapsed is held by its decode worker: renewed while its prefill worker's process is heard (busy,
  not hung), else the same choice, that prefill worker passed by until it reports again; a failed delivery
  aborts the moot prefill;
* track each request's TTFT and TPOT against its service tier's SLO (`Count("slo_attained")`);
* **stage** prompts while their decode worker has no room (PD, `--delivery scheduled`): an idle prefill
  worker computes a waiting prompt ahead (`stage`; which one: `pdserve.conductor.staging`); its KV stays in
  that worker's prefix cache and host tier (no device blocks held, no transfer open), and the prefill
  dispatched once blocks are reserved finds it there and only sends it (`Count("kv_staged")`); with no
  prompt to stage, an idle prefill worker **prewarms** the hot prefix it lacks (`warm`, idle prewarm:
  `pdserve.conductor.hot_prefixes`), so prefix-affine routing can spread that prefix's requests;
* **predict when a transfer's KV will first be consumed** (`pdserve.conductor.consumption`) at dispatch, send
  it with the prefill as the transfer's delivery deadline, refine it when the prompt is prefilled, and check
  it when the decode worker reports the consuming step (`Observe("kv_consumption_error")`, per block);
* take **workers that join** the running deployment, and let workers **leave** without losing a request
  (drain, release, hand off: `pdserve.conductor.membership`).

The core composes parts that own their state and see only `Books` (`pdserve.conductor.books`: the flights,
workers and backlog, and the moves that keep their counts) and what else each needs: `Staging`, `Recovery`,
`Membership`. The drivers call the core's event methods; the core hands each event to the part it concerns.

Actions (`pdserve.conductor.actions`): `Send(worker, cmd)` (a command: `pdserve.conductor.wire`), `Fail(rid, ...)` (end the
request with an error the client sees), `Count(metric, labels)` (a counted event for the metrics),
`Observe(metric, labels, value, weight)` (a value for a histogram, `weight` times: admission's predicted TTFT and,
at the first token, its error (`prediction_error`: observed - predicted),
consumption errors).
"""

from __future__ import annotations

from pdserve.conductor.actions import Count, Fail, Observe, Send, stale
from pdserve.conductor.admission import Admission, Rejection
from pdserve.conductor.books import Books
from pdserve.conductor.consumption import ConsumptionPredictor, Prediction
from pdserve.conductor.flight_state import Backlog, FlightState, Stage
from pdserve.conductor.hot_prefixes import HotPrefixes
from pdserve.conductor.membership import Membership
from pdserve.conductor.recovery import Recovery
from pdserve.conductor.routing import MAX_RECENT_BLOCKS, HashRun, RoutingPolicy, WorkerLoad
from pdserve.conductor.staging import StagePlan, Staging
from pdserve.conductor.wire import Abort, KvFailed, Prefill, Ready
from pdserve.core.pd.sensitivity import DEFAULT as DEFAULT_LABEL
from pdserve.core.service_tiers import ServiceTiers
from pdserve.core.settings import KvBlockSettings, default_of

__all__ = ["Backlog", "ConductorCore", "Count", "Fail", "FlightState", "Observe", "Send"]


class ConductorCore:
    """Composes its parts, each owning its own state: `books` (the flights, workers, backlog and the moves
    that keep their counts: `pdserve.conductor.books`), `staging`, `recovery` and `membership`; each part sees
    `books` and what else it needs, never the core. The drivers call the core's event methods only."""

    def __init__(self, mode: str, policy: RoutingPolicy, tiers: ServiceTiers | None = None,
                 admission: Admission | None = None,
                 block_size: int = default_of(KvBlockSettings, "block_size"), idle_prewarm: bool = True,
                 max_queue: int | None = None, role_planner=None) -> None:
        self.tiers = tiers or ServiceTiers()
        self.admission = admission
        self.consumption = ConsumptionPredictor(admission)
        self.max_queue = max_queue  # most requests of one tier waiting for their first token (None: no bound)
        plan = StagePlan(self.tiers)
        self.books = Books(mode, policy, self.tiers, block_size, plan.done)
        self.books.admission = admission
        self.staging = Staging(self.books, plan, HotPrefixes() if idle_prewarm and mode == "pd" else None)
        self.recovery = Recovery(self.books, admission)
        # --role-switching auto: a `pdserve.core.role_planner.RolePlanner` (the drivers may set `roles` later)
        self.membership = Membership(self.books, admission, role_planner)

    # ---- what the drivers read ------------------------------------------------------------------------------
    @property
    def flights(self) -> dict[str, FlightState]:
        return self.books.flights

    @property
    def workers(self) -> dict[str, WorkerLoad]:
        return self.books.workers

    @property
    def backlog(self) -> dict[str, Backlog]:
        return self.books.backlog

    @property
    def block_size(self) -> int:
        return self.books.block_size

    @property
    def roles(self):
        return self.membership.roles

    @roles.setter
    def roles(self, planner) -> None:
        self.membership.roles = planner

    # ---- workers ----------------------------------------------------------------------------------------
    def add_worker(self, name: str, role: str, load: WorkerLoad | None = None) -> WorkerLoad:
        return self.books.add_worker(name, role, load)

    def worker_ready(self, name: str, info: Ready, now: float | None = None) -> list:
        """Its `ready` event: at start, or once restarted after a death (it takes work again, from scratch); a
        replacement's completes its role move."""
        moved = self.membership.worker_ready(name, info, now)
        load = self.workers[name]
        if not load.alive:
            load.alive, load.stalled, load.outstanding = True, False, 0
            load.recent_blocks.clear()
            load.reported.clear()
            self.backlog[name] = Backlog()
        self.books.block_size = info.block_size
        self.books.block_bytes = info.kv_block_bytes or self.books.block_bytes
        if info.kv_capacity_blocks:  # what it no longer holds need not be remembered
            load.max_recent_blocks = min(info.kv_capacity_blocks, MAX_RECENT_BLOCKS)
        self.staging.worker_ready(name, info)
        if self.admission is not None:
            model = self.admission.model(name)
            model.budget = model.max_budget = info.max_num_batched_tokens
        return moved + (self.recovery.adopt_orphans() if self.recovery.orphans else [])

    def worker_steps(self, name: str, steps, prefill_cap: int | None = None) -> list:
        """Recent steps of a worker: [(prefill_tokens, prefill_sq, decode_seqs, decode_context, seconds[,
        prefill_prefix])] (`online_fit.REPORTED`);
        `prefill_cap`: the prefill tokens its next step may carry (`pdserve.core.sched.step_budget`), the chunk size
        admission predicts prefill in."""
        self.workers[name].stalled = False  # it reports again
        if self.admission is not None and steps:
            self.admission.observe_steps(name, steps)
        if self.admission is not None and prefill_cap:
            self.admission.model(name).budget = prefill_cap
        return []

    def worker_links(self, name: str, links: dict) -> list:
        """A prefill worker's links as its stats report them (`kv_links`: decode worker -> {capacity, ...}):
        the measured rates a pair policy predicts transfers with, and the links whose KV paths are all open
        (`path_open`: routing pairs that prefill worker with another decode worker meanwhile)."""
        self.books.links[name] = {dest: v["capacity"] for dest, v in links.items() if v.get("capacity")}
        self.books.open_paths[name] = {dest for dest, v in links.items() if v.get("path_open")}
        return []

    def worker_cache(self, name: str, stored: dict, evicted: dict) -> list:
        """A worker's `kv_cache` event: block hashes (per tier) it stored and evicted since its last one; its
        `remote` part, what it wrote to the shared pool, goes to the pool every worker reaches (`Books.pool`)."""
        if "remote" in stored:
            self.books.pool_written(stored.pop("remote"))
        self.workers[name].reported.apply(stored, evicted)
        return []

    def worker_died(self, name: str, now: float = 0.0, reason: str = "worker_died", restarting: bool = False
                    ) -> list:
        """`restarting`: it is being started again (its requests may wait for it when no other can take them)."""
        return [Count("worker_deaths", (("worker", name),))] + self._worker_gone(name, reason, restarting)

    def worker_joined(self, name: str, role: str, now: float | None = None, loaded: bool = True) -> list:
        return self.membership.worker_joined(name, role, now, loaded)

    def worker_leaving(self, name: str) -> list:
        return self.membership.worker_leaving(name)

    def drained(self) -> list[str]:
        return self.membership.drained()

    def worker_left(self, name: str, now: float, drained: bool) -> list:
        return self.membership.worker_left(name, drained) + self._worker_gone(name, "worker_left", False)

    def plan_roles(self, now: float, movable=None) -> list:
        return self.membership.plan_roles(now, movable)

    def _worker_gone(self, name: str, reason: str, restarting: bool) -> list:
        """A worker is gone (died, hung, left): its requests and prompts move to the others."""
        self.workers[name].alive = False
        self.membership.worker_gone(name, restarting)
        self.staging.worker_gone(name)
        return self.recovery.worker_gone(name, reason, restarting)

    # ---- requests ---------------------------------------------------------------------------------------
    def arrive(self, rid: str, prompt: list, params: dict, now: float, *, tier: str = "default",
               priority: int = 0, pin: tuple | None = None, follow: tuple = (),
               sensitivity: str = DEFAULT_LABEL) -> list:
        """`follow`: the workers another sequence of the same prompt runs on (n > 1): this one goes there too,
        where the prompt's KV is cached, while they can take it; admitted with that one (a request's sequences
        are admitted as one: no queue limit or SLO check refuses a sibling halfway)."""
        f = FlightState(rid, prompt, params, tier, now, priority, pin, sensitivity)
        if self.roles is not None:
            self.roles.arrived(now, len(prompt), params.get("max_tokens") or 0)
        hashes = HashRun(self.books.affinity(prompt))
        first, second = self._follow(follow) or self.books.route(hashes, len(prompt), self.tiers[tier].rank, now)
        noted = self._route_notes(hashes, first, second)
        if first is None:
            return [Count("admission_rejected", (("service_tier", tier), ("reason", "no_worker"))),
                    Fail(rid, 503, "no live worker can serve this request", "no_worker")]
        if not follow and self.max_queue is not None and self.books.waiting.get(tier, 0) >= self.max_queue:
            return [Count("admission_rejected", (("service_tier", tier), ("reason", "server_overloaded"))),
                    Fail(rid, 429, f"the {tier} tier's queue is full ({self.max_queue} requests waiting); "
                         "try again later", "server_overloaded", 1.0)]
        self.backlog[(second or first).name].arriving(now)
        rejection = None if follow else self._admit(f, first, second, hashes, now)
        predicted = self.admission.last_ttft_s if self.admission is not None and not follow else None
        seen = [] if predicted is None else [Observe("predicted_ttft", (("service_tier", tier),), predicted)]
        if predicted is None and not follow and self._predicts(tier):  # admitted unpredicted: its worker has too few steps yet
            seen.append(Count("fallbacks", (("kind", "admission_unpredicted"),)))
        if rejection is not None:
            return seen + [Count("admission_rejected", (("service_tier", tier), ("reason", rejection.reason))),
                           Fail(rid, 429, rejection.message, rejection.code, rejection.retry_after_s)]
        f.predicted_ttft_s = predicted
        return noted + seen + self.books.place(f, first, second, hashes) + self.staging.arrived(hashes, prompt, now, f.sensitivity)

    def _route_notes(self, hashes, *chosen: WorkerLoad | None) -> list:
        """The routing policy's fallbacks, and where the gateway's guess of a chosen worker's cached prefix (what
        it sent there) disagrees with the worker's own report (`routing_prefix_disagreements{role}`)."""
        out = [Count("fallbacks", (("kind", kind),)) for kind in self.books.notes]
        self.books.notes.clear()
        for w in chosen:
            if w is not None and w.reported.reports and len(hashes) and (
                    w.guessed_blocks(hashes) != w.reported.prefix_len(hashes.keys)):
                out.append(Count("routing_prefix_disagreements", (("role", w.role),)))
        return out

    def _follow(self, names: tuple) -> tuple[WorkerLoad, WorkerLoad | None] | None:
        loads = [self.workers.get(n) for n in names]
        if not loads or any(w is None or not w.usable for w in loads):
            return None
        return loads[0], loads[1] if len(loads) > 1 else None

    def _admit(self, f: FlightState, first: WorkerLoad, second: WorkerLoad | None, hashes, now: float
               ) -> Rejection | None:
        if self.admission is None:
            return None
        producer = second if second is not None else first
        cached = producer.prefix_blocks(hashes) * self.block_size
        rank = self.tiers[f.tier].rank
        tokens = self.backlog[producer.name].tokens
        ahead = sum(n for r, n in tokens.items() if r <= rank)
        return self.admission.check(self.tiers[f.tier], producer.name, first.name, len(f.prompt) - cached, ahead,
                                    sum(tokens.values()) - ahead, self.backlog[first.name].decoding,
                                    first.outstanding, now, self.backlog[producer.name].busy_s(now))

    def _predicts(self, tier: str) -> bool:
        return self.admission is not None and self.admission.predict and self.tiers[tier].ttft_ms is not None

    def abort(self, rid: str) -> list:
        """The client is gone (or a stop string ended it): stop it everywhere."""
        f = self.flights.get(rid)
        if f is None:
            self.recovery.forget(rid)  # (it was waiting for a worker)
            return []
        workers = [w for w in (f.decode, f.prefill) if w is not None]  # before `finish` lets the prefill go
        self.books.finish(f)
        return [Send(w, Abort(rid)) for w in workers]

    # ---- worker events ----------------------------------------------------------------------------------
    def reserved(self, rid: str, xfer: str, needs_prefill: bool, kv_addr: str, first_block: int,
                 now: float = 0.0) -> list:
        f = self.flights.get(rid)
        if f is None or f.xfer != xfer:
            return stale("reserved")
        if not needs_prefill:  # its decode worker has the prompt cached
            self.books.release_prefill(f)
            f.advance(Stage.LOCAL_PREFILL)
            return []
        if f.prefill is None or not self.workers[f.prefill].alive:
            self.books.release_prefill(f)
            f.advance(Stage.LOCAL_PREFILL)
            return [Count("fallbacks", (("kind", "no_prefill_worker"),)),
                    Send(f.decode, KvFailed(f.xfer, "no_prefill_worker"))]
        f.kv_addr, f.first_block = kv_addr, first_block
        if self.workers[f.prefill].stalled:  # routed there before its lease lapsed: move it now
            return self.recovery.prefill_gone(f, "failed_timeout")
        deadline, read = self._predict_dispatch(f, first_block, now)
        f.advance(Stage.DISPATCHED)
        return [Send(f.prefill, Prefill(**f.request_fields(), dest=kv_addr, link=f.decode, xfer=f.xfer,
                                        first_block=first_block,
                                        deadline_in_s=None if deadline is None else deadline - now,
                                        read_in_s=None if read is None else read - now))]

    def reserve_waiting(self, rid: str, xfer: str, now: float = 0.0) -> list:
        return self.staging.reserve_waiting(rid, xfer, now)

    def _predict_dispatch(self, f: FlightState, first_block: int, now: float) -> tuple[float | None, float | None]:
        """(its predicted first consumption, the same were the link free: `ConsumptionPredictor.at_dispatch`).
        Ahead of it at the prefill worker: the prompts dispatched there before it and not yet prefilled (of its
        tier rank or better; the others may share its last step)."""
        rank = self.tiers[f.tier].rank
        tokens = self.backlog[f.prefill].dispatched
        ahead = sum(n for r, n in tokens.items() if r <= rank)
        behind = sum(tokens.values()) - ahead
        tokens[rank] += f.queued_tokens
        f.dispatched_s = now
        predicted, read = self.consumption.at_dispatch(now, f.prefill, f.decode, f.queued_tokens, ahead, behind,
                                                       self.backlog[f.prefill].busy_s(now))
        blocks = -(-len(f.resumed_prompt) // self.block_size) - first_block
        f.prediction = Prediction(blocks, predicted, predicted, tier=f.tier)
        return predicted, read

    def prefilled(self, rid: str, now: float, landing_in_s: float | None = None, failed: bool = False) -> list:
        """`landing_in_s`: the prefill worker's link's estimate of when the transfer's last chunk is out;
        `failed`: it gave up on the delivery (its sender will send nothing more: no lease is renewed for it); its
        decode worker, still waiting for that KV, recomputes it at once (`Recovery.send_failed`)."""
        f = self.flights.get(rid)
        if f is None:
            return stale("prefilled")
        prefill = f.prefill or f.prefilled_by  # (reported again, a delivery given up later: who prefilled it)
        if f.stage is not Stage.DECODING:  # (a report after the first token leaves the timeline the token set)
            f.prefilled_s, f.prefilled_by = now, prefill
        f.gave_up = failed
        if prefill is not None and f.stage is not Stage.DECODING:
            self.backlog[prefill].stepped(now)
        self.books.release_prefill(f)
        if f.stage not in (Stage.LOCAL_PREFILL, Stage.DECODING):  # (else its decode worker took over)
            f.advance(Stage.PREFILLED)
        if f.prediction is not None:
            self.consumption.at_prefilled(f.prediction, now, f.decode, landing_in_s)
        recover = self.recovery.send_failed(f) if failed and f.stage is Stage.PREFILLED else []
        return recover + self.staging.next(prefill, now)

    def staged(self, rid: str, ok: bool, now: float = 0.0) -> list:
        return self.staging.staged(rid, ok, now)

    def relanded(self, rid: str, now: float, landing_in_s: float) -> list:
        """The prefill worker's link re-estimated when this prefilled transfer's last chunk leaves (another
        transfer became due there and shares the link): the consumption prediction is refined again."""
        f = self.flights.get(rid)
        if f is None:
            return stale("relanded")
        if f.prediction is None or f.prediction.landed_s is None:
            return []
        self.consumption.at_prefilled(f.prediction, now, f.decode, landing_in_s)
        return [Count("kv_prediction_refinements", (("service_tier", f.tier),))]

    def consumed(self, rid: str, at_s: float) -> list:
        """The decode worker's first step reading this request's delivered KV started at `at_s`."""
        f = self.flights.get(rid)
        if f is None:
            return stale("consumed")
        p = f.prediction
        if p is None:
            return []
        f.prediction = None  # checked once
        self.consumption.consumed(p, f.decode, at_s)
        return [Observe(metric, (("service_tier", p.tier),), at_s - predicted, p.blocks)
                for metric, predicted in (("kv_consumption_error", p.final_s),
                                          ("kv_consumption_error_at_prefilled", p.at_prefilled_s),
                                          ("kv_consumption_error_at_dispatch", p.at_dispatch_s))
                if predicted is not None]

    def transfer_outcome(self, rid: str, outcome: str, xfer: str = "", now: float = 0.0) -> list:
        """A transfer ended badly on the decode worker: `recompute` (it recomputes the prompt) or `held` (its
        lease lapsed; it holds the blocks for this core's choice, `Recovery.lease_lapsed`)."""
        f = self.flights.get(rid)
        if f is None or (xfer and f.xfer != xfer):
            return stale("transfer")  # ended (its abort frees the blocks), or moved to another transfer
        if outcome == "held":
            return self.recovery.lease_lapsed(f, xfer, now)
        if outcome != "recompute" or f.prefill is None:
            return []
        prefill = f.prefill
        self.books.release_prefill(f)  # its work is moot now: the decode worker recomputes
        f.advance(Stage.LOCAL_PREFILL)
        return [Send(prefill, Abort(rid))]

    def token(self, rid: str, index: int, finished: bool, now: float, token_id: int | None = None) -> list:
        """The request's token `index` (counted over its whole output, across moves) came out; `token_id`:
        which one (kept so the request can move if its worker dies; a simulator reports only some)."""
        f = self.flights.get(rid)
        if f is None:
            return stale("tokens")
        if index < f.num_tokens:
            return []  # a duplicate (a simulator may report only some tokens: the first and the last)
        if token_id is not None and index == len(f.outputs):
            f.outputs.append(token_id)
        f.num_tokens = index + 1
        seen = self._checked_ttft(f, now)
        if f.stage is not Stage.DECODING:  # the first token from where it runs now
            self.books.waiting[f.tier] -= 1
            f.first_token_s = f.first_token_s or now
            if f.prefill is None and f.prefilled_s is None:  # prefilled where it runs (colocated, recomputed)
                self.backlog[f.decode].stepped(now)
            if f.prefilled_s is not None and self.admission is not None:
                self.admission.observe_delivery(f.decode, now - f.prefilled_s)
            elif f.prefilled_s is None and f.prefill is not None and f.dispatched_s is not None:
                # its KV came before its prefill worker's report (separate processes): prefilled by now
                f.prefilled_s, f.prefilled_by = now, f.prefill
            self.books.release_prefill(f)
            self.books.delivered(f.rid)
            f.advance(Stage.DECODING)
            self.backlog[f.decode].decoding += 1
        f.last_token_s = now
        if not finished:
            return seen
        if self.roles is not None:
            self.roles.finished(f.params.get("max_tokens") or 0, f.num_tokens)
        self.books.finish(f)
        return seen + ([Count("slo_attained", (("service_tier", f.tier),))] if self._attained(f) else [])

    def checkpointed(self, rid: str, worker: str, tokens: int) -> list:
        return self.recovery.checkpointed(rid, worker, tokens)

    def worker_error(self, rid: str) -> list:
        """A worker reported an error for this request: the caller ends its stream with it; abort the rest."""
        return self.abort(rid)

    # ---- helpers ----------------------------------------------------------------------------------------
    @staticmethod
    def _checked_ttft(f: FlightState, now: float) -> list:
        """At its first token: admission's prediction of its TTFT against the TTFT it got (observed - predicted),
        once."""
        if f.predicted_ttft_s is None:
            return []
        error, f.predicted_ttft_s = now - f.arrival_s - f.predicted_ttft_s, None
        return [Observe("prediction_error", (("service_tier", f.tier),), error)]

    def _attained(self, f: FlightState) -> bool:
        tier = self.tiers[f.tier]
        ttft_ms = (f.first_token_s - f.arrival_s) * 1000.0
        tpot_ms = (f.last_token_s - f.first_token_s) * 1000.0 / max(f.num_tokens - 1, 1)
        return (tier.ttft_ms is None or ttft_ms <= tier.ttft_ms) and (tier.tpot_ms is None or tpot_ms <= tier.tpot_ms)
