"""The engine loop: scheduler -> executor -> scheduler, plus detokenization and stop strings.

    step():
        scheduled = scheduler.schedule()
        result    = executor.execute(scheduled)
        finished  = scheduler.update(scheduled, result)
        -> detokenize new tokens, end requests that hit a stop string, report outputs
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.core.pd.sensitivity import DEFAULT as DEFAULT_LABEL
from pdserve.core.kvstore.block_manager import KVBlockManager
from pdserve.core.kvstore.kv_meta import LifecycleConfig, Stage, make_eviction_policy
from pdserve.core.kvstore.kv_placement import KVLifecycle
from pdserve.core.kvstore.kv_tiers import TieredKV, build_tiered_kv
from pdserve.core.request import Request, RequestStatus
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.sched.schedule import SchedulerConfig, SchedulerOutput
from pdserve.core.sched.scheduler import Scheduler
from pdserve.core.settings import KvTierSettings, default_of
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.executor import Executor
from pdserve.errors import InvalidRequestError
from pdserve.tokenizer import Tokenizer


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # stable text so far: never shows a possible start of a stop string until final
    text_delta: str = ""  # what `text` gained since this request's previous output (for streaming)
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    arrival_s: float = 0.0
    first_token_s: float | None = None
    finished_s: float | None = None
    scheduled_s: float | None = None
    prefilled_s: float | None = None
    # when asked for (`SamplingParams.logprobs` / `prompt_logprobs`), entries as `pdserve.model.logprobs`
    # makes them: one per token of `token_ids`, and one per prompt token (the first: None)
    logprobs: list | None = None
    prompt_logprobs: list | None = None


class LLMEngine:
    def __init__(self, executor: Executor, scheduler_config: SchedulerConfig, num_kv_blocks: int,
                 tokenizer: Tokenizer | None = None, enable_prefix_caching: bool = True,
                 eos_token_ids: tuple[int, ...] = (),
                 kv_eviction_policy: str = default_of(KvTierSettings, "kv_eviction_policy"),
                 clock: Callable[[], float] = time.monotonic,
                 kv_placement: str = default_of(KvTierSettings, "kv_placement"),
                 kv_max_age_s: float = default_of(KvTierSettings, "kv_max_age_s"), kv_format: str = "float32") -> None:
        """`kv_format`: the KV pool's codec as its blocks record it (`auto` resolved to the model dtype)."""
        self.executor = executor
        self.tokenizer = tokenizer
        lifecycle = LifecycleConfig()
        eviction = make_eviction_policy(kv_eviction_policy, lifecycle, kv_placement)
        self.block_manager = KVBlockManager(num_kv_blocks, executor.block_size, enable_prefix_caching,
                                            eviction=eviction, lifecycle=lifecycle, clock=clock, codec=kv_format)
        self.scheduler = Scheduler(scheduler_config, self.block_manager)
        # Host and disk tiers, when the executor has them (`kv_io` moves their bytes)
        self.kv_io = getattr(executor, "kv_io", None)
        self.tiers: TieredKV | None = None
        if self.kv_io is not None and enable_prefix_caching:
            self.tiers = build_tiered_kv(self.block_manager, self.kv_io.capacity, eviction, lifecycle,
                                         self.kv_io.restored(), wall_now=time.time(), max_age_s=kv_max_age_s)
            self.scheduler.tiers = self.tiers
        # the blocks' metadata set from what this worker sees, and the placement that reads it
        self.kv_lifecycle = self.scheduler.lifecycle = KVLifecycle(self.block_manager, self.tiers, kv_placement)
        self.eos_token_ids = eos_token_ids
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.last_scheduled: SchedulerOutput | None = None
        if hasattr(executor, "outputs_of"):  # (constrained decoding replays a request's tokens so far)
            executor.outputs_of = self._outputs_of

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    priority: int = 0, prefill_only: bool = False, pin: tuple[str, float] | None = None,
                    service_tier: str = "default") -> str:
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        token_ids = self._prompt_ids(prompt)
        req = self.make_request(request_id, token_ids, params, priority, prefill_only, pin, service_tier)
        self.scheduler.add_request(req)
        if self.tokenizer is not None:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop,
                                                             params.include_stop_str_in_output)
        return request_id

    def make_request(self, request_id: str, token_ids: list[int], params: SamplingParams, priority: int = 0,
                     prefill_only: bool = False, pin: tuple[str, float] | None = None,
                     service_tier: str = "default", sensitivity: str = DEFAULT_LABEL) -> Request:
        vocab = self.executor.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        return Request(request_id, token_ids, params, eos_token_ids=self.eos_token_ids,
                       arrival_s=time.monotonic(), priority=priority, prefill_only=prefill_only, pin=pin,
                       service_tier=service_tier, sensitivity=sensitivity)

    def abort(self, request_ids: list[str]) -> None:
        for req in self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED):
            self._detok.pop(req.request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that got a new token or finished."""
        start = time.perf_counter()
        self.poll_kv()
        scheduled = self.last_scheduled = self.scheduler.schedule()
        if self.tiers is not None and self.tiers.has_new_ops:  # a lookup's reads (disk, the shared pool) start
            self.kv_io.submit(self.tiers.take_ops())  # now, not after the forward: its request waits for them
        result = self.executor.execute(scheduled)
        finished = {r.request_id: r for r in self.scheduler.update(scheduled, result)}
        if self.tiers is not None:
            self.kv_io.submit(self.tiers.after_step())
        outputs = []
        for chunk in scheduled.chunks:
            req = finished.get(chunk.request_id) or self.scheduler.requests.get(chunk.request_id)
            if req is not None and chunk.sample:
                outputs.append(self._output(req, result.sampled_token_ids[req.request_id]))
            elif req is not None and req.is_finished:  # ended without sampling (a prefill-only request)
                outputs.append(self._output(req, None))
        if scheduled.chunks:  # the whole step, as a decoding request waits for it (simulated: its model's)
            self.scheduler.observe_step(scheduled, time.perf_counter() - start if result.step_s is None
                                        else result.step_s)
        return outputs

    def poll_kv(self) -> None:
        """Take in the tier operations the I/O runner finished, and let expired prewarm pins go (also called
        by an idle worker loop)."""
        now = self.block_manager.clock()
        self.block_manager.expire_pins(now)
        if self.kv_lifecycle.next_due_s() <= now:
            self.kv_lifecycle.run_due(now)
        if self.tiers is not None:
            for op_id, failures in self.kv_io.poll():
                self.tiers.complete(op_id, failures)
            self.kv_io.submit(self.tiers.take_ops())

    def kv_report(self) -> dict:
        """Blocks per tier and lifecycle stage, capacities, prefix-hit tokens per tier, bytes moved per tier
        and direction, corrupt blocks dropped: what a worker's stats carry to the metrics."""
        blocks, hits = self.block_manager, self.scheduler.stats.num_prefix_hit_tokens
        placement = self.kv_lifecycle.report()
        if self.tiers is None:
            counts = blocks.stage_counts(blocks.clock())
            stages = {"device": {s.value: counts.get(s, 0) for s in Stage}}  # zeros too: gauges must drop
            return {"stages": stages, "capacity": {"device": blocks.num_blocks}, "hits": {"device": hits},
                    "bytes_in": {}, "bytes_out": {}, "corrupt": {}, "disk_full": 0, "placement": placement,
                    "unservable": {}, "disk_key_mismatch": 0, "secret_off_disk": 0}
        st = self.tiers.stats
        lower = {t.value: n for t, n in st.hit_tokens.items()}
        if self.tiers.remote is not None:
            lower.setdefault("remote", 0)  # (its series from the start)
        as_dict = lambda c: {t.value: n for t, n in c.items()}  # noqa: E731
        return {"stages": self.tiers.stage_counts(), "capacity": self.tiers.capacities(),
                "hits": {"device": hits - sum(lower.values()), **lower}, "bytes_in": as_dict(st.bytes_in),
                "bytes_out": as_dict(st.bytes_out), "corrupt": as_dict(st.corrupt), "disk_full": st.disk_full,
                "placement": placement, "unservable": dict(st.unservable),
                "disk_key_mismatch": int(getattr(getattr(self.kv_io, "disk", None), "key_mismatch", False)),
                "secret_off_disk": st.secret_off_disk, "secret_off_remote": st.secret_off_remote,
                "remote_skipped": st.remote_skipped,
                **self._remote_report()}

    def _remote_report(self) -> dict:
        remote = self.tiers.remote
        return {"remote_down": remote.downs if remote is not None else 0,
                "remote_slow": remote.slow_probes if remote is not None else 0}

    def _outputs_of(self, request_id: str) -> list[int]:
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return []
        replay = req.sampling_params.grammar_replay  # (outputs it moved here with, now the prompt's tail)
        moved = req.prompt_token_ids[len(req.prompt_token_ids) - replay:] if replay else []
        return list(moved) + list(req.output_token_ids)

    def _output(self, req: Request, new_token: int | None) -> RequestOutput:
        detok = self._detok.get(req.request_id)
        if detok is not None and new_token is not None and detok.push([new_token]) and not req.is_finished:
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
        delta = detok.take_new_text(final=req.is_finished) if detok else ""
        text = detok.emitted_text if detok else ""
        if req.is_finished:
            self._detok.pop(req.request_id, None)
        return RequestOutput(
            req.request_id, req.prompt_token_ids, req.output_token_ids, text, delta, req.is_finished,
            req.status.finish_reason, req.num_cached_prompt_tokens, req.arrival_s, req.first_token_s,
            req.finished_s, req.scheduled_s, req.prefilled_s,
            req.logprobs if req.sampling_params.logprobs is not None else None,
            req.prompt_logprobs if req.sampling_params.prompt_logprobs is not None else None)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer; pass prompt token ids", param="prompt")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
        return list(prompt)
