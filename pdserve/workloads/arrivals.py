"""Synthetic arrival processes for workloads without timestamps (length-only traces, fixed lengths).

* `poisson`: exponential inter-arrival gaps with mean 1/rate (coefficient of variation 1).
* `gamma`: gamma-distributed gaps with shape k = 1/cv**2 and scale 1/(rate*k), so the mean gap is still 1/rate and
  the gaps' coefficient of variation is `cv` (cv > 1 is burstier than Poisson, cv < 1 more regular).

The first request arrives at t = 0 and each later one a gap after the previous, so n requests span n-1 gaps
(the same convention as vLLM's benchmark, which sends the first request immediately).
"""

from __future__ import annotations

import numpy as np

from pdserve.errors import InvalidRequestError

ARRIVAL_PROCESSES = ("poisson", "gamma")


def check_arrival(arrival: str, cv: float) -> None:
    """Validate the arrival-process arguments (before any file is read, so errors come early)."""
    if arrival not in ARRIVAL_PROCESSES:
        raise InvalidRequestError(f"unknown arrival process {arrival!r} "
                                  f"(expected one of {', '.join(ARRIVAL_PROCESSES)})")
    if not cv > 0 or cv == float("inf"):
        raise InvalidRequestError(f"cv must be a positive number, got {cv}")
    if arrival == "poisson" and cv != 1.0:
        raise InvalidRequestError(f"cv={cv} needs arrival='gamma' (Poisson arrivals always have cv 1)")


def generate_arrivals(n: int, rate: float, rng: np.random.Generator, *, arrival: str = "poisson",
                      cv: float = 1.0) -> np.ndarray:
    """n arrival times in seconds, non-decreasing, starting at 0, with mean gap 1/rate."""
    check_arrival(arrival, cv)
    if not rate > 0 or rate == float("inf"):
        raise InvalidRequestError(f"rate must be a positive number of requests per second, got {rate}")
    if n <= 0:
        return np.zeros(0)
    if arrival == "poisson":
        gaps = rng.exponential(1.0 / rate, size=n - 1)
    else:
        shape = 1.0 / cv ** 2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))
