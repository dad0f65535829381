"""The simulator's time model fitted to the steps a running server reports, under serving conditions.

`GET /v1/admin/steps` on a `pdserve serve` gateway gives each worker's recent engine steps as the worker timed
them (around `LLMEngine.step()`, while every other worker on the host runs too), with each step's prefix term
(`prefill_prefix`: its chunks' tokens x the tokens cached before them, a reused prefix's attention). `pdserve profile --from-server
URL` fits the DistServe form (`pdserve.sim.timemodel.FittedTimeModel`) to the `served` ones -- not the
`calibration` steps a worker timed alone at load -- so the twin sees the interference an offline profile of one
engine misses, on the user's own deployment.

The fit: least squares on errors relative to the predicted time (`fit_time_model(relative=True)`) over the
served pure prefill and pure decode steps: the mean step of each shape (a request's TPOT is the mean of its
steps), short steps counting as much as long ones; then once more without the stalls, steps over
`STALL_FACTOR` times their shape's first fit (the first step after the engine idled for seconds runs up to
hundreds of ms slower on a shared VM: the wake-up tables model those, `FittedTimeModel.wake`). The result's meta
counts the steps of each kind fitted (`steps_fitted`) and left out as stalls (`steps_stalled`); its `spread`
keeps how the fitted steps scatter around the fit, which the simulated engines draw (`pdserve.sim.jitter`).

Woken decode steps are not fitted either (`woken`): a request's first decode step alone on its worker -- one
sequence, not the one the worker's previous decode step ran -- follows the worker's wait for the request's KV,
and the simulator adds a step's wake-up after an idle engine (the wake-up tables) on top of the fitted time.
Fitted in, they were counted twice: on the Mooncake conversation workload (median 11 output tokens, ~15% of the
decode steps) such a step ran 1.2-1.9x the others (Xeon, bench_results/fidelity_mc34), lifting the fitted
one-sequence step 6-9% over a running request's (a fit of one run against the next run's steps). Their mean
extra over the fit is the model's `wake_decode` ([[0, extra]]: after any idle), which a measured table
(`bench_fidelity.py`'s idle probe) replaces; they stay in the spread (a slow first step is jitter a request's
tokens see: without them the simulated P99 jitter there fell to 25-50 ms vs 65-79 real). With fewer than `MIN_UNWOKEN` other decode steps (every request's
only decode step) they are fitted as before.
"""

from __future__ import annotations

import numpy as np

from pdserve.core.sched.online_fit import REPORTED
from pdserve.errors import InvalidRequestError
from pdserve.sim.jitter import spread_of
from pdserve.sim.timemodel import FittedTimeModel, StepShape, fit_time_model

STALL_FACTOR = 3.0  # a step over this many times its shape's fitted time is a stall (wake-up), not fitted
MIN_UNWOKEN = 8  # fewer decode steps that are not woken: the woken ones are fitted too (`steps_woken_fitted`)


def served_samples(records: list[dict]) -> list[tuple[StepShape, float]]:
    """(shape, seconds) of the `served` step records; a malformed one raises a one-line error naming it."""
    out = []
    for i, rec in enumerate(records):
        try:
            if rec.get("source", "served") != "served":
                continue
            pt, sq, ds, ctx, seconds = (rec[k] for k in REPORTED[:5])
            pt, sq, ds, ctx, seconds = int(pt), int(sq), int(ds), int(ctx), float(seconds)
            pre = int(rec.get(REPORTED[5], 0))  # (a worker that predates the prefix term: none)
        except (AttributeError, KeyError, TypeError, ValueError):
            raise InvalidRequestError(f"step record {i} needs numbers {', '.join(REPORTED[:5])} (and optionally "
                                      f"{REPORTED[5]}): {rec!r:.200}") from None
        if min(pt, sq, ds, ctx, pre) < 0 or not seconds > 0:
            raise InvalidRequestError(f"step record {i} has a negative count or seconds <= 0: {rec!r:.200}")
        out.append((StepShape(prefill_tokens=pt, prefill_sq=sq, decode_seqs=ds, decode_context=ctx,
                              sampled=ds, prefill_prefix=pre), seconds))
    return out


