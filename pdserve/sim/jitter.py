"""Steps of one shape do not all take as long on a real worker: the simulated engines draw that spread.

A fitted time model predicts a step's mean time. The steps a running server reports scatter around it
(`pdserve profile --from-server`: on this project's 2-vCPU Intel Xeon, decode steps 0.95-1.06x their fit from
the 5th to the 95th percentile) -- the other worker on the cores, the memory system, the OS -- and that
scatter is most of a real server's inter-token jitter, which a simulator stepping at the mean never shows.
`FittedTimeModel.spread` keeps it as the measured time / fitted time of the served steps of each kind, at
`SPREAD_POINTS` evenly spaced quantiles, scaled to a mean of 1 (so mean step times, and so mean TPOT, stay the
fit's). `Jittered` multiplies each simulated step by one of those ratios, picked by a hash of the step's shape:
no random state, so a fast-forwarded run of decode steps draws exactly what stepping one by one draws, and a
run replays bit for bit. Only the simulated engines' steps jitter; the planner's floors and the conductor's
predictions use the mean model.
"""

from __future__ import annotations

import numpy as np

from pdserve.sim.timemodel import StepShape, TimeModel

SPREAD_POINTS = 32
_M1, _M2, _M3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D  # odd 32-bit mixing constants
_MASK = 0xFFFFFFFF


def spread_of(ratios) -> list[float]:
    """`SPREAD_POINTS` quantiles (at the midpoints of equal shares) of measured / fitted step times, scaled to a
    mean of 1."""
    q = np.quantile(np.asarray(ratios, dtype=float), (np.arange(SPREAD_POINTS) + 0.5) / SPREAD_POINTS)
    return (q / q.mean()).tolist()


def _index(a: int, b: int, n: int) -> int:
    h = (a * _M1 + b * _M2 + _M3) & _MASK
    h ^= h >> 15
    h = (h * _M2) & _MASK
    h ^= h >> 13
    return (h * n) >> 32


def _indices(a: np.ndarray, b: int, n: int) -> np.ndarray:
    """`_index` of each of `a` (the same integers, in numpy)."""
    h = (a.astype(np.uint64) * np.uint64(_M1) + np.uint64((b * _M2 + _M3) & _MASK)) & np.uint64(_MASK)
    h ^= h >> np.uint64(15)
    h = (h * np.uint64(_M2)) & np.uint64(_MASK)
    h ^= h >> np.uint64(13)
    return ((h * np.uint64(n)) >> np.uint64(32)).astype(np.int64)


class Jittered:
    """A time model whose steps scatter as `spread` says (see the module doc); everything else is `base`'s."""

    def __init__(self, base: TimeModel, spread: dict[str, list[float]]) -> None:
        self.base = base
        self.prefill = np.asarray(spread.get("prefill") or [1.0])
        self.decode = np.asarray(spread.get("decode") or [1.0])
        self._pre, self._dec = self.prefill.tolist(), self.decode.tolist()

    def __getattr__(self, name: str):
        return getattr(self.base, name)

    def step_time(self, shape: StepShape) -> float:
        t = self.base.step_time(shape)
        if shape.prefill_tokens:
            return t * self._pre[_index(shape.prefill_tokens, shape.prefill_sq, len(self._pre))]
        return t * self._dec[_index(shape.decode_context, shape.decode_seqs, len(self._dec))] if shape.decode_seqs else t

    def decode_times(self, num_seqs: int, context: int, k: int) -> np.ndarray:
        """Pure decode steps i = 1..k (`FittedTimeModel.decode_times`), each jittered as `step_time` does it."""
        ctx = context + num_seqs * np.arange(1, k + 1, dtype=np.int64)
        return self.base.decode_times(num_seqs, context, k) * self.decode[_indices(ctx, num_seqs, len(self.decode))]

    def wake_time(self, idle_s: float, decode: bool = False) -> float:
        return self.base.wake_time(idle_s, decode)


def jittered(tm: TimeModel) -> TimeModel:
    """`tm` with its measured spread (a fitted model that has one), else `tm` itself."""
    spread = getattr(tm, "spread", None)
    return Jittered(tm, spread) if spread else tm
