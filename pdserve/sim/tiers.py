"""Device KV pool usage of each engine over simulated time.

The device tier is the engine's real `KVBlockManager`; `DeviceTier` only observes it after each step and
keeps time-weighted usage, the peak and a coarse time series (one point per `sample_s`). The host and disk
tiers are the real `pdserve.core.kvstore.kv_tiers.TieredKV` on a `pdserve.sim.tier_io.SimTierIO`.
"""

from __future__ import annotations

from pdserve.core.kvstore.block_manager import KVBlockManager


class DeviceTier:
    def __init__(self, blocks: KVBlockManager, block_bytes: int, sample_s: float = 1.0) -> None:
        self.blocks = blocks
        self.block_bytes = block_bytes
        self.sample_s = sample_s
        self.peak_blocks = 0
        self._area = 0.0  # integral of used blocks over time
        self._last_t = 0.0
        self._last_used = 0
        self._next_sample = 0.0
        self.series: list[tuple[float, int]] = []

    def observe(self, t: float, used: int | None = None) -> None:
        self.observe_many((t,), (self.blocks.num_used_blocks if used is None else used,))

    def observe_many(self, times, used) -> None:
        """`observe(t, u)` for each pair in order (a fast-forward window's steps), the same sums in the same
        order, without a call per step."""
        area, last_t, last_used = self._area, self._last_t, self._last_used
        peak, nxt, series = self.peak_blocks, self._next_sample, self.series
        for t, u in zip(times, used):
            area += last_used * (t - last_t)
            last_t, last_used = t, u
            if u > peak:
                peak = u
            if t >= nxt:
                series.append((t, u))
                nxt = t + self.sample_s
        self._area, self._last_t, self._last_used = area, last_t, last_used
        self.peak_blocks, self._next_sample = peak, nxt

    def stats(self, duration_s: float) -> dict:
        mean = self._area / duration_s if duration_s > 0 else 0.0
        total = self.blocks.num_blocks
        return {"capacity_bytes": total * self.block_bytes, "peak_bytes": self.peak_blocks * self.block_bytes,
                "mean_bytes": mean * self.block_bytes, "peak_fraction": self.peak_blocks / total,
                "mean_fraction": mean / total}
