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
"""

from __future__ import annotations

import numpy as np

from pdserve.core.sched.online_fit import REPORTED
from pdserve.errors import InvalidRequestError
from pdserve.sim.jitter import spread_of
from pdserve.sim.timemodel import FittedTimeModel, StepShape, fit_time_model

STALL_FACTOR = 3.0  # a step over this many times its shape's fitted time is a stall (wake-up), not fitted


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


def fit_from_steps(records: list[dict], meta: dict | None = None) -> FittedTimeModel:
    """The time model of the served step records (see the module doc); its meta says how many steps of each
    kind it was fitted to and how many it left out as stalls. Too few pure prefill or decode steps: a one-line
    error."""
    samples = [(s, t) for s, t in served_samples(records) if kind(s)]
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
    model = fit_time_model(kept, {**(meta or {}), "steps_fitted": fitted, "steps_stalled": stalls}, relative=True)
    model.spread = {k: spread_of([t / model.step_time(s) for s, t in kept if kind(s) == k]) for k in fitted}
    return model


def _counts(samples: list[tuple[StepShape, float]]) -> dict[str, int]:
    return {k: sum(kind(s) == k for s, _ in samples) for k in ("prefill", "decode")}
