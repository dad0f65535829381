"""Turns prompts into token streams through the conductor: tokenize, check, submit, detokenize, measure.

`Gateway.generate` is an async generator of `Delta`s for one prompt. It detokenizes incrementally (the
workers speak token ids), ends a request on a stop string, and aborts the request in the workers when the
consumer stops early (a client that disconnects, a stop string), so their blocks are freed at once.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.core.pd.sensitivity import DEFAULT as DEFAULT_LABEL
from pdserve.server.conductor_driver import Conductor, Flight
from pdserve.core.sampling_params import SamplingDefaults, SamplingParams
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.errors import ContextLengthExceededError, InvalidRequestError, NotFoundError, PdserveError, check_ttl
from pdserve.server.metrics import Metrics
from pdserve.server.structured import Grammars
from pdserve.tokenizer import Tokenizer


class WorkerError(PdserveError):
    """A worker reported an error, or died, while serving the request."""

    def __init__(self, event: dict) -> None:
        super().__init__(event.get("message", "worker error"), param=event.get("param"), code=event.get("code"))
        self.status_code = event.get("status", 500)
        self.error_type = event.get("etype", "server_error")
        self.retry_after_s = event.get("retry_after_s")  # a refusal on arrival (429): when to try again


@dataclass
class Pin:
    pin_id: str
    ttl_s: float
    blocks: int
    workers: list[str] = field(default_factory=list)
    expires_s: float = 0.0


@dataclass
class Delta:
    text: str
    num_tokens: int  # output tokens so far
    finished: bool
    finish_reason: str | None
    cached_tokens: int
    token_id: int | None = None  # the token this delta is for
    logprob: list | None = None  # its logprobs entry, when asked for (`pdserve.model.logprobs`)
    prompt_logprobs: list | None = None  # with the first delta, when asked for: one entry per prompt token
    kv_transfer: dict | None = None  # how its prompt KV reached its decode worker (`pdserve.core.pd.kv_arrival`)


class Gateway:
    def __init__(self, tokenizer: Tokenizer, conductor: Conductor, metrics: Metrics, model_name: str,
                 max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.conductor = conductor
        self.metrics = metrics
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.pins: dict[str, Pin] = {}  # live prewarms
        self.auto_tier: str | None = None  # the API key's default service tier (`--api-key-tier`)
        self.kv_sensitivity = DEFAULT_LABEL  # the deployment's KV label (`--kv-sensitivity`)
        self.sampling_defaults = SamplingDefaults()  # a request's unset sampling fields (`--generation-config`)
        self.supervisor = None  # the workers' states, for /health (`pdserve.server.supervisor`)
        self.cluster = None  # --cluster ray: where workers are placed, added and removed (`RayWorkers`)
        self.grammars = Grammars(tokenizer)  # structured output (`pdserve.server.structured`)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            if any(not 0 <= t < self.tokenizer.vocab_size for t in ids):
                raise InvalidRequestError(f"token ids must be in [0, {self.tokenizer.vocab_size})", param="prompt")
        else:
            raise InvalidRequestError("each prompt must be a string or a list of token ids", param="prompt")
        if not ids:
            raise InvalidRequestError("prompt must contain at least one token", param="prompt")
        return ids

    def max_tokens_for(self, prompt_ids: list[int], requested: int | None) -> int:
        """Check the context limit like vLLM: prompt + max_tokens must fit; default: all that is left."""
        room = self.max_model_len - len(prompt_ids)
        if room <= 0 or (requested is not None and requested > 0 and requested > room):
            asked = "" if requested is None else f" plus {requested} output tokens"
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(prompt_ids)} prompt tokens{asked}. Please reduce the length of the prompt or "
                f"max_tokens.", param="messages" if requested is None else "max_tokens")
        return room if requested is None else requested

    async def prewarm(self, prompt_ids: list[int], ttl_s) -> dict:
        """Compute the prompt's KV on the workers a request with it would be routed to and pin its full
        blocks there for `ttl_s` seconds: {"id", "tokens", "blocks", "workers"}."""
        ttl_s = check_ttl(ttl_s)
        now = time.monotonic()
        self.pins = {k: p for k, p in self.pins.items() if p.expires_s > now}
        blocks = len(prompt_ids) // self.conductor.block_size
        room = min((w.info.get("num_blocks", 0) for w in self.conductor.role(
            "colocated" if self.conductor.mode == "colocated" else "decode")), default=0) // 2
        pinned = sum(p.blocks for p in self.pins.values())
        if pinned + blocks > room:
            raise InvalidRequestError(f"prewarm would pin {blocks} KV blocks with {pinned} pinned already; at "
                                      f"most {room} (half a worker's device pool) may be pinned", param="prompt",
                                      code="prewarm_capacity")
        pin = Pin(uuid.uuid4().hex, ttl_s, blocks)
        async for _ in self.generate(prompt_ids, SamplingParams(max_tokens=1, temperature=0.0), pin=pin):
            pass
        self.pins[pin.pin_id] = pin
        return {"id": pin.pin_id, "tokens": len(prompt_ids), "blocks": blocks, "workers": pin.workers}

    async def unpin(self, pin_id: str) -> dict:
        pin = self.pins.pop(pin_id, None)
        if pin is None or pin.expires_s <= time.monotonic():
            raise NotFoundError(f"no live prewarm with id {pin_id!r}", param="id", code="prewarm_not_found")
        await self.conductor.unpin(pin_id, pin.workers)
        return {"id": pin_id, "object": "kv.prewarm", "deleted": True}

    async def start(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0, pin: Pin | None = None,
                    tier: str = "default", trace: dict | None = None, follow: list[str] | None = None,
                    sensitivity: str = DEFAULT_LABEL) -> Flight:
        """Submit a request (`follow`: on these workers, while they can take it); raises `WorkerError` at once
        if the conductor refused it on arrival (no worker, a full queue, a predicted SLO miss: 429 with
        `retry_after_s`), before any response has started."""
        flight = await self.conductor.submit(uuid.uuid4().hex, prompt_ids, params, priority,
                                             None if pin is None else (pin.pin_id, pin.ttl_s), tier, trace,
                                             follow, sensitivity)
        if flight.rid not in self.conductor.flights:  # refused on arrival: its stream holds just the error
            self.metrics.prompt_tokens.inc(len(prompt_ids))
            raise WorkerError(flight.events.get_nowait())
        if pin is not None:
            pin.workers = flight.workers
            pin.expires_s = time.monotonic() + pin.ttl_s
        return flight

    async def generate(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
                       pin: Pin | None = None, tier: str = "default", trace: dict | None = None,
                       follow: list[str] | None = None) -> AsyncIterator[Delta]:
        flight = await self.start(prompt_ids, params, priority, pin, tier, trace, follow)
        async for delta in self.stream(flight, prompt_ids, params):
            yield delta

    async def stream(self, flight: Flight, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Delta]:
        """The deltas of a started request; it is aborted in the workers if the consumer stops early."""
        rid, tier, arrival = flight.rid, flight.tier, flight.arrival_s
        detok = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output)
        count, last, finished, cached, kv = 0, arrival, False, 0, None
        token_times: list[float] = []  # when each token reached the gateway (inter-token jitter)
        try:
            while not finished:
                item = await flight.events.get()
                if item.get("type") == "error":
                    raise WorkerError(item)
                if item["i"] != count:
                    continue  # a duplicate (never ahead: a worker's stream is ordered)
                now = time.monotonic()
                (self.metrics.ttft if count == 0 else self.metrics.itl).labels(service_tier=tier).observe(now - last)
                if count == 0:
                    self.metrics.observe_first_token(item, "decode" if self.conductor.mode == "pd" else "colocated")
                count, last, cached = count + 1, now, item.get("cached", cached)
                if "kv" in item:  # (a moved request: the worker that took it reports again)
                    kv = item["kv"]
                    self.metrics.observe_kv_arrival(kv)
                token_times.append(now)
                self.metrics.observe_tokens(tier, len(prompt_ids) - cached if count == 1 else 0, 1)
                stopped = detok.push([item["t"]])
                finished = stopped or bool(item["fin"])
                reason = "stop" if stopped else item["fin"]
                yield Delta(detok.take_new_text(final=finished), count, finished, reason, cached, item["t"],
                            item.get("lp"), item.get("plp") if count == 1 else None, kv)
            self.metrics.e2e.observe(time.monotonic() - arrival)
            self.metrics.observe_stream(tier, token_times)
            self.metrics.requests.labels(finish_reason=reason, service_tier=tier).inc()
        finally:
            self.metrics.prompt_tokens.inc(len(prompt_ids))
            self.metrics.generation_tokens.inc(count)
            if rid in self.conductor.flights:  # ended early here: stop string, client gone, error
                if not finished:
                    self.metrics.requests.labels(finish_reason="abort", service_tier=tier).inc()
                await self.conductor.abort(rid)
