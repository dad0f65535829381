"""Prediction-based admission: refuse at once a request whose service tier's SLO it would miss.

Per worker, an online fit of step time in the family the simulator's fitted time model uses (DistServe's:
prefill `a + b * tokens + c * tokens^2` per chunk, decode `a + b * context + c * batch`, a mixed step both
parts with one `a`: `pdserve.sim.timemodel.FittedTimeModel`), refreshed from the worker's live step times (real workers report
their recent steps in their `stats` events; the simulator reports every simulated step). From it:

    TTFT = what is left of the worker's current step, taken to hold up to a budget of its backlog (tokens of
           the request's tier rank or better first): its predicted time less how long it has run (the
           conductor's `Backlog.busy_s`: since the worker's backlog last went from empty to queued, or since its
           last prompt came out prefilled); half of it when that is not known
         + prefill of (what is left of the backlog ahead of this request + its own uncached tokens), in chunks
           of the worker's token budget, the last one topped up with what is left of the backlog behind it
           (lower tiers batched into the same step); each chunk also carries a colocated worker's decode batch
         + the delivery tail (prefill done -> first token at the gateway, a moving average of live ones; until
           the decode worker has delivered one, its first decode step with this request in its batch)
    TPOT = one decode step of the decode worker's batch with this request in it, stretched by the share of
           its recent time spent on prefill chunks (colocated interference), at most the step budget's
           0.85 x the tier's TPOT SLO (the worker caps prefill to keep it) unless the decode step alone is longer

"Backlog ahead" counts the prompt tokens routed to that worker and not yet prefilled, of the request's own
tier rank or better (priority goes before default and flex; `pdserve.core.service_tiers`). A request is
rejected (HTTP 429, code `slo_unattainable`, `Retry-After`) when a prediction exceeds its tier's SLO by more
than `margin` (a fraction; negative: comes closer to it than that). A tier without an SLO is never rejected by
prediction; every tier is rejected (`queue_full`) when its worker has `max_outstanding` requests already.
Until a worker has reported `online_fit.MIN_SAMPLES` steps, nothing is predicted (everything is admitted): a
worker reports the steps of its profile at load with its first stats (`pdserve.engine.calibration`), so that
is before its first request unless it runs with `--calibration off`. No whole step is predicted faster than the
fastest of its recent steps. Each admitted request's TTFT prediction is checked at its first token
(`pdserve_admission_prediction_error_seconds`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pdserve.core.sched.online_fit import OnlineFit
from pdserve.core.sched.schedule import SchedulerConfig
from pdserve.core.settings import AdmissionSettings, default_of
from pdserve.core.service_tiers import ServiceTier
from pdserve.core.sched.step_budget import HEADROOM

DELIVERY_EWMA = 0.2


@dataclass(frozen=True)
class Rejection:
    reason: str  # slo_ttft | slo_tpot | queue_full
    message: str
    retry_after_s: float
    code: str = "slo_unattainable"


@dataclass
class WorkerModel:
    """One least-squares fit over every step, pure and mixed: seconds ~ a + b * prefill tokens + c * sum of
    their squares + d * decode context + e * decode batch (a mixed step costs both parts and one `a`, as the
    fitted time model has it), so a colocated worker, whose steps are mostly mixed, is modelled too."""
    budget: int = default_of(SchedulerConfig, "max_num_batched_tokens")  # prefill tokens a step may carry
    max_budget: int = default_of(SchedulerConfig, "max_num_batched_tokens")  # the worker's (its `ready` says)
    fit: OnlineFit = field(default_factory=lambda: OnlineFit(5))
    mean_context: float = 0.0  # per decoding request, a moving average
    delivery_s: float | None = None

    def observe(self, prefill_tokens: int, prefill_sq: int, decode_seqs: int, decode_context: int,
                seconds: float) -> None:
        self.fit.add((1.0, prefill_tokens, prefill_sq, decode_context, decode_seqs), seconds)
        if decode_seqs:
            self.mean_context += 0.05 * (decode_context / decode_seqs - self.mean_context)

    def _prefill_chunk_s(self, n: int, prompt: int) -> float | None:
        """A step of `n` prompt tokens made of prompts of about `prompt` tokens (the quadratic term is per
        prompt: sum of squares ~ n * prompt)."""
        return self._step(self.fit.predict((1.0, n, n * min(n, prompt), 0.0, 0.0)))

    def _step(self, seconds: float | None) -> float | None:
        """A whole step's prediction, at least the fastest recent step."""
        return None if seconds is None else max(seconds, self.fit.fastest())

    def prefill_steps(self) -> int:
        """Recent steps that carried prefill tokens."""
        return sum(1 for row in self.fit.rows if row[1] > 0)

    def observed_prefill_rate(self) -> float | None:
        """Prompt tokens per second of the recent steps that carried prefill (at least 2), fit or no fit: what
        the role planner counts a prefill worker for before its fit has `MIN_SAMPLES` steps."""
        rows = [row for row in self.fit.rows if row[1] > 0]
        if len(rows) < 2:
            return None
        return sum(row[1] for row in rows) / max(sum(row[-1] for row in rows), 1e-9)

    def decode_s(self, batch: int) -> float | None:
        return self._step(self.fit.predict((1.0, 0.0, 0.0, batch * self.mean_context, batch))) if batch else 0.0

    def tpot_s(self, batch: int, slo_s: float | None = None) -> float | None:
        """Time per output token with `batch` decoding: a decode step, stretched by the share of the worker's
        recent time that went to prefill chunks in the same steps (a colocated worker's interference; about
        zero on a PD decode worker). For a request with a TPOT SLO of `slo_s`, the worker's step budget
        (`pdserve.core.sched.step_budget`) keeps the prefill in its steps within 0.85 x that: the stretch stops there."""
        step = self.decode_s(batch)
        if step is None or self.fit.coef is None:
            return step
        stretched = step / (1.0 - self.prefill_share())
        return stretched if slo_s is None else min(stretched, max(step, HEADROOM * slo_s))

    def prefill_share(self) -> float:
        """The fraction of the recent steps' time the fit puts on their prefill tokens (at most 0.9)."""
        data = np.asarray(self.fit.rows, dtype=float)
        prefill = data[:, 1:3] @ self.fit.coef[1:3]
        return float(min(prefill.sum() / max(data[:, -1].sum(), 1e-9), 0.9))

    @property
    def capped(self) -> bool:
        """Its steps are held below its token budget by an SLO (`pdserve.core.sched.step_budget`)."""
        return self.budget < self.max_budget

    def prefill_s(self, tokens: int, decode_batch: int = 0, fill: int = 0, prompt: int | None = None,
                  busy: bool = False) -> float | None:
        """`tokens` in budget-sized chunks; the last one is topped up with `fill` more tokens (lower tiers'
        prompts batched into the same step), or, on a capped worker that is `busy` (other prompts queued), to a
        whole chunk: its scheduler fills a capped step with whatever is queued when it starts, and in a burst
        prompts arriving meanwhile fill it too, so the last step is as long as the cap lets it be (a prompt
        alone on an idle worker has its own tokens); each chunk of a colocated worker also carries its decode
        batch."""
        full, rest = divmod(max(tokens, 0), self.budget)
        rest = (self.budget if busy and self.capped else min(rest + fill, self.budget)) if rest else 0
        prompt = prompt or self.budget
        one = self._prefill_chunk_s(self.budget, prompt) if full else 0.0
        last = self._prefill_chunk_s(rest, prompt) if rest else 0.0
        if one is None or last is None:
            return None
        t = full * one + last
        if decode_batch:  # each chunk's step also carries the decode batch (its `a` counted once)
            per_step = self.fit.predict((0.0, 0.0, 0.0, decode_batch * self.mean_context, decode_batch))
            t += (full + (rest > 0)) * per_step
        return t


