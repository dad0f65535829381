"""An online least-squares fit of step time over a sliding window of recent steps, coefficients >= 0.

Shared by the conductor's admission model (`pdserve.conductor.admission`) and the scheduler's step budget
(`pdserve.core.sched.step_budget`): both predict how long a step of some shape takes from the steps a worker
actually ran (real seconds on a real worker, modelled seconds in the simulator).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

MIN_SAMPLES = 8
WINDOW = 256  # recent steps kept
REFIT_EVERY = 16  # new samples between two least-squares fits
# the names of a reported step's numbers (`StepRow.reported`), as GET /v1/admin/steps gives each step; the
# prefix term last (rows of workers that predate it have the first five: a missing prefix is 0)
REPORTED = ("prefill_tokens", "prefill_sq", "decode_seqs", "decode_context", "seconds", "prefill_prefix")


def prefill_terms(tokens: float, sq: float, prefix: float) -> tuple[float, ...]:
    """The step form's prefill terms, one place for every fit of it (the step budget's, the simulator's
    `FittedTimeModel`): 1, the chunks' tokens, the sum of their squares (attention within a chunk) and of each
    chunk's tokens x its prefix (attention over the cached KV before it)."""
    return (1.0, tokens, sq, prefix)


def decode_terms(context: float, seqs: float) -> tuple[float, ...]:
    """The step form's decode terms: 1, the one-token chunks' context (keys attended), their number."""
    return (1.0, context, seqs)


@dataclass(frozen=True)
class StepRow:
    """One step as the time models see it: its prefill chunks' tokens, the sum of their squares and of each
    chunk's tokens x its prefix, its decode sequences (one-token chunks) and their context, and how long it took
    (measured on a real worker, modelled in the simulator, or timed by a profile step at load:
    `pdserve.engine.calibration`)."""
    prefill_tokens: int = 0
    prefill_sq: int = 0
    prefill_prefix: int = 0
    decode_seqs: int = 0
    decode_context: int = 0
    seconds: float = 0.0

    @staticmethod
    def of(scheduled, seconds: float) -> StepRow:
        """The row of a scheduled step (`pdserve.core.sched.schedule.SchedulerOutput`) that took `seconds`."""
        pt = sq = pre = ds = ctx = 0
        for c in scheduled.chunks:
            n = len(c.token_ids)
            if n == 1:
                ds, ctx = ds + 1, ctx + c.start_pos + 1
            else:
                pt, sq, pre = pt + n, sq + n * n, pre + n * c.start_pos
        return StepRow(pt, sq, pre, ds, ctx, seconds)

    def terms(self) -> tuple[float, ...]:
        """The step form of a whole step, pure or mixed (one intercept): `prefill_terms` + `decode_terms`."""
        return (*prefill_terms(self.prefill_tokens, self.prefill_sq, self.prefill_prefix),
                *decode_terms(self.decode_context, self.decode_seqs)[1:])

    def reported(self) -> list:
        """What a worker's `stats` event carries for it (`steps`: the conductor's admission model fits the
        first five): [prefill tokens, sum of their squares, decode sequences, decode context, seconds, sum of
        prefill tokens x prefix] (`REPORTED`)."""
        return [self.prefill_tokens, self.prefill_sq, self.decode_seqs, self.decode_context, self.seconds,
                self.prefill_prefix]


class OnlineFit:
    """`seconds ~ x @ coef` over the last `WINDOW` samples; no prediction before `MIN_SAMPLES`."""

    def __init__(self, width: int) -> None:
        self.rows: deque = deque(maxlen=WINDOW)
        self.coef: np.ndarray | None = None
        self.width = width
        self._new = 0
        self._terms: tuple[float, ...] = ()  # coef as floats: a prediction is a few products, not a numpy call
        self._added = 0  # samples ever added (the index of the next)
        self._lows: deque = deque()  # (index, seconds) of the rows, ascending: the window's minimum first
        self._ring = np.empty((WINDOW, width + 1))  # the rows as numbers, row `_added % WINDOW` written next

    def add(self, x: tuple, seconds: float) -> None:
        self.rows.append((*x, seconds))
        self._ring[self._added % WINDOW] = self.rows[-1]
        self._new += 1
        lows = self._lows  # a sliding-window minimum: no later sample is lower than what stays behind it
        while lows and lows[-1][1] >= seconds:
            lows.pop()
        lows.append((self._added, seconds))
        self._added += 1
        if lows[0][0] <= self._added - 1 - WINDOW:
            lows.popleft()

    def coefficients(self) -> np.ndarray | None:
        """The fitted coefficients (refitted every `REFIT_EVERY` new samples), or None while too few."""
        if len(self.rows) < MIN_SAMPLES:
            return None
        if self.coef is None or self._new >= REFIT_EVERY:
            at = self._added % WINDOW  # (the oldest row once the ring is full: the rows in their order)
            data = self._ring[:at] if self._added < WINDOW else np.concatenate((self._ring[at:], self._ring[:at]))
            self.coef, self._new = nonnegative_lstsq(data[:, :self.width], data[:, self.width]), 0
            self._terms = tuple(self.coef.tolist())
        return self.coef

    def predict(self, x: tuple) -> float | None:
        if self.coefficients() is None:
            return None
        return sum(c * v for c, v in zip(self._terms, x))

    def fastest(self) -> float:
        """The shortest time among the recent samples: no whole step takes less (a fit whose intercept came
        out negative, and was dropped, predicts a tiny step at next to nothing)."""
        return self._lows[0][1] if self._lows else 0.0


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: refit without the columns that came out negative until
    none does (clipping them instead would leave the others fitted to the negative ones' share)."""
    coef = np.zeros(x.shape[1])
    active = list(range(x.shape[1]))
    while active:
        fit, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (fit >= 0).all():
            coef[active] = fit
            break
        active = [col for col, value in zip(active, fit) if value > 0]
    return coef
