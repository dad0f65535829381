"""The conductor's decisions, sans I/O: events in, actions out; one copy for the gateway and the simulator.

No asyncio, sockets or wall clock here (the caller passes `now`). The gateway (`cluster/conductor.py`) drives
it with ZeroMQ events and the real clock; the simulator (`sim/conductor.py`) with its event loop and
simulated time. What it decides:

* **route** a request (the routing policy over `WorkerLoad`s: outstanding counts, remembered prefixes);
* **admit or reject** it: no live worker (503), a full queue or a predicted SLO miss (429 with Retry-After,
  `pdserve.cluster.admission`);
* in PD mode, ask the decode worker to **reserve** KV blocks, then **dispatch** the prefill to the prefill
  worker once they are reserved (or not at all, when the decode worker has every prompt token but the last);
* react to **failures** (`pdserve.cluster.recovery`): a dead decode worker's requests move to a live one
  with their outputs so far (nothing lost, no token changed); a dead prefill worker's prompts move to another
  prefill worker unless recomputing on the decode worker is predicted faster or none is left; a transfer
  whose lease lapsed is held by its decode worker: renewed while its prefill worker's process is heard (busy,
  not hung), else the same choice, that prefill worker passed by until it reports again; a failed delivery
  aborts the moot prefill;
* track each request's TTFT and TPOT against its service tier's SLO (`Count("slo_attained")`);
* **stage** prompts while their decode worker has no room (PD, `--delivery scheduled`): an idle prefill
  worker computes a waiting prompt ahead (`stage`; which one: `pdserve.cluster.staging`); its KV stays in
  that worker's prefix cache and host tier (no device blocks held, no transfer open), and the prefill
  dispatched once blocks are reserved finds it there and only sends it (`Count("kv_staged")`); with no
  prompt to stage, an idle prefill worker **prewarms** the hot prefix it lacks (`warm`, idle prewarm:
  `pdserve.cluster.hot_prefixes`), so prefix-affine routing can spread that prefix's requests;
* **predict when a transfer's KV will first be consumed** (`pdserve.cluster.consumption`) at dispatch, send
  it with the prefill as the transfer's delivery deadline, refine it when the prompt is prefilled, and check
  it when the decode worker reports the consuming step (`Observe("kv_consumption_error")`, per block);
* take **workers that join** the running deployment, and let workers **leave** without losing a request
  (drain, release, hand off: `pdserve.cluster.membership`).

Actions (`pdserve.cluster.actions`): `Send(worker, cmd)` (a command: `pdserve.cluster.wire`), `Fail(rid, ...)` (end the
request with an error the client sees), `Count(metric, labels)` (a counted event for the metrics),
`Observe(metric, labels, value, weight)` (a value for a histogram, `weight` times: admission's predicted TTFT,
consumption errors).
"""

from __future__ import annotations

import itertools

from pdserve.cluster.actions import Count, Fail, Observe, Send, stale
from pdserve.cluster.admission import Admission, Rejection
from pdserve.cluster.consumption import ConsumptionPredictor, Prediction
from pdserve.cluster.flight_state import Backlog, FlightState
from pdserve.cluster.hot_prefixes import HotPrefixes
from pdserve.cluster.membership import MembershipEvents
from pdserve.cluster.recovery import RecoveryEvents
from pdserve.cluster.routing import AFFINITY_BLOCKS, MAX_RECENT_BLOCKS, HashRun, RoutingPolicy, WorkerLoad
from pdserve.cluster.staging import StagePlan, StagingEvents
from pdserve.cluster.wire import Abort, Generate, KvFailed, Prefill, Ready, Reserve
from pdserve.core.block_hash import hash_blocks
from pdserve.core.service_tiers import ServiceTiers

__all__ = ["Backlog", "ConductorCore", "Count", "Fail", "FlightState", "Observe", "Send"]