class Admission:
    def __init__(self, margin: float = default_of(AdmissionSettings, "admission_margin"),
                 max_outstanding: int = default_of(AdmissionSettings, "max_outstanding"), predict: bool = True) -> None:
        self.margin, self.max_outstanding, self.predict = margin, max_outstanding, predict
        self.models: dict[str, WorkerModel] = {}
        self.last_ttft_s: float | None = None  # the prediction of the last `check` (None: none made)

    def model(self, worker: str) -> WorkerModel:
        if worker not in self.models:
            self.models[worker] = WorkerModel()
        return self.models[worker]

    def observe_steps(self, worker: str, steps) -> None:
        """`steps`: [(prefill_tokens, prefill_sq, decode_seqs, decode_context, seconds[, prefill_prefix])]
        (`online_fit.REPORTED`; this model's form has no prefix term: a sixth number is not used)."""
        model = self.model(worker)
        for step in steps:
            model.observe(*step[:5])

    def observe_delivery(self, worker: str, seconds: float) -> None:
        model = self.model(worker)
        model.delivery_s = seconds if model.delivery_s is None else (
            model.delivery_s + DELIVERY_EWMA * (seconds - model.delivery_s))

    def predict_ttft_s(self, producer: str, decoder: str, tokens: int, ahead: int, behind: int,
                       decoding: int, busy_s: float | None = None) -> float | None:
        """`ahead`: backlog tokens of the request's tier rank or better; `behind`: the rest; `busy_s`: how
        long the producer's current step has run. The current step holds up to a budget of the backlog (the
        tokens ahead first); what is left of `ahead` goes before the request, what is left of `behind` shares
        its last step."""
        colocated = producer == decoder
        t = self.predict_prefill_s(producer, tokens, ahead, behind, decoding if colocated else 0, busy_s)
        if t is None:
            return None
        return t + (0.0 if colocated else self.delivery_tail_s(decoder, decoding))

    def predict_read_s(self, producer: str, decoder: str, tokens: int, ahead: int, behind: int,
                       decoding: int, busy_s: float | None = None) -> float | None:
        """When the decode worker would first read the prompt's KV if the link took no time: its prefill (as
        `predict_ttft_s`) and the decode worker's first step, without the learned delivery tail (which holds
        the link's past waits). What `--kv-wire-dtype auto` weighs the link's backlog against."""
        t = self.predict_prefill_s(producer, tokens, ahead, behind, 0, busy_s)
        return None if t is None else t + self.first_step_s(decoder, decoding)

    def first_step_s(self, decoder: str, decoding: int) -> float:
        """The decode worker's next step with one more request in its batch (0 before its model predicts)."""
        return self.model(decoder).decode_s(decoding + 1) or 0.0

    def delivery_tail_s(self, decoder: str, decoding: int) -> float:
        """Prefill done -> first token: the decode worker's moving average of live ones; before its first,
        its first step (no link wait known yet)."""
        learned = self.model(decoder).delivery_s
        return self.first_step_s(decoder, decoding) if learned is None else learned

    def predict_prefill_s(self, producer: str, tokens: int, ahead: int, behind: int, decoding: int = 0,
                          busy_s: float | None = None) -> float | None:
        """Queueing and prefill on `producer` until its prompt of `tokens` uncached tokens is prefilled (TTFT
        without the delivery tail); `decoding`: a colocated worker's decode batch, carried by each chunk;
        `busy_s`: how long its current step has run (None: not known, taken as half done)."""
        model = self.model(producer)
        in_step = min(ahead + behind, model.budget)
        ahead_left = max(ahead - in_step, 0)
        behind_left = ahead + behind - in_step - ahead_left
        t = model.prefill_s(ahead_left + tokens, decoding, behind_left, tokens, busy=ahead + behind > 0)
        if t is None:
            return None
        if in_step:
            step = model.prefill_s(in_step, prompt=tokens) or 0.0
            t += 0.5 * step if busy_s is None else step - min(max(busy_s, 0.0), step)
        return t

    def check(self, tier: ServiceTier, producer: str, decoder: str, tokens: int, ahead: int, behind: int,
              decoding: int, outstanding: int, now: float, busy_s: float | None = None) -> Rejection | None:
        if outstanding >= self.max_outstanding:
            return Rejection("queue_full", f"worker {decoder} has {outstanding} requests queued; try again later",
                             1.0, code="queue_full")
        self.last_ttft_s = None
        if not self.predict or not tier.has_slo:
            return None
        slack = 1.0 + self.margin
        if tier.ttft_ms is not None:
            ttft = self.last_ttft_s = self.predict_ttft_s(producer, decoder, tokens, ahead, behind, decoding, busy_s)
            if ttft is not None and ttft * 1000.0 > tier.ttft_ms * slack:
                return Rejection("slo_ttft", f"predicted time to first token {ttft * 1000:.0f} ms exceeds the "
                                 f"{tier.name} tier's {tier.ttft_ms:g} ms SLO ({ahead} prompt tokens queued ahead, "
                                 f"{behind} behind, {decoding} decoding)", _retry(ttft - tier.ttft_ms / 1000))
        if tier.tpot_ms is not None:
            tpot = self.model(decoder).tpot_s(decoding + 1, tier.tpot_ms / 1000.0)
            if tpot is not None and tpot * 1000.0 > tier.tpot_ms * slack:
                return Rejection("slo_tpot", f"predicted time per output token {tpot * 1000:.0f} ms exceeds the "
                                 f"{tier.name} tier's {tier.tpot_ms:g} ms SLO ({decoding} decoding)", _retry(1.0))
        return None


def _retry(seconds: float) -> float:
    """Retry-After: whole seconds, at least one."""
    return float(max(1, math.ceil(seconds)))
