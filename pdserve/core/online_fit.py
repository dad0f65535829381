"""An online least-squares fit of step time over a sliding window of recent steps, coefficients >= 0.

Shared by the conductor's admission model (`pdserve.cluster.admission`) and the scheduler's step budget
(`pdserve.core.step_budget`): both predict how long a step of some shape takes from the steps a worker
actually ran (real seconds on a real worker, modelled seconds in the simulator).
"""

from __future__ import annotations

from collections import deque

import numpy as np

MIN_SAMPLES = 8
WINDOW = 256  # recent steps kept
REFIT_EVERY = 16  # new samples between two least-squares fits


class OnlineFit:
    """`seconds ~ x @ coef` over the last `WINDOW` samples; no prediction before `MIN_SAMPLES`."""

    def __init__(self, width: int) -> None:
        self.rows: deque = deque(maxlen=WINDOW)
        self.coef: np.ndarray | None = None
        self.width = width
        self._new = 0
        self._fastest: float | None = None  # (of the rows as they are, computed when asked)

    def add(self, x: tuple, seconds: float) -> None:
        self.rows.append((*x, seconds))
        self._new += 1
        self._fastest = None

    def coefficients(self) -> np.ndarray | None:
        """The fitted coefficients (refitted every `REFIT_EVERY` new samples), or None while too few."""
        if len(self.rows) < MIN_SAMPLES:
            return None
        if self.coef is None or self._new >= REFIT_EVERY:
            data = np.asarray(self.rows, dtype=float)
            self.coef, self._new = nonnegative_lstsq(data[:, :self.width], data[:, self.width]), 0
        return self.coef

    def predict(self, x: tuple) -> float | None:
        coef = self.coefficients()
        return None if coef is None else float(np.dot(coef, x))

    def fastest(self) -> float:
        """The shortest time among the recent samples: no whole step takes less (a fit whose intercept came
        out negative, and was dropped, predicts a tiny step at next to nothing)."""
        if self._fastest is None:
            self._fastest = min(row[-1] for row in self.rows) if self.rows else 0.0
        return self._fastest


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
