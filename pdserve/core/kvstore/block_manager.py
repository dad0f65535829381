"""KV block bookkeeping: which block ids each request holds, ref counts, and the prefix cache.

Pure bookkeeping: no tensors, no request objects. The scheduler asks, this module answers with block ids;
it never writes into a request. Tensors indexed by these ids live in the worker's KV pool.

Free blocks sit in an LRU queue (`pdserve.core.kvstore.lru_queue`: O(1) removal from the middle when a cached block is hit
again, runs pushed and popped as arrays). A freed block keeps its hash and stays findable by prefix lookups
until it is popped for reuse: that is the whole prefix cache, with least-recently-freed eviction. A
request's blocks are freed tail first, because the tail of a sequence is the part least likely to be shared
by another request.

State is columnar (numpy arrays indexed by block id: reference counts, whether registered, the lifecycle
metadata in `MetaColumns`), so a request's hundreds of blocks are allocated, registered and freed with a few
array operations: the simulator replays hours of a cluster on this same code.

A long context's leading blocks may live in a lower tier only (`start_cold`, `spill`): its table then starts
at logical block `num_cold_blocks`. Prewarm pins are kept by a part, `pdserve.core.kvstore.block_holds.PrewarmPins`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np

from pdserve.core.kvstore.block_hash import BlockHash, hash_blocks, hash_blocks_array
from pdserve.core.kvstore.block_holds import PrewarmPins
from pdserve.core.kvstore.kv_columns import MetaColumns, MetaView, claim_class, name_code
from pdserve.core.kvstore.kv_meta import EvictionPolicy, LifecycleConfig, LRUPolicy, Stage, Tier, pick_victim
from pdserve.core.kvstore.lru_queue import new_queue
from pdserve.core.kvstore.u64map import new_map

BlockId = NewType("BlockId", int)


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
                 lifecycle: LifecycleConfig | None = None, *, clock: Callable[[], float], codec: str = "float32"
                 ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._salt = cache_salt
        self._ref = np.zeros(num_blocks, np.int32)
        self._registered = np.zeros(num_blocks, bool)  # full, hashed and in the prefix cache (metadata valid)
        self.codec = codec  # the pool's KV format (`MetaColumns.codec` of every block)
        self.cols = MetaColumns(num_blocks, Tier.DEVICE, codec)
        self._free = new_queue(num_blocks)
        self._free.push_many(np.arange(num_blocks))
        self._cached = new_map(num_blocks)  # block hash -> block id (compiled, bulk calls)
        self._tables: dict[str, list[BlockId]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # hashes of each request's registered full blocks
        self._memo: dict[str, list[BlockHash]] = {}  # block hashes of each live request's token sequence
        self._memo_keys: dict[str, np.ndarray] = {}  # the same as uint64 (room to grow: its first len(memo))
        # Which cached free block is reused first: None = least recently freed (exact LRU, O(1)); a policy
        # chooses among the `lifecycle.eviction_sample` least recently freed.
        self.eviction = None if isinstance(eviction, LRUPolicy) else eviction
        self.lifecycle = lifecycle or LifecycleConfig()
        self.clock = clock  # seconds: the engine's (the wall clock's monotonic time, or the simulator's)
        # (block ids, hashes) arrays of blocks registered since the owner last took them (the tiers copy them
        # down), one pair per registration
        self.newly_cached: list[tuple[np.ndarray, np.ndarray]] | None = None
        # Decode-produced blocks are handed over in units of `offload_unit` per request (set by the tiers), or
        # when the request frees its blocks: the registrations held back until then, per request
        self.offload_unit = 1
        self._deferred: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._cold: dict[str, int] = {}  # long contexts: leading blocks a request moved off the device
        self._pins = PrewarmPins(self.cols, self._registered, self.block_ids, self.hold, self.free)
        # registered blocks leaving the prefix cache for reuse: (block ids, their stage names) (counted by
        # `pdserve.core.kvstore.kv_placement`)
        self.on_evict: Callable[[np.ndarray, np.ndarray], None] | None = None
        self._prefetch_used = 0  # blocks moved up ahead of a use that a request's hit took since last asked

    # ---- queries -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._free.size

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by live requests; cached-but-free blocks count as free."""
        return self.num_blocks - self._free.size

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def block_ids(self, request_id: str) -> tuple[BlockId, ...]:
        return tuple(self._tables.get(request_id, ()))

    def registered_hashes(self, request_id: str) -> list[BlockHash]:
        """Hashes of the request's full blocks registered in the prefix cache, in sequence order."""
        return self._hashes.get(request_id, [])

    def sequence_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Hashes of every full block of `token_ids` (this cache's salt included)."""
        return hash_blocks(token_ids, self.block_size, extra_key=self._salt)

    def ref_count(self, block_id: BlockId) -> int:
        return int(self._ref[block_id])

    def is_free(self, block_id: BlockId) -> bool:
        return block_id in self._free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_cold_blocks(self, request_id: str) -> int:
        return self._cold.get(request_id, 0)

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
        keys = np.array(hashes, np.uint64) if request_id is None else self._memo_keys[request_id][:num_full]
        hit = self._cached.get_many(keys[:self._cached.prefix_len(keys)]).tolist()
        return PrefixHit(tuple(hit), tuple(hashes), self.block_size)

    # ---- mutations -----------------------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int, prefix: PrefixHit | None = None,
                 sla_class: str | None = None) -> list[BlockId] | None:
        """Grow `request_id`'s table to cover `num_tokens` tokens; return the ids appended, or None.

        `prefix` may only be given for a request holding no blocks: its blocks are shared (ref count +1)
        instead of allocated, and become `sla_class`'s when it is worth more (`kv_columns.claim_class`). On None
        nothing changed (not enough free blocks). The caller owns the returned ids until it calls `free(request_id)`.
        """
        table = self._tables.get(request_id, [])
        hit = prefix.block_ids if prefix else ()
        if hit and table:
            raise ValueError(f"prefix hit given for {request_id!r}, which already holds blocks")
        num_new = self.blocks_needed(num_tokens) - self._cold.get(request_id, 0) - len(table) - len(hit)
        revived = int(np.count_nonzero(self._ref[list(hit)] == 0)) if hit else 0
        if max(num_new, 0) + revived > self._free.size:
            return None
        appended = self._take_refs(hit)
        if hit and sla_class is not None:
            claim_class(self.cols, np.asarray(hit, np.int64), sla_class)
        if num_new > 0:
            appended += self._pop_free_many(num_new)
        if table:
            table.extend(appended)
        else:
            self._tables[request_id] = list(appended)  # (the caller owns what is returned)
        if hit:
            self._hashes[request_id] = list(prefix.block_hashes[:len(hit)])
        return appended

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                          decode: bool = False, sla_class: str = "default", secret: bool = False) -> None:
        """Register the request's blocks that became full and computed, so later requests can hit them, as
        `sla_class`'s (the request's service tier); `secret`: a `secret`-labelled request's (the tiers never
        write them to an unsealed disk). `decode`: they hold generated tokens (a decode step's): handed to the
        tiers in units (`offload_unit`)."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[request_id]
        hashes = self._hashes.setdefault(request_id, [])
        cold = self._cold.get(request_id, 0)  # logical block i is table[i - cold]
        num_full = min(num_computed_tokens // self.block_size, len(table) + cold)
        if num_full <= len(hashes):
            return
        first = len(hashes)
        if num_full == first + 1:  # a decode step's: one block, in scalar steps
            self._cache_one(request_id, table[first - cold], self._sequence_hashes(request_id, token_ids,
                                                                                   num_full)[first], decode, sla_class,
                            secret)
            return
        new_hashes = self._sequence_hashes(request_id, token_ids, num_full)[first:num_full]
        hashes.extend(new_hashes)
        ids = np.array(table[first - cold:num_full - cold], np.int64)
        keys = self._memo_keys[request_id][first:num_full]
        # an unregistered block whose hash another block holds already stays unregistered (a duplicate)
        unregistered = ~self._registered[ids]
        fresh = np.zeros(len(ids), bool)
        fresh[unregistered] = self._cached.put_new(keys[unregistered], ids[unregistered])
        if not fresh.any():
            return
        new_ids, new_keys = ids[fresh], keys[fresh]
        self._registered[new_ids] = True
        self.cols.fresh(new_ids, new_keys, self.clock(), 1, True)
        if sla_class != "default":
            self.cols.sla_class[new_ids] = name_code(sla_class)
        self.cols.secret[new_ids] = secret
        if self.newly_cached is not None:
            self._hand_over(request_id, new_ids, new_keys, decode)

    def _cache_one(self, request_id: str, block_id: int, block_hash: BlockHash, decode: bool, sla_class: str,
                   secret: bool = False) -> None:
        """`cache_full_blocks` for one block (what most calls are): the same steps on scalars."""
        self._hashes[request_id].append(block_hash)
        if self._registered[block_id] or block_hash in self._cached:  # (a duplicate stays unregistered)
            return
        self._cached[block_hash] = block_id
        self._registered[block_id] = True
        self.cols.fresh(block_id, block_hash, self.clock(), 1, True)
        if sla_class != "default":
            self.cols.sla_class[block_id] = name_code(sla_class)
        self.cols.secret[block_id] = secret
        if self.newly_cached is not None:
            self._hand_over(request_id, np.array([block_id], np.int64), np.array([block_hash], np.uint64), decode)

    def _hand_over(self, request_id: str, ids: np.ndarray, keys: np.ndarray, defer: bool) -> None:
        """Registered blocks go to `newly_cached` (the tiers copy them down after the step); a decode step's
        wait until the request has a unit's worth (or frees its blocks): one copy per unit, not per block."""
        if defer and self.offload_unit > 1:
            runs = self._deferred.setdefault(request_id, [])
            runs.append((ids, keys))
            if sum(len(r[0]) for r in runs) >= self.offload_unit:
                self.hand_over_deferred(request_id)
            return
        self.hand_over_deferred(request_id)  # registered earlier: first, in order
        self.newly_cached.append((ids, keys))

    def hand_over_deferred(self, request_id: str) -> bool:
        """Hand the request's held-back registrations to the tiers now; whether it had any."""
        runs = self._deferred.pop(request_id, None)
        if runs:
            self.newly_cached.extend(runs)
        return bool(runs)

    def _sequence_hashes(self, request_id: str, token_ids: Sequence[int], num_blocks: int) -> list[BlockHash]:
        """The memoized chain of block hashes of `request_id`'s tokens, extended to `num_blocks` blocks (also
        kept as uint64 in `_memo_keys`, for the hash map's bulk calls)."""
        memo = self._memo.setdefault(request_id, [])
        if len(memo) < num_blocks:
            bs, have = self.block_size, len(memo)
            new = hash_blocks_array(token_ids[have * bs:num_blocks * bs], bs, memo[-1] if memo else None, 0,
                                    self._salt)  # only the new blocks' tokens are sliced
            keys = self._memo_keys.get(request_id)
            if keys is None or len(keys) < num_blocks:
                grown = np.empty(max(num_blocks, 2 * have, 16), np.uint64)
                grown[:have] = keys[:have] if keys is not None else ()
                keys = self._memo_keys[request_id] = grown
            keys[have:num_blocks] = new
            memo.extend(new.tolist())
        elif request_id not in self._memo_keys:
            self._memo_keys[request_id] = np.empty(16, np.uint64)
        return memo

    def hold(self, holder: str, block_ids: Sequence[BlockId]) -> None:
        """Add a reference from `holder` (not a request: e.g. a transfer reading the blocks) to each block
        (distinct within one call; a holder may hold a block again in a later call), so none is reused
        until `free(holder)`. Blocks already free are taken back off the free queue
        (their contents are intact: a block is only overwritten after it is popped for a new owner)."""
        if holder in self._memo or holder in self._hashes:
            raise ValueError(f"{holder!r} is a request; holders must have ids of their own")
        self._tables.setdefault(holder, []).extend(self._take_refs(block_ids, use=False))

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

    def _take_refs(self, block_ids: Sequence[BlockId], use: bool = True) -> list[BlockId]:
        """One more reference to each block (off the free queue if it was free); the ids, as a list. `use`:
        a request's prefix hit (counted in the blocks' metadata), not a holder's (a copy or a transfer)."""
        if not len(block_ids):
            return []
        ids = np.asarray(block_ids, np.int64)
        self._free.take_refs(self._ref, ids)
        if use:
            registered = ids[self._registered[ids]]
            if len(registered):
                self.cols.touch(registered, self.clock(), self.lifecycle.heat_half_life_s)
                ahead = registered[self.cols.prefetched[registered]]
                if len(ahead):  # moved up ahead of this use (`kv_placement`): used
                    self._prefetch_used += len(ahead)
                    self.cols.prefetched[ahead] = False
        return list(block_ids)

    def forget(self, request_id: str) -> None:
        """The request ended for good: drop its memoized hashes (call after its last `free`)."""
        self._memo.pop(request_id, None)
        self._memo_keys.pop(request_id, None)

    def free(self, request_id: str) -> None:
        """Release every block of `request_id` (finish, abort or preemption). Unknown ids are ignored."""
        if self._deferred:
            self.hand_over_deferred(request_id)  # copied down now: they leave the request's hands
        table = self._tables.pop(request_id, [])
        self._hashes.pop(request_id, None)
        self._cold.pop(request_id, None)
        if table:
            self._release(table[::-1])

    def _release(self, block_ids: Sequence[BlockId]) -> None:
        """One reference less on each (a holder may hold a block twice); the blocks left unreferenced join
        the free queue in this order (`take_refs` / `release_refs` of the queue: compiled, or numpy)."""
        if len(block_ids):
            self._free.release_refs(self._ref, np.asarray(block_ids, np.int64))

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after weights change). Blocks in use are untouched."""
        self._registered[:] = False
        self._cached.clear()

    def _pop_free_many(self, count: int) -> list[BlockId]:
        """`count` free blocks for a new owner (ref count 1), evicted from the prefix cache: the least
        recently freed (exact LRU) or, with a policy, its picks one at a time."""
        if self.eviction is None:
            ids = self._free.pop_first(count)
            if len(ids) == 1:  # a decode step's one block, in scalar steps
                block_id = int(ids[0])
                if self._registered[block_id]:
                    if self.on_evict is not None:
                        self._evicted(ids)
                    block_hash = int(self.cols.block_hash[block_id])
                    if self._cached.get(block_hash) == block_id:
                        del self._cached[block_hash]
                    self._registered[block_id] = False
                self._ref[block_id] = 1
                return [block_id]
        elif hasattr(self.eviction, "scores"):
            ids = self._victims(count)
        else:
            ids = np.fromiter((self._victim() for _ in range(count)), np.int64, count)
        registered = ids[self._registered[ids]]
        if len(registered):
            if self.on_evict is not None:
                self._evicted(registered)
            self._cached.del_many(self.cols.block_hash[registered], only_if=registered)
            self._registered[registered] = False
        self._ref[ids] = 1
        return ids.tolist()

    def _evicted(self, ids: np.ndarray) -> None:
        """Tell `on_evict` which registered blocks leave, with their stage (free blocks: active or decay)."""
        active = self.clock() - self.cols.last_use_s[ids] < self.lifecycle.active_s
        self.on_evict(ids, np.where(active, Stage.ACTIVE.value, Stage.DECAY.value))

    def _victims(self, count: int) -> np.ndarray:
        """A policy that scores columns (`StagedPolicy.scores`): the first `count` unregistered free blocks (they
        hold nothing anyone could hit), the rest the lowest-scoring of the first `count + eviction_sample - 1`
        free blocks (least recently freed first), taken off the queue."""
        want, seen = count + self.lifecycle.eviction_sample - 1, []
        for run in self._free.runs():
            seen.append(run[:want - sum(map(len, seen))].copy())
            if sum(map(len, seen)) >= want:
                break
        cand = np.concatenate(seen)
        free = cand[~self._registered[cand]][:count]
        if len(free) < count:
            reg = cand[self._registered[cand]]
            order = np.argsort(self.eviction.scores(self.cols, reg, self.clock()), kind="stable")
            free = np.concatenate([free, reg[np.sort(order[:count - len(free)])]])
        self._free.remove_many(free)
        return free

    def _victim(self) -> BlockId:
        """Take the policy's pick among the `eviction_sample` least recently freed blocks off the queue (an
        unregistered one first: it holds nothing anyone could hit)."""
        sample: list[MetaView] = []
        for run in self._free.runs():
            for block_id in run.tolist():
                if not self._registered[block_id]:
                    self._free.remove(block_id)
                    return BlockId(block_id)
                sample.append(self.cols.view(block_id))
                if len(sample) >= self.lifecycle.eviction_sample:
                    break
            if len(sample) >= self.lifecycle.eviction_sample:
                break
        victim = pick_victim(sample, self.eviction, self.clock(), len(sample)) or sample[0]
        self._free.remove(victim.slot)
        return BlockId(victim.slot)

    # ---- prewarm pins (`pdserve.core.kvstore.block_holds`) -----------------------------------------------------
    def pin(self, holder: str, request_id: str, until_s: float) -> int:
        return self._pins.pin(holder, request_id, until_s)

    def unpin(self, holder: str) -> bool:
        return self._pins.unpin(holder)

    def expire_pins(self, now: float) -> list[str]:
        return self._pins.expire(now)

    @property
    def has_pins(self) -> bool:
        return bool(self._pins)

    @property
    def num_pinned_blocks(self) -> int:
        return self._pins.num_blocks

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def meta(self, block_id: BlockId) -> MetaView | None:
        return self.cols.view(block_id) if self._registered[block_id] else None

    def cached_hashes(self) -> np.ndarray:
        """Each block's hash where it is in the prefix cache, 0 elsewhere (uint64, a copy): what a worker's
        `kv_cache` events diff (`pdserve.core.kvstore.cache_events`)."""
        return np.where(self._registered, self.cols.block_hash, 0).astype(np.uint64)

    def cached_block(self, block_hash: BlockHash) -> BlockId | None:
        return self._cached.get(block_hash)

    def cached_ids(self, hashes: np.ndarray) -> np.ndarray:
        """The block cached under each of `hashes` (uint64), -1 where none is."""
        return self._cached.get_many(hashes)

    def adopt(self, block_ids: np.ndarray, hashes: np.ndarray, src: MetaColumns, src_slots: np.ndarray) -> int:
        """Blocks a holder took (`allocate`) were loaded with the KV of `hashes` from `src`'s `src_slots` (a
        promotion ahead of an expected use, `pdserve.core.kvstore.kv_placement`): they join the prefix cache with
        that metadata, flagged `prefetched`, and are not copied down again (they came from below). A hash cached
        meanwhile keeps its block (that block stays unregistered). Returns how many joined."""
        if not len(block_ids):
            return 0
        fresh = self._cached.put_new(hashes, block_ids)
        ids = block_ids[fresh]
        if len(ids):
            self._registered[ids] = True
            self.cols.copy_from(src, src_slots[fresh], ids)
            self.cols.ready[ids] = True
            self.cols.prefetched[ids] = True
        return len(ids)

    def take_prefetch_used(self) -> int:
        """Blocks moved up ahead of a use that requests' hits took since the last call."""
        used, self._prefetch_used = self._prefetch_used, 0
        return used

    def cached_as(self, block_ids: np.ndarray, hashes: np.ndarray) -> np.ndarray:
        """Whether each block is still the one cached under its hash (the prefix cache maps hashes[j] to
        block_ids[j]): registered, and with that hash. From the blocks' own columns, not the hash map."""
        return self._registered[block_ids] & (self.cols.block_hash[block_ids] == hashes)

    def stage_counts(self, now: float) -> Counter:
        """Device blocks by lifecycle stage: registered blocks by their metadata; unregistered blocks held by
        a request (being filled) are ACTIVE; free unregistered blocks are not counted."""
        held = self._ref > 0
        registered = np.flatnonzero(self._registered)
        counts = self.cols.stages(registered, held[registered], now, self.lifecycle)
        counts[Stage.ACTIVE] += int(np.count_nonzero(held & ~self._registered))
        return +counts
