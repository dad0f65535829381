"""A block manager's holds outside a request's own table: a long context's leading blocks moved to a lower
tier (`start_cold`, `spill`) and prewarm pins (`pin`, `unpin`, `expire_pins`).

`BlockHolds` is a part of `pdserve.core.block_manager.KVBlockManager` (a mixin over its state: tables, hashes,
ref counts, metadata columns), kept apart so each module holds one concept.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdserve.core.block_hash import BlockHash


class BlockHolds:
    """Cold heads, spills and prewarm pins of a `KVBlockManager` (see the module docstring)."""

    def num_cold_blocks(self, request_id: str) -> int:
        return self._cold.get(request_id, 0)

    def start_cold(self, request_id: str, head: Sequence[BlockHash]) -> None:
        """A request that holds no blocks starts with `head` (the hashes of its first blocks) in a lower tier:
        its table will begin at logical block len(head)."""
        if self._tables.get(request_id):
            raise ValueError(f"{request_id!r} already holds blocks")
        self._cold[request_id] = len(head)
        self._hashes[request_id] = list(head)

    def spill(self, request_id: str, count: int) -> None:
        """Drop the request's `count` oldest device blocks (registered ones: their KV now lives in a lower
        tier); its table then starts at logical block `num_cold_blocks`. The blocks stay cached here until
        reused, like any freed block."""
        table = self._tables[request_id]
        if count > len(table) or len(self._hashes.get(request_id, ())) < self._cold.get(request_id, 0) + count:
            raise ValueError(f"{request_id!r}: only registered blocks can leave the device")
        self._release(table[:count])
        del table[:count]
        self._cold[request_id] = self._cold.get(request_id, 0) + count

    def pin(self, holder: str, request_id: str, until_s: float) -> int:
        """Keep `request_id`'s registered (full, cached) blocks on the device until `until_s` or `unpin`,
        marked as prewarmed; returns how many. Call before the request's blocks are freed."""
        table = np.asarray(self._tables.get(request_id, [])[:len(self._hashes.get(request_id, ()))], np.int64)
        ids = table[self._registered[table]]
        self.hold(holder, ids.tolist())
        cols = self.cols
        cols.pinned_until_s[ids] = np.maximum(cols.pinned_until_s[ids], until_s)
        cols.prewarmed[ids] = True
        self._pins[holder] = until_s
        return len(ids)

    def unpin(self, holder: str) -> bool:
        if self._pins.pop(holder, None) is None:
            return False
        ids = np.asarray(self._tables.get(holder, ()), np.int64)
        self.cols.pinned_until_s[ids[self._registered[ids]]] = 0.0
        self.free(holder)
        return True

    def expire_pins(self, now: float) -> list[str]:
        if not self._pins:
            return []
        expired = [h for h, until in self._pins.items() if until <= now]
        for holder in expired:
            self.unpin(holder)
        return expired

    @property
    def has_pins(self) -> bool:
        return bool(self._pins)

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(self._tables.get(h, ())) for h in self._pins)