class ConductorCore(StagingEvents, RecoveryEvents, MembershipEvents):
    def __init__(self, mode: str, policy: RoutingPolicy, tiers: ServiceTiers | None = None,
                 admission: Admission | None = None, block_size: int = 16, idle_prewarm: bool = True,
                 max_queue: int | None = None, role_planner=None) -> None:
        self.mode, self.policy = mode, policy
        self.roles = role_planner  # --role-switching auto: a `pdserve.core.role_planner.RolePlanner`
        self.batch_room: dict[str, tuple[int, int]] = {}  # worker -> (max_num_seqs, KV pool tokens)
        self.switching: list[str] = []  # roles a moving worker's replacement will take (role switching)
        self.arriving: dict[str, str] = {}  # replacements started and loading -> their role (their move is on)
        self.tiers = tiers or ServiceTiers()
        self.admission = admission
        self.block_size = block_size
        self.workers: dict[str, WorkerLoad] = {}
        self.backlog: dict[str, Backlog] = {}
        self.flights: dict[str, FlightState] = {}
        self.consumption = ConsumptionPredictor(admission)
        self._xfers = itertools.count()
        self.stage = StagePlan(self.tiers)
        self.hot = HotPrefixes() if idle_prewarm and mode == "pd" else None
        self.orphans: list[FlightState] = []  # moved off a dead worker, waiting for one to be ready
        self.max_queue = max_queue  # most requests of one tier waiting for their first token (None: no bound)
        self.waiting: dict[str, int] = {}  # tier -> requests placed that have not streamed a token yet
        self._warms = itertools.count()

    # ---- workers ----------------------------------------------------------------------------------------
    def add_worker(self, name: str, role: str, load: WorkerLoad | None = None) -> WorkerLoad:
        self.workers[name] = load or WorkerLoad(name, role)
        self.backlog[name] = Backlog()
        return self.workers[name]

    def role(self, role: str) -> list[WorkerLoad]:
        return [w for w in self.workers.values() if w.role == role]

    def worker_ready(self, name: str, info: Ready, now: float | None = None) -> list:
        """Its `ready` event: at start, or once restarted after a death (it takes work again, from scratch); a
        replacement's completes its role move."""
        moved = self._move_done(self.arriving.pop(name), now) if name in self.arriving else []
        load = self.workers[name]
        if not load.alive:
            load.alive, load.stalled, load.outstanding = True, False, 0
            load.recent_blocks.clear()
            self.backlog[name] = Backlog()
        self.block_size = info.block_size
        self.batch_room[name] = (info.max_num_seqs, info.num_blocks * self.block_size)
        if info.kv_capacity_blocks:  # what it no longer holds need not be remembered
            load.max_recent_blocks = min(info.kv_capacity_blocks, MAX_RECENT_BLOCKS)
        self.stage.worker_ready(name, info)
        if self.admission is not None:
            self.admission.model(name).budget = info.max_num_batched_tokens
        return moved + (self._adopt_orphans() if self.orphans else [])

    def worker_steps(self, name: str, steps, prefill_cap: int | None = None) -> list:
        """Recent steps of a worker: [(prefill_tokens, prefill_sq, decode_seqs, decode_context, seconds)];
        `prefill_cap`: the prefill tokens its next step may carry (`pdserve.core.step_budget`), the chunk size
        admission predicts prefill in."""
        self.workers[name].stalled = False  # it reports again
        if self.admission is not None and steps:
            self.admission.observe_steps(name, steps)
        if self.admission is not None and prefill_cap:
            self.admission.model(name).budget = prefill_cap
        return []

    def worker_died(self, name: str, now: float = 0.0, reason: str = "worker_died", restarting: bool = False
                    ) -> list:
        """`restarting`: it is being started again (its requests may wait for it when no other can take them)."""
        return [Count("worker_deaths", (("worker", name),))] + self._worker_gone(name, now, reason, restarting)

    # ---- requests ---------------------------------------------------------------------------------------
    def arrive(self, rid: str, prompt: list, params: dict, now: float, *, tier: str = "default",
               priority: int = 0, pin: tuple | None = None, follow: tuple = ()) -> list:
        """`follow`: the workers another sequence of the same prompt runs on (n > 1): this one goes there too,
        where the prompt's KV is cached, while they can take it; admitted with that one (a request's sequences
        are admitted as one: no queue limit or SLO check refuses a sibling halfway)."""
        f = FlightState(rid, prompt, params, tier, now, priority, pin)
        if self.roles is not None:
            self.roles.arrived(now, len(prompt), params.get("max_tokens") or 0)
        hashes = HashRun(hash_blocks(prompt[:AFFINITY_BLOCKS * self.block_size], self.block_size))
        first, second = self._follow(follow) or self._route(hashes)
        if first is None:
            return [Count("admission_rejected", (("service_tier", tier), ("reason", "no_worker"))),
                    Fail(rid, 503, "no live worker can serve this request", "no_worker")]
        if not follow and self.max_queue is not None and self.waiting.get(tier, 0) >= self.max_queue:
            return [Count("admission_rejected", (("service_tier", tier), ("reason", "server_overloaded"))),
                    Fail(rid, 429, f"the {tier} tier's queue is full ({self.max_queue} requests waiting); "
                         "try again later", "server_overloaded", 1.0)]
        rejection = None if follow else self._admit(f, first, second, hashes, now)
        predicted = self.admission.last_ttft_s if self.admission is not None and not follow else None
        seen = [] if predicted is None else [Observe("predicted_ttft", (("service_tier", tier),), predicted)]
        if predicted is None and not follow and self._predicts(tier):  # admitted unpredicted: its worker has too few steps yet
            seen.append(Count("fallbacks", (("kind", "admission_unpredicted"),)))
        if rejection is not None:
            return seen + [Count("admission_rejected", (("service_tier", tier), ("reason", rejection.reason))),
                           Fail(rid, 429, rejection.message, rejection.code, rejection.retry_after_s)]
        actions = seen + self._place(f, first, second, hashes)
        if self.hot is not None and self.stage.any_room:  # (no worker could ever warm what it counts)
            self.hot.observe(hashes, prompt, self.block_size, now)
            for w in self.role("prefill"):
                actions += self._warm(w.name, now)
        return actions

    def _route(self, hashes) -> tuple[WorkerLoad | None, WorkerLoad | None]:
        """(the decode or colocated worker, the prefill worker in PD mode)."""
        first = self._pick("colocated" if self.mode == "colocated" else "decode", hashes)
        return first, self._pick("prefill", hashes) if self.mode == "pd" and first is not None else None

    def _follow(self, names: tuple) -> tuple[WorkerLoad, WorkerLoad | None] | None:
        loads = [self.workers.get(n) for n in names]
        if not loads or any(w is None or not w.usable for w in loads):
            return None
        return loads[0], loads[1] if len(loads) > 1 else None

    def _place(self, f: FlightState, first: WorkerLoad, second: WorkerLoad | None, hashes) -> list:
        """Start `f` on the workers chosen for it: generate (colocated), or reserve blocks on `first` for the
        prompt `second` will prefill (PD)."""
        self.flights[f.rid] = f
        self.waiting[f.tier] = self.waiting.get(f.tier, 0) + 1
        f.decode = first.name
        producer = second if second is not None else first
        prompt = f.resumed_prompt
        f.queued_tokens = max(len(prompt) - producer.prefix_blocks(hashes) * self.block_size, 1)  # not cached
        self.backlog[producer.name].tokens[self.tiers[f.tier].rank] += f.queued_tokens
        first.outstanding += 1
        first.remember(hashes)
        restore = {"restore": f.restore} if f.restore else {}
        if self.mode == "colocated":
            return [Send(first.name, Generate(**self._request_fields(f), **restore))]
        f.xfer = f"{f.rid}#{next(self._xfers)}"
        if second is not None:
            f.prefill = second.name
            second.outstanding += 1
            second.remember(hashes)
        return [Send(first.name, Reserve(**self._request_fields(f), xfer=f.xfer, **restore))]

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
                                    first.outstanding, now)

    def _predicts(self, tier: str) -> bool:
        return self.admission is not None and self.admission.predict and self.tiers[tier].ttft_ms is not None

    def _request_fields(self, f: FlightState) -> dict:
        params = f.params
        if f.offset:
            params = {**params, "max_tokens": params["max_tokens"] - f.offset}
            if params.get("grammar"):  # (its matcher takes the outputs it moved with first)
                params["grammar_replay"] = f.offset
        return {"rid": f.rid, "prompt": f.resumed_prompt, "params": params, "priority": f.priority, "pin": f.pin,
                "tier": f.tier}

    def _pick(self, role: str, hashes) -> WorkerLoad | None:
        return self.policy.pick(self.role(role), hashes)

    def abort(self, rid: str) -> list:
        """The client is gone (or a stop string ended it): stop it everywhere."""
        f = self.flights.get(rid)
        if f is None:
            self.orphans = [o for o in self.orphans if o.rid != rid]  # (it was waiting for a worker)
            return []
        workers = [w for w in (f.decode, f.prefill) if w is not None]  # before `_finish` lets the prefill go
        self._finish(f)
        return [Send(w, Abort(rid)) for w in workers]

    # ---- worker events ----------------------------------------------------------------------------------
    def reserved(self, rid: str, xfer: str, needs_prefill: bool, kv_addr: str, first_block: int,
                 now: float = 0.0) -> list:
        f = self.flights.get(rid)
        if f is None or f.xfer != xfer:
            return stale("reserved")
        if not needs_prefill:
            self._prefill_done(f)
            return []
        if f.prefill is None or not self.workers[f.prefill].alive:
            self._prefill_done(f)
            return [Count("fallbacks", (("kind", "no_prefill_worker"),)),
                    Send(f.decode, KvFailed(f.xfer))]
        f.kv_addr, f.first_block = kv_addr, first_block
        if self.workers[f.prefill].stalled:  # routed there before its lease lapsed: move it now
            return self._recover(f)
        deadline = self._predict_dispatch(f, first_block, now)
        return [Send(f.prefill, Prefill(**self._request_fields(f), dest=kv_addr, link=f.decode, xfer=f.xfer,
                                        first_block=first_block,
                                        deadline_in_s=None if deadline is None else deadline - now))]

    def _predict_dispatch(self, f: FlightState, first_block: int, now: float) -> float | None:
        """Ahead of it at the prefill worker: the prompts dispatched there before it and not yet prefilled
        (of its tier rank or better; the others may share its last step)."""
        rank = self.tiers[f.tier].rank
        tokens = self.backlog[f.prefill].dispatched
        ahead = sum(n for r, n in tokens.items() if r <= rank)
        behind = sum(tokens.values()) - ahead
        tokens[rank] += f.queued_tokens
        f.dispatched_s = now
        predicted = self.consumption.at_dispatch(now, f.prefill, f.decode, f.queued_tokens, ahead, behind)
        blocks = -(-len(f.resumed_prompt) // self.block_size) - first_block
        f.prediction = Prediction(blocks, predicted, predicted, tier=f.tier)
        return predicted

    def prefilled(self, rid: str, now: float, landing_in_s: float | None = None, failed: bool = False) -> list:
        """`landing_in_s`: the prefill worker's link's estimate of when the transfer's last chunk is out;
        `failed`: it gave up on the delivery (its sender will send nothing more: no lease is renewed for it)."""
        f = self.flights.get(rid)
        if f is None:
            return stale("prefilled")
        prefill = f.prefill or f.prefilled_by  # (reported again, a delivery given up later: who prefilled it)
        if not f.started:  # (a report that comes after the first token leaves the timeline the token set)
            f.prefilled_s, f.prefilled_by = now, prefill
        f.gave_up = failed
        self._prefill_done(f)
        if f.prediction is not None:
            self.consumption.at_prefilled(f.prediction, now, f.decode, landing_in_s)
        return self._stage_next(prefill, now)

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
        return [Observe(metric, (), at_s - predicted, p.blocks)
                for metric, predicted in (("kv_consumption_error", p.final_s),
                                          ("kv_consumption_error_at_prefilled", p.at_prefilled_s),
                                          ("kv_consumption_error_at_dispatch", p.at_dispatch_s))
                if predicted is not None]

    def transfer_outcome(self, rid: str, outcome: str, xfer: str = "", now: float = 0.0) -> list:
        """A transfer ended badly on the decode worker: `recompute` (it recomputes the prompt) or `held` (its
        lease lapsed; it holds the blocks for this core's choice, `_lease_lapsed`)."""
        f = self.flights.get(rid)
        if f is None or (xfer and f.xfer != xfer):
            return stale("transfer")  # ended (its abort frees the blocks), or moved to another transfer
        if outcome == "held":
            return self._lease_lapsed(f, xfer, now)
        if outcome != "recompute" or f.prefill is None:
            return []
        prefill = f.prefill
        self._prefill_done(f)  # its work is moot now: the decode worker recomputes
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
        if not f.started:  # the first token from where it runs now
            f.started = True
            self.waiting[f.tier] -= 1
            f.first_token_s = f.first_token_s or now
            if f.prefilled_s is not None and self.admission is not None:
                self.admission.observe_delivery(f.decode, now - f.prefilled_s)
            elif f.prefilled_s is None and f.prefill is not None and f.dispatched_s is not None:
                # its KV came before its prefill worker's report (separate processes): prefilled by now
                f.prefilled_s, f.prefilled_by = now, f.prefill
            self._prefill_done(f)
            self.backlog[f.decode].decoding += 1
        f.last_token_s = now
        if not finished:
            return []
        if self.roles is not None:
            self.roles.finished(f.params.get("max_tokens") or 0, f.num_tokens)
        self._finish(f)
        return [Count("slo_attained", (("service_tier", f.tier),))] if self._attained(f) else []

    def worker_error(self, rid: str) -> list:
        """A worker reported an error for this request: the caller ends its stream with it; abort the rest."""
        return self.abort(rid)

    # ---- helpers ----------------------------------------------------------------------------------------
    def _attained(self, f: FlightState) -> bool:
        tier = self.tiers[f.tier]
        ttft_ms = (f.first_token_s - f.arrival_s) * 1000.0
        tpot_ms = (f.last_token_s - f.first_token_s) * 1000.0 / max(f.num_tokens - 1, 1)
        return (tier.ttft_ms is None or ttft_ms <= tier.ttft_ms) and (tier.tpot_ms is None or tpot_ms <= tier.tpot_ms)

    def _prefill_done(self, f: FlightState) -> None:
        self.stage.done(f.prefill, f.rid)  # (its stage pass is moot, or folded into the prefill)
        if f.queued_tokens:
            producer = f.prefill or f.decode
            rank = self.tiers[f.tier].rank
            self.backlog[producer].tokens[rank] -= f.queued_tokens
            if f.dispatched_s is not None:
                self.backlog[producer].dispatched[rank] -= f.queued_tokens
            f.queued_tokens = 0
        if f.prefill is not None:
            self.workers[f.prefill].outstanding -= 1
            f.prefill = None

    def _finish(self, f: FlightState) -> None:
        if self.flights.pop(f.rid, None) is None:
            return
        self._prefill_done(f)
        if f.started:
            self.backlog[f.decode].decoding -= 1
        else:
            self.waiting[f.tier] -= 1
        self.workers[f.decode].outstanding -= 1

    def _fail(self, f: FlightState, status: int, message: str, code: str) -> list:
        self._finish(f)
        return [Fail(f.rid, status, message, code)]
