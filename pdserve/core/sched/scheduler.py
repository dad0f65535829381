"""Token-budget scheduler: continuous batching, chunked prefill, prefix reuse, preemption by recompute.

Each step assigns tokens to requests so that computed tokens catch up with known tokens. Running requests
go first (a decode token each, or the next prefill chunk), in policy order; then waiting requests are
admitted while the token budget, the batch size and the block pool allow. When a running request cannot
grow, the lowest-priority running request is preempted: its blocks are freed (they stay in the prefix cache
until reused) and it waits to recompute prompt + outputs.

A running prefill ranked after a waiting request that can start now (a priority arrival while flex prompts
are mid-prefill) yields: the arrival takes the step's budget first, the paused prefill keeps its blocks and
gets what is left (`_run`). A prefill worker's chunks are also paced by delivery, per link
(`pdserve.core.pd.production_pace`).

Prefill/decode disaggregation uses the same class on both sides. A prefill worker's requests are
`prefill_only`: they end as FINISHED_PREFILLED once their prompt's KV is computed and the first token
sampled (no stop checks there). A decode worker reserves blocks for KV another worker delivers (`reserve_kv`,
`kv_delivered`, `kv_failed`): the scheduler does the request's queue side, its part
`pdserve.core.sched.kv_reservations.KVReservations` the blocks, the host loads and which requests wait for KV.
"""

from __future__ import annotations

import bisect

from pdserve.core.kvstore.block_manager import KVBlockManager, PrefixHit
from pdserve.core.sched.hot_window import HotWindow
from pdserve.core.sched.kv_reservations import LOOKING, KVReservations
from pdserve.core.kvstore.kv_placement import KVLifecycle
from pdserve.core.kvstore.kv_tiers import KVLoad, TierHit, TieredKV
from pdserve.core.pd.production_pace import ProductionPace
from pdserve.core.sched.policy import QueuePolicy, TieredPolicy, make_queue_policy
from pdserve.core.sched.tier_weights import TierWeights
from pdserve.core.request import Request, RequestStatus
from pdserve.core.sched.schedule import ExecutorOutput, ScheduledChunk, SchedulerConfig, SchedulerOutput, SchedulerStats
from pdserve.core.service_tiers import ServiceTiers
from pdserve.core.sched.step_budget import StepBudget
from pdserve.core.sched.tier_share import ReservedShare
from pdserve.core.sched.waiting_queue import WaitingQueue
from pdserve.errors import ContextLengthExceededError, InvalidRequestError


_NO_TIER_HIT = TierHit()
_PINNABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_PREFILLED)


