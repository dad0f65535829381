"""The unit that flows through the engine: a request and its lifecycle.

Lifecycle:

    1. WAITING         in the waiting queue; holds no KV blocks.
    2. PREFILLING      scheduled; computed tokens < prompt tokens (chunked prefill may take several steps).
    3. WAITING_FOR_KV  decode worker only: blocks reserved, the prompt's KV is being delivered by a prefill
                       worker; not scheduled until the delivery completes (then PREFILLING for the last
                       prompt token, whose logits give the first output token) or fails (then WAITING, to
                       recompute here).
    4. DECODING        the prompt is computed; one new token per step.
    5. PREEMPTED       its blocks were taken back; it waits again and recomputes (prefix cache may help).
    6. FINISHED_*      STOPPED (EOS / stop token / stop string), LENGTH (max_tokens or context), ABORTED
                       (caller gave up), REJECTED (could never be served), PREFILLED (prefill worker only:
                       the KV of the prompt is computed and delivered; no token is sampled there).

Ownership: the scheduler moves `status` and `num_computed_tokens`; the block manager never writes here.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from pdserve.core.pd.sensitivity import DEFAULT as DEFAULT_LABEL
from pdserve.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    WAITING_FOR_KV = "waiting_for_kv"
    DECODING = "decoding"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_REJECTED = "finished_rejected"
    FINISHED_PREFILLED = "finished_prefilled"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED_")

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason, or None while the request lives."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_REJECTED: "rejected",
    RequestStatus.FINISHED_PREFILLED: "prefilled",
}

_arrival_counter = itertools.count()
STAGE = "@stage"  # the request id suffix of a prefill worker's stage pass (`pdserve.engine.pd`, "Staging")


@dataclass(eq=False)  # identity semantics: two requests are never 'equal'
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_s: float = 0.0  # on the engine's clock: its caller stamps it (core reads no clock)
    priority: int = 0
    service_tier: str = "default"  # priority | default | flex (`pdserve.core.service_tiers`)
    sensitivity: str = DEFAULT_LABEL  # its KV's label: public | internal | secret (`pdserve.core.pd.sensitivity`)
    prefill_only: bool = False  # prefill worker: compute the prompt's KV, sample the first token, stop
    pin: tuple[str, float] | None = None  # prewarm (id, ttl_s): keep the prompt's full blocks on the device
    # long contexts: hashes of the leading blocks whose KV lives in the host tier only (read from there)
    cold_hashes: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at first scheduling, for metrics
    num_preemptions: int = 0
    scheduled_s: float | None = None  # first admission to the running batch
    prefilled_s: float | None = None  # when every prompt token had been computed (first time)
    first_token_s: float | None = None
    finished_s: float | None = None
    # Tie-breaker for equal arrival times, so queue order is total and deterministic.
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))
    logprobs: list = field(default_factory=list)  # per output token, when asked for (`pdserve.model.logprobs`)
    prompt_logprobs: list = field(default_factory=list)  # per prompt token (the first: None), when asked for
    # Prompt followed by outputs; appended to in place so the hot path never concatenates.
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished
