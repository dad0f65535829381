"""What a worker's caches stored and evicted since it last said: the `kv_cache` events routing reads
(`pdserve.conductor.wire.KvCache`, `pdserve.conductor.routing.ReportedBlocks`).

A tier is seen as one hash per slot (0: the slot holds nothing cached, `KVBlockManager.cached_hashes` for the
device pool, `TierIndex.cached_hashes` for the host and disk tiers: `tier_slots`); each
`take` compares it with the last one taken, slot by slot (vectorised: O(slots), no per-block hooks), so one
batch carries every block that left a slot (evicted, or reused for another hash) and every block that came
into one. Applied in that order (evicted, then stored) the receiver's view equals the tier's. The first take
after `reset` reports all the tier holds. Pure: numpy only; the real worker and the simulator's engines
both use it.
"""

from __future__ import annotations

import numpy as np

REPORT_EVERY_S = 0.25  # a simulated engine's reports, as a real worker's stats cadence (`worker.STATS_INTERVAL_S`)


class CacheEvents:
    def __init__(self) -> None:
        self._last: dict[str, np.ndarray] = {}

    def reset(self) -> None:
        self._last.clear()

    def take(self, tiers: dict[str, np.ndarray], pool: list[int] = ()
             ) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """`tiers`: tier name -> its hash per slot (0 where empty); `pool`: hashes written to the shared pool
        since (`pool_written`: its evictions are the store's, unseen). (stored, evicted): tier -> [hash, ...],
        only the tiers where something changed."""
        stored, evicted = ({"remote": list(pool)} if len(pool) else {}), {}
        for tier, now in tiers.items():
            before = self._last.get(tier)
            if before is None or len(before) != len(now):
                before = np.zeros(len(now), np.uint64)
            changed = before != now
            gone, came = before[changed], now[changed]
            gone, came = gone[gone != 0], came[came != 0]
            if len(gone):
                evicted[tier] = gone.tolist()
            if len(came):
                stored[tier] = came.tolist()
            self._last[tier] = now.copy()
        return stored, evicted


def pool_written(tiers) -> list[int]:
    """The hashes a worker wrote to the shared pool since it last reported (none without a pool)."""
    remote = getattr(tiers, "remote", None)
    return remote.take_written() if remote is not None else []


def tier_slots(blocks, tiers=None) -> dict[str, np.ndarray]:
    """Each tier's hash per slot: the device pool's (`KVBlockManager.cached_hashes`) and, with lower tiers
    (`pdserve.core.kvstore.kv_tiers.TieredKV`), the host's and the disk's."""
    out = {"device": blocks.cached_hashes()}
    for name in ("host", "disk"):
        index = getattr(tiers, name, None)
        if index is not None:
            out[name] = index.cached_hashes()
    return out