def kind(shape: StepShape) -> str | None:
    """`prefill` or `decode` for a pure step of that kind; None for a mixed or empty one (not fitted)."""
    if shape.prefill_tokens and not shape.decode_seqs:
        return "prefill"
    if shape.decode_seqs and not shape.prefill_tokens:
        return "decode"
    return None


def relative_errors(model: FittedTimeModel, samples: list[tuple[StepShape, float]]) -> np.ndarray:
    """(predicted - measured) / measured for each sample."""
    return np.array([model.step_time(s) / t - 1.0 for s, t in samples])


def woken(records: list[dict], samples: list[tuple[StepShape, float] | None] | None = None) -> list[bool]:
    """For each record, whether it is a woken decode step: a served pure decode step of one sequence after its
    worker's previous pure decode step was one of another sequence (its context not the previous one + 1), or
    after none: a request's first step on a worker that had nothing else to run. (One sequence after a batch of
    several is the one left running.) The records are each worker's steps oldest first, as GET /v1/admin/steps
    gives them. `samples`: `_all_samples(records)` where the caller has them."""
    out, last = [], {}
    for rec, sample in zip(records, _all_samples(records) if samples is None else samples):
        shape = sample and sample[0]
        decode = shape is not None and kind(shape) == "decode"
        prev = last.get(rec.get("worker"))
        out.append(decode and shape.decode_seqs == 1 and (prev is None or (
            prev.decode_seqs == 1 and shape.decode_context != prev.decode_context + 1)))
        if decode:
            last[rec.get("worker")] = shape
    return out


def _all_samples(records: list[dict]) -> list[tuple[StepShape, float] | None]:
    """`served_samples` per record, None for a record of another source."""
    return [(served_samples([rec]) or [None])[0] for rec in records]


def fit_from_steps(records: list[dict], meta: dict | None = None) -> FittedTimeModel:
    """The time model of the served step records (see the module doc); its meta says how many steps of each
    kind it was fitted to and how many it left out as stalls and as woken decode steps (`steps_woken`, their
    mean extra over the fit in `wake_decode`). Too few pure prefill or decode steps: a one-line error."""
    served_samples(records)  # (a malformed record: its one-line error names its index)
    per_record = _all_samples(records)
    every = list(zip(per_record, woken(records, per_record)))
    if sum(1 for sample, w in every if sample and kind(sample[0]) == "decode" and not w) < MIN_UNWOKEN:
        # (every request's only decode step, e.g. 2-token answers: fitted as they are, counted in the meta)
        meta, every = {**(meta or {}), "steps_woken_fitted": sum(w for _, w in every)}, [(x, False) for x, _ in every]
    wakes = [sample for sample, w in every if w]
    samples = [sample for sample, w in every if sample and kind(sample[0]) and not w]
    counts = _counts(samples)
    if min(counts.values()) < 3:
        raise InvalidRequestError(f"need at least 3 served pure prefill and 3 pure decode steps to fit, got "
                                  f"{counts['prefill']} and {counts['decode']}: send the server some requests first")
    first = fit_time_model(samples, relative=True)
    kept = [(s, t) for s, t in samples if t <= STALL_FACTOR * first.step_time(s)]
    fitted = _counts(kept)
    if min(fitted.values()) < 3:
        raise InvalidRequestError(f"most steps took over {STALL_FACTOR:g}x the fitted time of their shape: "
                                  f"{fitted['prefill']} prefill and {fitted['decode']} decode steps left to fit")
    stalls = {k: counts[k] - fitted[k] for k in counts}
    model = fit_time_model(kept, {**(meta or {}), "steps_fitted": fitted, "steps_stalled": stalls,
                                  "steps_woken": len(wakes)}, relative=True)
    # (the woken steps scatter in it: a real request's slow first step is part of the jitter its tokens see)
    spread = {k: spread_of([t / model.step_time(s) for s, t in kept + wakes if kind(s) == k]) for k in fitted}
    extra = [(0.0, max(float(np.mean([t - model.step_time(s) for s, t in wakes])), 0.0))] if wakes else None
    return FittedTimeModel(model.prefill, model.decode, model.meta, wake_decode=extra, spread=spread)


def _counts(samples: list[tuple[StepShape, float]]) -> dict[str, int]:
    return {k: sum(kind(s) == k for s, _ in samples) for k in ("prefill", "decode")}