def leaves_no_room(num_prompt_tokens: int, max_model_len: int) -> bool:
    """A prompt this long leaves no room for output in a context of `max_model_len` tokens: it is refused
    (`Scheduler.check_new`; the simulator's feasibility bound, `pdserve.sim.feasibility`, counts it so)."""
    return num_prompt_tokens >= max_model_len


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: KVBlockManager,
                 policy: QueuePolicy | None = None) -> None:
        self.config = config
        self.blocks = block_manager
        tiers = ServiceTiers.from_specs(config.service_tiers)
        self.policy = policy or make_queue_policy(config.queue_policy, tiers)
        self.weights: TierWeights | None = None  # the elastic tiers' dynamic weights (a tiered policy only)
        if isinstance(self.policy, TieredPolicy):
            self.weights = TierWeights(tiers, config.tier_weights)
            self.policy.factors = self.weights.factors
        self.share = ReservedShare(tiers.reserved_share, config.max_num_seqs, block_manager.num_blocks)
        self.step_budget = StepBudget(tiers, config.max_num_batched_tokens, block_manager.block_size)
        self._taken_back: list[str] = []  # preempted outside a step (for a reservation): reported by the next
        # A request alone must always fit in the pool, or preemption could never make progress.
        self.max_model_len = min(config.max_model_len, block_manager.num_blocks * block_manager.block_size)
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []  # kept sorted by policy key: the last one is preempted first
        self.waiting = WaitingQueue(self.policy)
        self._finished_ids: list[str] = []
        self.reservations = KVReservations(block_manager)  # requests waiting for delivered KV
        self._tiers: TieredKV | None = None  # (see `tiers`)
        self._step_loads: list[KVLoad] = []
        # reservations' host hits loaded per step ahead of their KV (`KVReservations.step_loads`; the simulator
        # sets it to what a decode step's forward hides)
        self.ahead_load_blocks: int | None = None
        self.window: HotWindow | None = None  # long contexts (see `enable_long_context`)
        self.pace: ProductionPace | None = None  # a prefill worker's per-link pacing, set before each step
        self.lifecycle: KVLifecycle | None = None  # the blocks' metadata and placement (set by the engine)
        self.stats = SchedulerStats()

    # ---- intake ----------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.check_new(request)
        self.requests[request.request_id] = request
        self.waiting.push(request)
        self._arrived(request)

    def _arrived(self, request: Request) -> None:
        """Its prompt's prefix may continue an earlier turn here (`KVLifecycle.arrived`: a think time)."""
        if self.lifecycle is not None:
            prefix = self.blocks.find_prefix(request.all_token_ids, request.request_id)  # (memoized)
            self.lifecycle.arrived(request.request_id, prefix.block_hashes, self.blocks.clock())

    def check_new(self, request: Request) -> None:
        """Raise for a request that could never be served here (duplicate id, empty, over the context)."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request.request_id!r}")
        if not request.prompt_token_ids:
            raise InvalidRequestError("prompt must contain at least one token", param="prompt")
        if leaves_no_room(request.num_prompt_tokens, self.max_model_len):
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{request.num_prompt_tokens} tokens, which leaves no room for output.", param="prompt")

    def enable_long_context(self, hot_window_tokens: int) -> None:
        """Let a request's context outgrow the device pool: it keeps at most `hot_window_tokens` (rounded to
        blocks, at least 2, at most half the pool) on the device; its older blocks are read from the host
        tier (`pdserve.core.sched.hot_window`). Needs `tiers`."""
        self.window = self.reservations.window = HotWindow(self.blocks, self._tiers, hot_window_tokens)
        self.max_model_len = self.window.max_model_len(self.config.max_model_len)

    @property
    def tiers(self) -> TieredKV | None:
        """Host and disk tiers below the block pool (set by the engine when it has them): a prefix hit goes on
        through them, and the host blocks it finds are loaded before the step that reads them."""
        return self._tiers

    @tiers.setter
    def tiers(self, tiers: TieredKV | None) -> None:
        self._tiers = self.reservations.tiers = tiers

    @property
    def has_pending_loads(self) -> bool:
        """Host tier hits of reservations, or promotions ahead of an expected use, wait for the next step."""
        return self.reservations.has_loads or (self.lifecycle is not None and self.lifecycle.has_loads)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting_for_kv(self) -> int:
        return len(self.reservations)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step --------------------------------------------------------------------------------------
    def _reweigh(self) -> None:
        """The elastic tiers' weights from this step's state (`pdserve.core.sched.tier_weights`): when they moved,
        the waiting queue and the running batch are ordered anew."""
        if self.weights is None or not self.weights.dynamic or not len(self.waiting):
            return
        decoding = sum(1 for r in self.running if r.status is RequestStatus.DECODING)
        pace = self.pace

        def held(rid: str) -> bool:
            return pace is not None and pace.link_of(rid) in pace.held
        if self.weights.update(self.blocks.clock(), self.waiting.requests(), decoding / self.config.max_num_seqs,
                               held):
            self.waiting.reorder()
            self.running.sort(key=self.policy.sort_key)

    def schedule(self) -> SchedulerOutput:
        self._reweigh()
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        taken, self._taken_back = self._taken_back, []
        head = self.waiting.peek()
        if head is not None:
            self._take_back(head, self.blocks.blocks_needed(min(head.num_tokens, budget)), taken)
        self.step_budget.begin(self.running)  # the decoding requests' TPOT SLOs cap this step's prefill
        outranked = self._outranked_key(head)
        yielded: list[Request] = []  # running prefills paused at this chunk boundary for `head`
        budget = self._run(self.running, budget, chunks, preempted, outranked, yielded)
        if not preempted:  # admitting new work in a step that had to preempt would only thrash
            budget = self._admit_waiting(budget, chunks, self.policy.sort_key(yielded[0]) if yielded else None)
        if yielded:  # they get what the waiting requests that outrank them left (work-conserving), no preempting
            budget = self._run(yielded, budget, chunks, None, None, [])
            if not preempted:
                self._admit_waiting(budget, chunks, None)
            for req in yielded:  # counted by tier: let a higher-ranked waiting request take the budget first
                self.stats.prefill_yields_by_tier[req.service_tier] += 1
        finished, self._finished_ids = tuple(self._finished_ids), []
        needed, ahead = self.reservations.step_loads(self.ahead_load_blocks)
        if self.lifecycle is not None and self.lifecycle.has_loads:  # promotions: in what reservations left
            left = None if self.ahead_load_blocks is None else self.ahead_load_blocks - len(ahead)
            if left is None or left > 0:
                ahead = ahead + self.lifecycle.take_loads(left)
        loads, self._step_loads = needed + self._step_loads, []
        return SchedulerOutput(tuple(chunks), finished, tuple(preempted + taken), tuple(loads), tuple(ahead))

    def _run(self, running: list[Request], budget: int, chunks: list[ScheduledChunk], preempted: list[str] | None,
             outranked: tuple | None, yielded: list[Request]) -> int:
        """Give `running` requests their decode token or next prefill chunk, in policy order, preempting the
        lowest-ranked for blocks (with `preempted` None: stopping instead); a prefill ranked after `outranked`
        (a waiting request that can start now) is put in `yielded` instead. Returns the budget left."""
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n > 1:  # a prefill chunk (or a recompute): within the step's prefill allowance
                if outranked is not None and self.policy.sort_key(req) > outranked:
                    yielded.append(req)
                    i += 1
                    continue  # the allowance goes first to the waiting request that outranks it
                n = self._grant(req, n, req.num_computed_tokens)
                if n == 0:
                    i += 1
                    continue
            if self.window is not None:
                n = self.window.chunk_limit(req, n)
                if not self.window.make_room(req, n):
                    i += 1
                    continue  # its oldest blocks are still being copied to host: it runs next step
            if preempted is None:
                if self.blocks.allocate(req.request_id, req.num_computed_tokens + n) is None:
                    break
            elif not self._grow_or_preempt(req, n, preempted):
                break  # `req` itself was the lowest priority and got preempted
            chunks.append(self._chunk(req, n))
            budget -= n
            i += 1
        return budget

    def update(self, scheduled: SchedulerOutput, result: ExecutorOutput) -> list[Request]:
        """Advance requests by what the step computed and sampled; return the requests that finished."""
        now = self.blocks.clock()
        finished: list[Request] = []
        if scheduled.kv_loads or scheduled.kv_loads_ahead:
            self._tiers.loads_done(scheduled.kv_loads + scheduled.kv_loads_ahead)
            if scheduled.kv_loads_ahead and self.lifecycle is not None:
                self.lifecycle.loads_done()
        for chunk in scheduled.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.is_finished or req.status is RequestStatus.PREEMPTED:
                continue  # aborted while the step ran
            req.num_computed_tokens += chunk.num_tokens
            self.stats.num_prompt_tokens_computed += max(
                min(chunk.start_pos + chunk.num_tokens, req.num_prompt_tokens) - chunk.start_pos, 0)
            self.blocks.cache_full_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens,
                                          decode=chunk.start_pos >= req.num_prompt_tokens, sla_class=req.service_tier,
                                          secret=req.sensitivity == "secret")
            if chunk.request_id in result.prompt_logprobs:  # (from the start again after a preemption)
                if chunk.start_pos == 0:
                    req.prompt_logprobs = [None]  # the first prompt token has no logprob
                req.prompt_logprobs.extend(result.prompt_logprobs[chunk.request_id])
            if req.num_computed_tokens >= req.num_prompt_tokens:
                req.status = RequestStatus.DECODING
                req.prefilled_s = req.prefilled_s or now
            if not chunk.sample:
                continue
            req.append_output_token(result.sampled_token_ids[req.request_id])
            if req.request_id in result.logprobs:
                req.logprobs.append(result.logprobs[req.request_id])
            if req.prefill_only:  # the first token goes with the KV; the decode worker checks stops
                self._finish(req, RequestStatus.FINISHED_PREFILLED)
                finished.append(req)
                continue
            if req.first_token_s is None:
                req.first_token_s = now
            status = self._stop_status(req)
            if status is not None:
                self._finish(req, status)
                finished.append(req)
        return finished

    def claim_stage(self, stage_id: str, arrival_s: float) -> bool:
        """The real prefill of a prompt staged here (`stage_id`: its stage pass) arrived at `arrival_s`. A pass
        not started yet is dropped (True: add the real prefill now, in its own place in the queue); one under
        way ranks from now on as arrived at `arrival_s` (False: the real prefill waits for it)."""
        req = self.requests.get(stage_id)
        if req is None:
            return True
        if req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.finish_requests([stage_id], RequestStatus.FINISHED_ABORTED)
            return True
        req.arrival_s = arrival_s
        self.running.sort(key=self.policy.sort_key)
        return False

    def observe_step(self, scheduled: SchedulerOutput, seconds: float) -> None:
        """The step `scheduled` took `seconds` (measured, or modelled by the simulator): the step budget
        learns from it (`pdserve.core.sched.step_budget`)."""
        self.step_budget.observe(scheduled, seconds)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (abort, stop string found by the detokenizer)."""
        ended = []
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is not None and not req.is_finished:
                self._finish(req, status)
                ended.append(req)
        return ended

    # ---- KV another worker delivers (`pdserve.core.sched.kv_reservations`) ----------------------------------
    def reserve_kv(self, request: Request) -> int | None:
        """Hold blocks for the whole prompt of a request whose KV will be delivered; None when no room now,
        `kv_reservations.LOOKING` while its prefix is being read from a lower tier (not for lack of room).
        Returns the number of prompt tokens already in this worker's prefix cache (whole blocks): the sender
        need not deliver those. Raises like `add_request` for a request that could never be served."""
        self.check_new(request)
        self._take_back(request, self.blocks.blocks_needed(request.num_prompt_tokens), self._taken_back)
        if len(self.running) + len(self.reservations) >= self.config.max_num_seqs:
            return None
        hit_tokens = self.reservations.reserve(request)
        if hit_tokens is not None and hit_tokens != LOOKING:
            self._arrived(request)
            self.requests[request.request_id] = request
            self.stats.num_prompt_tokens += request.num_prompt_tokens
            self.stats.num_prefix_hit_tokens += hit_tokens
        return hit_tokens

    def kv_delivered(self, request_id: str, first_token: int | None = None) -> Request:
        """The prompt's KV is in the reserved blocks. With `first_token` (sampled by the prefill worker) the
        request decodes from there, or ends if that token stops it (check `is_finished`); without one, only
        the prompt's uncached tail (the last token; after a restore, more) is computed here, giving the first token."""
        req = self.reservations.deliver(request_id, first_token)
        bisect.insort(self.running, req, key=self.policy.sort_key)
        status = self._stop_status(req) if first_token is not None else None
        if status is not None:
            self._finish(req, status)
        return req

    def expect_kv(self, request_id: str, at_s: float) -> None:
        """A reserved request's delivered KV is predicted to be first consumed at `at_s` (the conductor's
        consumption prediction, `pdserve.conductor.consumption`; the delivery's deadline): its blocks expect
        that use, and its host hits not loaded yet go before those of reservations expected later."""
        self.reservations.expect(request_id, at_s)

    def kv_failed(self, request_id: str) -> None:
        """Delivery failed: drop the reserved blocks (their content is not trusted) and recompute here."""
        req = self.reservations.fail(request_id)
        self._drop_cold(req)
        self.waiting.push(req)

    # ---- helpers ---------------------------------------------------------------------------------------
    def _take_back(self, head: Request, need_blocks: int, preempted: list[str]) -> None:
        """The guaranteed tier's lent share comes back for `head` (`pdserve.core.sched.tier_share`)."""
        for victim in self.share.victims(head, need_blocks, self.running, len(self.reservations),
                                         self.blocks.num_free_blocks, lambda r: len(self.blocks.block_ids(r.request_id))):
            self.running.remove(victim)
            self._preempt(victim)
            self.stats.num_share_preemptions += 1
            preempted.append(victim.request_id)

    def _outranked_key(self, head: Request | None) -> tuple | None:
        """When the waiting `head` could start now, its queue key: running prefills ranked after it yield
        their chunk to it (paused at this chunk boundary, keeping their blocks) and get what it leaves, so
        the step's prefill budget goes in queue order (a priority request arriving while flex prompts are
        mid-prefill starts at once instead of waiting for their whole prompts)."""
        if head is None or len(self.running) >= self.config.max_num_seqs:
            return None
        if self.blocks.blocks_needed(min(head.num_tokens, self.step_budget.last_cap)) > self.blocks.num_free_blocks:
            return None
        return self.policy.sort_key(head)

    def _grow_or_preempt(self, req: Request, n: int, preempted: list[str]) -> bool:
        while self.blocks.allocate(req.request_id, req.num_computed_tokens + n) is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _admit_waiting(self, budget: int, chunks: list[ScheduledChunk], stop: tuple | None) -> int:
        """Start waiting requests in queue order (those ranked before `stop`, when given) while the budget,
        the batch size and the blocks allow; returns the budget left."""
        parked: list[Request] = []
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            if req is None or (stop is not None and self.policy.sort_key(req) > stop):
                break
            prefix = self.blocks.find_prefix(req.all_token_ids, req.request_id)
            if req.sampling_params.prompt_logprobs is not None:  # every prompt token's logits are needed
                prefix, lower = PrefixHit((), prefix.block_hashes, prefix.block_size), _NO_TIER_HIT
            else:
                lower = self._tier_hit(prefix)
            if lower.waiting:
                break  # its prefix is being fetched from disk: it goes first once that is in host
            if self.window is not None:
                prefix, lower = self.window.cap_hits(prefix, lower)
            hit_tokens = prefix.num_tokens + len(lower.host) * self.blocks.block_size
            n = min(req.num_tokens - hit_tokens, budget)
            if self.window is not None:
                n = min(n, self.window.window * self.blocks.block_size - hit_tokens)
            if n > 1:
                n = self._grant(req, n, hit_tokens)
                if n == 0 and self.pace is not None and self.pace.blocked(req.request_id):
                    parked.append(self.waiting.pop())  # its link is backed up: later prompts may start
                    continue
                if n == 0:
                    break  # this step's prefill allowance is spent
            ids = self.blocks.allocate(req.request_id, hit_tokens + n, prefix, req.service_tier)
            if ids is None:
                break  # head of line waits for blocks; later requests do not overtake it
            self.waiting.pop()
            if lower.host:
                self._step_loads += self._load(lower, prefix, ids, count=req.num_preemptions == 0)
            if req.num_preemptions == 0:
                self.stats.num_prompt_tokens += req.num_prompt_tokens
                self.stats.num_prefix_hit_tokens += hit_tokens
                req.num_cached_prompt_tokens = hit_tokens
            req.num_computed_tokens = hit_tokens
            req.status = RequestStatus.PREFILLING
            req.scheduled_s = req.scheduled_s or self.blocks.clock()
            bisect.insort(self.running, req, key=self.policy.sort_key)
            chunks.append(self._chunk(req, n))
            budget -= n
        for req in parked:
            self.waiting.push(req)
        return budget

    def _grant(self, req: Request, n: int, start_pos: int) -> int:
        """Tokens for a prefill chunk: what its link's production pace allows, then the step's time budget."""
        if self.pace is not None:
            n = self.pace.cap(req.request_id, n)
        n = self.step_budget.take(n, start_pos) if n else 0
        if n and self.pace is not None:
            self.pace.spend(req.request_id, n)
        return n

    def _tier_hit(self, prefix: PrefixHit) -> TierHit:
        if self._tiers is None:
            return _NO_TIER_HIT
        return self._tiers.extend(prefix.block_hashes[len(prefix.block_ids):])

    def _load(self, lower: TierHit, prefix: PrefixHit, ids: list, count: bool) -> list[KVLoad]:
        """Loads of the host hits into the fresh blocks `allocate` appended right after the device hit."""
        first = len(prefix.block_ids)
        return self._tiers.load(lower.host, ids[first:first + len(lower.host)], count)

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        return ScheduledChunk(
            request_id=req.request_id, token_ids=req.all_token_ids[start:start + n], start_pos=start,  # (a copy)
            block_ids=self.blocks.block_ids(req.request_id),
            sample=start + n == req.num_tokens,
            sampling_params=req.sampling_params,
            cold_slots=self._tiers.cold_slots(req.cold_hashes) if req.cold_hashes else (),
            prompt_targets=tuple(req.prompt_token_ids[start + 1:start + n + 1])
            if req.sampling_params.prompt_logprobs is not None else ())

    def _drop_cold(self, req: Request) -> None:
        if req.cold_hashes:
            self._tiers.release_cold(req.cold_hashes)
            req.cold_hashes = []

    def _stop_status(self, req: Request) -> RequestStatus | None:
        token = req.all_token_ids[-1]
        params = req.sampling_params
        if (not params.ignore_eos and token in req.eos_token_ids) or token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _preempt(self, req: Request) -> None:
        self.reservations.drop_loads(req.request_id)  # (a delivered request's host hits not loaded yet)
        self.blocks.free(req.request_id)
        self._drop_cold(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.stats.num_preemptions += 1
        self.stats.preemptions_by_tier[req.service_tier] += 1
        self.waiting.push(req)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING_FOR_KV:
            self.reservations.cancel(req.request_id)
        elif not req.is_finished:
            self.waiting.ended()
        self.reservations.drop_loads(req.request_id)  # never loaded into blocks freed (and reused) meanwhile
        req.status = status
        req.finished_s = self.blocks.clock()
        if self.lifecycle is not None:  # its use of its blocks ended: when is its prefix expected back?
            if status in _PINNABLE:
                self.lifecycle.ended(req.request_id, self.blocks.registered_hashes(req.request_id),
                                     req.num_prompt_tokens // self.blocks.block_size, req.finished_s)
            else:
                self.lifecycle.forget(req.request_id)
        if req.pin is not None and status in _PINNABLE:
            pin_id, ttl_s = req.pin
            self.stats.num_pinned_blocks[pin_id] = self.blocks.pin(f"prewarm:{pin_id}", req.request_id,
                                                                   self.blocks.clock() + ttl_s)
        self.blocks.free(req.request_id)
        self._drop_cold(req)
        self.blocks.forget(req.request_id)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)
