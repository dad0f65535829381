"""The seams around one engine step: what the scheduler asks for and what the executor answers, and the
scheduler's counters."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.core.kvstore.block_manager import BlockId
from pdserve.core.kvstore.kv_ops import KVLoad
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.sched.policy import QUEUE_POLICIES
from pdserve.core.sched.tier_weights import check_tier_weights
from pdserve.errors import InvalidRequestError, UnknownNameError


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    """Most requests in the running batch at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: decode tokens plus prefill chunks (chunked prefill splits longer prompts)."""
    max_model_len: int = 8192
    """Longest sequence (prompt + output) a request may reach."""
    queue_policy: str = "tiered"
    """Order of the waiting queue and of preemption: tiered (by service tier; FCFS within one) | fcfs |
    priority (the request's integer priority, lowest first)."""
    service_tiers: tuple[str, ...] = ()
    """`--service-tier` specs (`pdserve.core.service_tiers`): SLOs, the guaranteed share, weights."""
    tier_weights: str = "dynamic"
    """The elastic tiers' weights: dynamic (scaled each step by SLO slack, queue age, transfer progress and
    decode load: `pdserve.core.sched.tier_weights`) or static (as configured)."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}", param=name)
        check_tier_weights(self.tier_weights)
        if self.queue_policy not in QUEUE_POLICIES:
            raise UnknownNameError(f"unknown queue policy {self.queue_policy!r}; choose from {sorted(QUEUE_POLICIES)}",
                                   param="queue_policy")


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step: compute `token_ids` at positions `start_pos`, `start_pos + 1`, ..."""

    request_id: str
    token_ids: Sequence[int]  # a slice of the request's tokens (list, or the simulator's array)
    start_pos: int  # == the request's computed tokens before this step
    block_ids: tuple[BlockId, ...]  # the whole block table, covering start_pos + len(token_ids) tokens
    sample: bool  # True when the chunk reaches the last known token, so a new token is sampled
    sampling_params: SamplingParams
    # Long contexts: host slots holding the first len(cold_slots) blocks; `block_ids` then starts at that
    # logical block (position p is in block_ids[p // block_size - len(cold_slots)])
    cold_slots: tuple[int, ...] = ()
    # prompt logprobs: the prompt tokens this chunk's rows predict (positions start_pos + 1 on, within the
    # prompt); empty when they are not asked for
    prompt_targets: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    finished_request_ids: tuple[str, ...] = ()  # ended since the last step; executors drop their state
    preempted_request_ids: tuple[str, ...] = ()  # preempted during this schedule() call
    kv_loads: tuple[KVLoad, ...] = ()  # host tier -> device blocks, done before this step's forward
    # host tier -> the blocks of reservations whose KV is still on its way: nothing in this step reads them
    # (a GPU's copy engine overlaps them with the forward; the simulator models it so)
    kv_loads_ahead: tuple[KVLoad, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class ExecutorOutput:
    """What one step produced: the sampled token of every chunk that had `sample=True`."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    step_s: float | None = None  # the step's modelled duration (the simulator); None: the engine measures it
    # asked-for logprobs (`pdserve.model.logprobs`): per request, the sampled token's entry, and the entries
    # of the prompt tokens its chunk predicted (keyword-only: positional callers keep the order above)
    logprobs: dict[str, list] = field(default_factory=dict, kw_only=True)
    prompt_logprobs: dict[str, list] = field(default_factory=dict, kw_only=True)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    preemptions_by_tier: Counter = field(default_factory=Counter)  # service tier -> preemptions
    num_share_preemptions: int = 0  # of them, to take the guaranteed tier's share back
    prefill_yields_by_tier: Counter = field(default_factory=Counter)  # steps a running prefill let a
    # higher-ranked waiting request go first (`Scheduler.schedule`), by the yielding request's tier
    num_prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission only)
    num_prefix_hit_tokens: int = 0
    num_prompt_tokens_computed: int = 0  # prompt tokens run through the model here (recomputations too)
    num_pinned_blocks: dict[str, int] = field(default_factory=dict)  # prewarm id -> blocks it pinned here
