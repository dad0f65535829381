"""Prewarm pins: a finished request's cached blocks kept on the device, under a holder of their own, until a
deadline or `unpin`, so that the request's follow-up finds them (`Request.pin`).

`PrewarmPins` owns the pins (holder -> pinned until, clock seconds). It belongs to a
`pdserve.core.kvstore.block_manager.KVBlockManager`, which gives it a narrow view of itself: the metadata columns it
marks, the registered-blocks mask it reads, and the calls it holds, lists and frees blocks with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from pdserve.core.kvstore.kv_columns import MetaColumns


class PrewarmPins:
    """Holders that keep blocks on the device until a deadline (see the module docstring)."""

    def __init__(self, cols: MetaColumns, registered: np.ndarray, block_ids: Callable[[str], Sequence[int]],
                 hold: Callable[[str, Sequence[int]], None], free: Callable[[str], None]) -> None:
        self._cols = cols  # `pinned_until_s` and `prewarmed` are written here
        self._registered = registered  # (read only) block id -> registered in the prefix cache
        self._block_ids = block_ids  # a request's or holder's block ids
        self._hold = hold  # a holder takes a reference to blocks (`KVBlockManager.hold`) ...
        self._free = free  # ... and gives all its references back (`KVBlockManager.free`)
        self._until_s: dict[str, float] = {}  # holder -> pinned until (clock seconds)

    def __len__(self) -> int:
        return len(self._until_s)

    def pin(self, holder: str, request_id: str, until_s: float) -> int:
        """Keep `request_id`'s registered (full, cached) blocks on the device until `until_s` or `unpin`,
        marked as prewarmed; returns how many. Call before the request's blocks are freed."""
        ids = self._registered_ids(request_id)
        self._hold(holder, ids.tolist())
        cols = self._cols
        cols.pinned_until_s[ids] = np.maximum(cols.pinned_until_s[ids], until_s)
        cols.prewarmed[ids] = True
        self._until_s[holder] = until_s
        return len(ids)

    def unpin(self, holder: str) -> bool:
        """Let `holder`'s blocks go (they stay cached until reused); False for an unknown holder."""
        if self._until_s.pop(holder, None) is None:
            return False
        self._cols.pinned_until_s[self._registered_ids(holder)] = 0.0
        self._free(holder)
        return True

    def expire(self, now: float) -> list[str]:
        """Unpin the holders whose deadline is at or before `now`; returns them."""
        if not self._until_s:
            return []
        expired = [h for h, until in self._until_s.items() if until <= now]
        for holder in expired:
            self.unpin(holder)
        return expired

    @property
    def num_blocks(self) -> int:
        """Blocks held by pins (a block pinned twice counts twice)."""
        return sum(len(self._block_ids(h)) for h in self._until_s)

    def _registered_ids(self, owner: str) -> np.ndarray:
        """`owner`'s blocks registered in the prefix cache (a request's: those of its hashed prefix)."""
        table = np.asarray(self._block_ids(owner), np.int64)
        return table[self._registered[table]]
