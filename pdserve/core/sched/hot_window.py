"""Long contexts: a request keeps a hot window of its most recent blocks on the device; its older ("cold")
blocks live in the host tier only, and attention reads them from there layer by layer.

Logical block i of a request with `c` cold blocks is `block_ids[i - c]` on the device for i >= c, and host
entry `request.cold_hashes[i]` for i < c (held `busy` there until the request ends or is preempted).

- While computing: before a step would push the request past the window, its oldest registered blocks
  (computed, full, already copied to host by write-through) leave the device (`KVBlockManager.spill`).
- At admission: prefix hits are capped to the window; blocks past that are recomputed and slide out.
- Decode worker of PD (`reserve`): a prompt longer than the window gets device blocks only for its last
  window's worth; its head is received straight into host entries (or found there already).
"""

from __future__ import annotations

from pdserve.core.kvstore.block_manager import BlockId, KVBlockManager, PrefixHit
from pdserve.core.kvstore.kv_tiers import KVLoad, TierHit, TieredKV
from pdserve.core.request import Request


class HotWindow:
    def __init__(self, blocks: KVBlockManager, tiers: TieredKV, window_tokens: int) -> None:
        self.blocks = blocks
        self.tiers = tiers
        bs = blocks.block_size
        self.window = max(2, min(window_tokens // bs, blocks.num_blocks // 2))  # blocks
        self.num_overflows = 0  # grown past the window: the host tier could not take the blocks

    def max_model_len(self, limit: int) -> int:
        """The hot window on the device, the rest in host: never less than what the pool alone allows."""
        return min(limit, max(self.blocks.num_blocks, self.window + self.tiers.host.capacity)
                   * self.blocks.block_size)

    def chunk_limit(self, req: Request, n: int) -> int:
        """At most what fits in the window beside the request's partly filled last block."""
        return min(n, self.window * self.blocks.block_size - req.num_computed_tokens % self.blocks.block_size)

    def make_room(self, req: Request, n: int) -> bool:
        """Move the request's oldest blocks off the device so that computing `n` more tokens keeps it within
        the window. False when that must wait for blocks still being copied to host."""
        rid = req.request_id
        cold = self.blocks.num_cold_blocks(rid)
        excess = self.blocks.blocks_needed(req.num_computed_tokens + n) - cold - self.window
        if excess <= 0:
            return True
        hashes = self.blocks.registered_hashes(rid)[cold:cold + excess]
        if self.blocks.hand_over_deferred(rid):  # decode blocks not copied down yet: now, and wait for them
            return False
        count, pending = self.tiers.hold_cold(hashes)
        if count:
            self.blocks.spill(rid, count)
            req.cold_hashes.extend(hashes[:count])
        if count == excess:
            return True
        if not pending:  # the host tier could not take them: grow past the window while the pool allows
            self.num_overflows += 1
            return True
        return False

    def cap_hits(self, prefix: PrefixHit, lower: TierHit) -> tuple[PrefixHit, TierHit]:
        """At most the window's worth of hits (minus one block of room); later blocks are recomputed."""
        room = self.window - 1
        device = prefix.block_ids[:room]
        host = lower.host[:max(room - len(device), 0)]
        return PrefixHit(device, prefix.block_hashes, prefix.block_size), TierHit(host, lower.waiting)

    def reserve(self, req: Request, hashes: tuple, lower: TierHit
                ) -> tuple[list[BlockId], list[KVLoad], int] | None:
        """Reserve a prompt longer than the window for delivery: (device block ids, loads of host hits past
        the cold head, blocks not to be delivered), or None (no room yet). `hashes`: the prompt's full
        blocks; `lower`: its host run from block 0."""
        rid = req.request_id
        cold = self.blocks.blocks_needed(req.num_prompt_tokens) - self.window
        head = list(hashes[:cold])
        held = min(len(lower.host), cold)
        if not self.tiers.expect_cold(head[held:]):
            return None
        self.tiers.hold_cold(head[:held], count_hits=True)
        self.blocks.start_cold(rid, head)
        ids = self.blocks.allocate(rid, req.num_prompt_tokens)
        if ids is None:
            self.tiers.release_cold(head)
            self.blocks.free(rid)
            return None
        req.cold_hashes = head
        loads = self.tiers.load(lower.host[cold:], ids, count=True) if len(lower.host) > cold else []
        return ids, loads, max(len(lower.host), held)
