"""KV block bookkeeping: which block ids each request holds, ref counts, and the prefix cache.

Pure bookkeeping: no tensors, no request objects. The scheduler asks, this module answers with block ids;
it never writes into a request. Tensors indexed by these ids live in the worker's KV pool.

Free blocks sit in an LRU queue (`OrderedDict`, O(1) removal from the middle when a cached block is hit
again). A freed block keeps its hash and stays findable by prefix lookups until it is popped for reuse:
that is the whole prefix cache, with least-recently-freed eviction. A request's blocks are freed tail
first, because the tail of a sequence is the part least likely to be shared by another request.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NewType

from pdserve.core.block_hash import BlockHash, hash_blocks
from pdserve.core.kv_meta import (BlockMeta, EvictionPolicy, LifecycleConfig, LRUPolicy, Stage, Tier, pick_victim,
                                  stage_of)

BlockId = NewType("BlockId", int)


@dataclass(slots=True)
class _Block:
    block_id: BlockId
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and registered in the cache
    meta: BlockMeta | None = None  # lifecycle metadata of a registered block


@dataclass(frozen=True)
class PrefixHit:
    """Cached blocks that cover a prefix of some tokens; the answer of `find_prefix`.

    `block_hashes` holds the hashes of every full block considered (hit or not), so allocation and later
    caching need not hash the prompt again.
    """

    block_ids: tuple[BlockId, ...]
    block_hashes: tuple[BlockHash, ...]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.block_ids) * self.block_size


class KVBlockManager:
    """Allocates fixed-size KV blocks to requests, with a chained-hash prefix cache.

    Invariant: every block is either in the free queue (ref_cnt 0) or held by >= 1 request (ref_cnt > 0).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 cache_salt: bytes = b"", eviction: EvictionPolicy | None = None,
                 lifecycle: LifecycleConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._salt = cache_salt
        self._blocks = [_Block(BlockId(i)) for i in range(num_blocks)]
        self._free: OrderedDict[BlockId, None] = OrderedDict((b.block_id, None) for b in self._blocks)
        self._cached: dict[BlockHash, BlockId] = {}
        self._tables: dict[str, list[BlockId]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # hashes of each request's registered full blocks
        self._memo: dict[str, list[BlockHash]] = {}  # block hashes of each live request's token sequence
        # Which cached free block is reused first: None = least recently freed (exact LRU, O(1)); a policy
        # chooses among the `lifecycle.eviction_sample` least recently freed.
        self.eviction = None if isinstance(eviction, LRUPolicy) else eviction
        self.lifecycle = lifecycle or LifecycleConfig()
        self.clock = clock
        # (block id, hash) of blocks registered since the owner last took them (the tiers copy them down)
        self.newly_cached: list[tuple[BlockId, BlockHash]] | None = None
        self._pins: dict[str, float] = {}  # prewarm holders -> pinned until (clock seconds)
        self._cold: dict[str, int] = {}  # long contexts: leading blocks a request moved off the device

    # ---- queries -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by live requests; cached-but-free blocks count as free."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def block_ids(self, request_id: str) -> tuple[BlockId, ...]:
        return tuple(self._tables.get(request_id, ()))

    def ref_count(self, block_id: BlockId) -> int:
        return self._blocks[block_id].ref_cnt

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix(self, token_ids: Sequence[int], request_id: str | None = None) -> PrefixHit:
        """Longest run of cached full blocks at the start of `token_ids`. Changes no allocation.

        At least one token is always left out of the hit so the caller has something to compute (the
        last prompt token's logits give the first output token). With `request_id`, the sequence's block
        hashes are memoized for that request (its tokens only ever grow), so a request that waits for blocks
        and asks again every step, and its later `cache_full_blocks`, hash each block once; `forget` drops it.
        """
        if not self.enable_prefix_caching:
            return PrefixHit((), (), self.block_size)
        usable = token_ids[:max(len(token_ids) - 1, 0)]
        num_full = len(usable) // self.block_size
        if request_id is None:
            hashes = hash_blocks(usable, self.block_size, extra_key=self._salt)
        else:
            hashes = self._sequence_hashes(request_id, token_ids, num_full)[:num_full]
        hit: list[BlockId] = []
        for h in hashes:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        return PrefixHit(tuple(hit), tuple(hashes), self.block_size)

    # ---- mutations -----------------------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int, prefix: PrefixHit | None = None
                 ) -> list[BlockId] | None:
        """Grow `request_id`'s table to cover `num_tokens` tokens; return the ids appended, or None.

        `prefix` may only be given for a request holding no blocks: its blocks are shared (ref count +1)
        instead of allocated. On None nothing changed (not enough free blocks). The caller owns the
        returned ids until it calls `free(request_id)`.
        """
        table = self._tables.get(request_id, [])
        hit = prefix.block_ids if prefix else ()
        if hit and table:
            raise ValueError(f"prefix hit given for {request_id!r}, which already holds blocks")
        num_new = self.blocks_needed(num_tokens) - self._cold.get(request_id, 0) - len(table) - len(hit)
        revived = sum(1 for b in hit if self._blocks[b].ref_cnt == 0)
        if max(num_new, 0) + revived > len(self._free):
            return None
        appended = self._take_refs(hit)
        if num_new > 0:
            appended += self._pop_free_many(num_new)
        self._tables[request_id] = table + appended
        if hit:
            self._hashes[request_id] = list(prefix.block_hashes[:len(hit)])
        return appended

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register the request's blocks that became full and computed, so later requests can hit them."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[request_id]
        hashes = self._hashes.setdefault(request_id, [])
        cold = self._cold.get(request_id, 0)  # logical block i is table[i - cold]
        num_full = min(num_computed_tokens // self.block_size, len(table) + cold)
        if num_full <= len(hashes):
            return
        sequence = self._sequence_hashes(request_id, token_ids, num_full)
        first = len(hashes)
        hashes.extend(sequence[first:num_full])
        now, cached, blocks, new = self.clock(), self._cached, self._blocks, self.newly_cached
        for parent, block_id in zip(sequence[first:num_full], table[first - cold:num_full - cold]):
            block = blocks[block_id]
            if parent not in cached and block.block_hash is None:
                block.block_hash = parent
                cached[parent] = block_id
                block.meta = BlockMeta(parent, Tier.DEVICE, block_id, now, now, 1, 1.0, now)
                if new is not None:
                    new.append((block_id, parent))

    def _sequence_hashes(self, request_id: str, token_ids: Sequence[int], num_blocks: int) -> list[BlockHash]:
        """The memoized chain of block hashes of `request_id`'s tokens, extended to `num_blocks` blocks."""
        memo = self._memo.setdefault(request_id, [])
        if len(memo) < num_blocks:
            bs = self.block_size
            memo.extend(hash_blocks(token_ids[:num_blocks * bs], bs, memo[-1] if memo else None, len(memo),
                                    self._salt))
        return memo

    def hold(self, holder: str, block_ids: Sequence[BlockId]) -> None:
        """Add a reference from `holder` (not a request: e.g. a transfer reading the blocks) to each block,
        so none is reused until `free(holder)`. Blocks already free are taken back off the free queue
        (their contents are intact: a block is only overwritten after it is popped for a new owner)."""
        if holder in self._memo or holder in self._hashes:
            raise ValueError(f"{holder!r} is a request; holders must have ids of their own")
        self._tables.setdefault(holder, []).extend(self._take_refs(block_ids, use=False))

    def _take_refs(self, block_ids: Sequence[BlockId], use: bool = True) -> list[BlockId]:
        """One more reference to each block (off the free queue if it was free); the ids, as a list. `use`:
        a request's prefix hit (counted in the blocks' metadata), not a holder's (a copy or a transfer)."""
        now = self.clock() if block_ids and use else 0.0
        half_life, blocks, free = self.lifecycle.heat_half_life_s, self._blocks, self._free
        for block_id in block_ids:
            block = blocks[block_id]
            if block.ref_cnt == 0:
                del free[block_id]
            block.ref_cnt += 1
            if use and block.meta is not None:
                block.meta.touch(now, half_life)
        return list(block_ids)

    def registered_hashes(self, request_id: str) -> list[BlockHash]:
        """Hashes of the request's registered (full, computed) blocks, from its first block on."""
        return self._hashes.get(request_id, [])

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
        for block_id in table[:count]:
            self._release(block_id)
        del table[:count]
        self._cold[request_id] = self._cold.get(request_id, 0) + count

    def pin(self, holder: str, request_id: str, until_s: float) -> int:
        """Keep `request_id`'s registered (full, cached) blocks on the device until `until_s` or `unpin`,
        marked as prewarmed; returns how many. Call before the request's blocks are freed."""
        table = self._tables.get(request_id, [])
        ids = [b for b in table[:len(self._hashes.get(request_id, ()))] if self._blocks[b].meta is not None]
        self.hold(holder, ids)
        for block_id in ids:
            meta = self._blocks[block_id].meta
            meta.pinned_until_s = max(meta.pinned_until_s, until_s)
            meta.prewarmed = True
        self._pins[holder] = until_s
        return len(ids)

    def unpin(self, holder: str) -> bool:
        if self._pins.pop(holder, None) is None:
            return False
        for block_id in self._tables.get(holder, ()):
            meta = self._blocks[block_id].meta
            if meta is not None:
                meta.pinned_until_s = 0.0
        self.free(holder)
        return True

    def expire_pins(self, now: float) -> list[str]:
        expired = [h for h, until in self._pins.items() if until <= now]
        for holder in expired:
            self.unpin(holder)
        return expired

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(self._tables.get(h, ())) for h in self._pins)

    def forget(self, request_id: str) -> None:
        """The request ended for good: drop its memoized hashes (call after its last `free`)."""
        self._memo.pop(request_id, None)

    def free(self, request_id: str) -> None:
        """Release every block of `request_id` (finish, abort or preemption). Unknown ids are ignored."""
        table = self._tables.pop(request_id, [])
        self._hashes.pop(request_id, None)
        self._cold.pop(request_id, None)
        blocks, free = self._blocks, self._free
        for block_id in reversed(table):
            block = blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt <= 0:
                if block.ref_cnt < 0:
                    raise AssertionError(f"block {block_id} ref count went negative")
                free[block_id] = None

    def _release(self, block_id: BlockId) -> None:
        block = self._blocks[block_id]
        block.ref_cnt -= 1
        if block.ref_cnt < 0:
            raise AssertionError(f"block {block_id} ref count went negative")
        if block.ref_cnt == 0:
            self._free[block_id] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after weights change). Blocks in use are untouched."""
        for block in self._blocks:
            block.block_hash = None
        self._cached.clear()

    def _pop_free_many(self, count: int) -> list[BlockId]:
        if self.eviction is not None:
            return [self._pop_free() for _ in range(count)]
        free, blocks, cached, out = self._free, self._blocks, self._cached, []
        for _ in range(count):  # least recently freed first (exact LRU): the same blocks `_pop_free` takes
            block_id = free.popitem(last=False)[0]
            block = blocks[block_id]
            if block.block_hash is not None:
                if cached.get(block.block_hash) == block_id:
                    del cached[block.block_hash]
                block.block_hash = None
                block.meta = None
            block.ref_cnt = 1
            out.append(block_id)
        return out

    def _pop_free(self) -> BlockId:
        block_id = self._victim()
        del self._free[block_id]
        block = self._blocks[block_id]
        if block.block_hash is not None:  # evict from the prefix cache as the block is reused
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.meta = None
        block.ref_cnt = 1
        return block_id

    def _victim(self) -> BlockId:
        first = next(iter(self._free))
        if self.eviction is None or self._blocks[first].meta is None:
            return first
        metas = []
        for block_id in self._free:
            meta = self._blocks[block_id].meta
            if meta is None:  # holds nothing anyone could hit: the cheapest block to reuse
                return block_id
            metas.append(meta)
            if len(metas) >= self.lifecycle.eviction_sample:
                break
        victim = pick_victim(metas, self.eviction, self.clock(), len(metas))
        return first if victim is None else BlockId(victim.slot)

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def meta(self, block_id: BlockId) -> BlockMeta | None:
        return self._blocks[block_id].meta

    def cached_block(self, block_hash: BlockHash) -> BlockId | None:
        return self._cached.get(block_hash)

    def stage_counts(self, now: float) -> Counter:
        """Device blocks by lifecycle stage: registered blocks by their metadata; unregistered blocks held by
        a request (being filled) are ACTIVE; free unregistered blocks are not counted."""
        counts: Counter = Counter()
        for block in self._blocks:
            if block.meta is not None:
                counts[stage_of(block.meta, now, block.ref_cnt > 0, self.lifecycle)] += 1
            elif block.ref_cnt > 0:
                counts[Stage.ACTIVE] += 1
        return counts
