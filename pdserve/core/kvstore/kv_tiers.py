"""The KV store of one worker across tiers: device blocks (the `KVBlockManager`), a host tier and a disk
tier (`TierIndex` each), and the I/O between them as explicit operations. Pure Python: the scheduler and
the engine call it on one thread; an I/O runner (`pdserve.kv.tier_io`, or the simulator's) moves the
bytes and reports each operation's end. The real worker and the simulator run this same code.

Placement (write-through, as SGLang HiCache's default): a block is copied device -> host as soon as it
is full and registered (`offload`), and host -> disk once it is in host (`flush`), so a block evicted from
a tier above is already below and eviction never waits for a copy. While its copy runs, the device block is
held (not reusable) and the host entry is `busy`; nothing unready is ever served. Blocks a decode step fills
go down in runs of `WRITE_THROUGH_TOKENS` per request (LMCache's chunk), the rest when the request frees its
blocks (finish, abort, preemption): one copy per run rather than one per block as it fills, and a block is in
use on the device (so not evictable) until its request frees it.

Lookup continues a device prefix hit block by block through host, then disk. Host hits are loaded into
fresh device blocks by the executor before the step's forward (`KVLoad`s in the scheduler's output). Disk
hits are first prefetched into host by the I/O runner (`prefetch`); the request waits for them, never
for a miss. A disk file whose checksum or header does not match is dropped and counted, never served.

Below them all, the shared pool (`--kv-remote`, `kv_remote.RemoteBook`: what this worker knows of it): a
block that reaches host is published there too (write-through, as to disk; secret ones only when sealed),
and a lookup whose prefix runs out locally asks the pool about the rest (a probe) and fetches the leading run it
holds into host, as disk hits are prefetched; the request waits for both.

Operations (`KVOp.kind`): offload (device blocks -> host slots), flush (host slots -> disk files),
prefetch (disk files -> host slots), delete (disk files of evicted entries); the pool's: probe (which of these
hashes it holds), fetch (pool -> host slots), publish (host slots -> pool).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from pdserve.core.kvstore.block_hash import BlockHash
from pdserve.core.kvstore.block_manager import BlockId, KVBlockManager
from pdserve.core.kvstore.kv_columns import TIER_CODE, name_code
from pdserve.core.kvstore.kv_meta import BlockMeta, EvictionPolicy, LifecycleConfig, Stage, Tier
from pdserve.core.kvstore.kv_ops import (KVLoad, KVOp, PlacementStats, TierHit,  # noqa: F401 (KVLoad, TierHit
                                         TierStats)  # re-exported)
from pdserve.core.kvstore.kv_remote import ABSENT, DOWN, RemoteBook
from pdserve.core.kvstore.kv_tier_index import TierIndex


# Decode-produced blocks are written through in runs of this many tokens per request (and the rest when the
# request frees its blocks), LMCache's chunk: one copy per run instead of one per block as each fills
WRITE_THROUGH_TOKENS = 256
PREFETCH_HOLD_S = 5.0  # a block prefetched from disk stays in host at least this long, or until loaded
# blocks being written to the shared pool at once (held busy in host meanwhile), at least; or a quarter of the host
# tier, if more (a long prompt's step fills hundreds): more are skipped, counted
MAX_PUBLISHING = 256
_FETCHED = (TIER_CODE[Tier.DISK], TIER_CODE[Tier.REMOTE])  # `from_tier` of a block read into host from below


class TieredKV:
    def __init__(self, blocks: KVBlockManager, host: TierIndex | None, disk: TierIndex | None,
                 block_bytes: int, max_age_s: float = math.inf, remote: RemoteBook | None = None) -> None:
        if (disk is not None or remote is not None) and host is None:
            raise ValueError("a disk KV tier or a shared pool needs a host tier to stage through")
        self.blocks = blocks
        self.host = host
        self.disk = disk
        self.remote = remote  # what this worker knows of the shared pool (None: no pool)
        self.remote_sealed = False  # (`TierCapacity.remote_sealed`) unsealed: a secret block never goes there
        self._publishing = 0  # blocks being written to the pool
        self._tiers = [t for t in (host, disk) if t is not None]  # (asked at every simulated step)
        self.block_bytes = block_bytes
        self.disk_writable = disk is not None
        self.disk_sealed = False  # (`TierCapacity.disk_sealed`) unsealed: a secret block never goes to disk
        self.stats = TierStats()
        self.moves = PlacementStats()  # promotions, demotions, prefetches (`kv_placement`)
        self.max_age_s = max_age_s  # KV produced longer ago is never served (`kv_meta.servable`)
        self.lifecycle = None  # a `kv_placement.KVLifecycle`, whose due work `after_step` runs
        self._ahead: set[int] = set()  # prefetch operations ahead of an expected use (not a request's)
        self._ahead_done = False  # the operation `complete` is finishing is one of those
        self._ids = itertools.count()
        self._ops: dict[int, KVOp] = {}
        self._new_ops: list[KVOp] = []
        self._loading: dict[tuple[int, int], BlockHash] = {}  # (device block, host slot) -> hash
        self.stale: list[BlockHash] = []  # disk files found at start that this run will not index
        blocks.newly_cached = [] if host is not None else None
        blocks.offload_unit = max(1, WRITE_THROUGH_TOKENS // blocks.block_size)

    def tiers(self) -> list[TierIndex]:
        return self._tiers

    # ---- scheduler side ---------------------------------------------------------------------------------
    def extend(self, hashes: Sequence[BlockHash]) -> TierHit:
        """Continue a prefix through host, disk and the shared pool: `hashes` are the block hashes right after
        the device hit. Starts prefetching the disk part, or asking the pool about the rest and fetching what it
        holds (once); the request should wait while any is in flight."""
        if self.host is None:
            return TierHit()
        if self.disk is None:
            num_ready, in_flight = self.host.ready_prefix(hashes)
            if num_ready:
                servable = self._servable(self.host, hashes[:num_ready])
                in_flight, num_ready = in_flight and servable == num_ready, servable
            hit = TierHit(tuple(hashes[:num_ready]), in_flight)
        else:
            hit, fetching = self._extend_disk(hashes)
            if fetching:
                return hit
        if self.remote is None or hit.waiting or len(hit.host) == len(hashes):
            return hit
        keep = [self.host.get(h) for h in hit.host]
        return TierHit(hit.host, self._extend_remote(hashes[len(hit.host):], keep))

    def _extend_remote(self, rest: Sequence[BlockHash], keep: Sequence[BlockMeta]) -> bool:
        """Ask the shared pool about `rest` (a prefix's blocks after its local hit), or fetch into host the
        leading run it is known to hold; whether the request should wait for that."""
        now = self.blocks.clock()
        if not self.remote.up(now):
            return False
        known = self.remote.leading(rest)
        if known:
            return self._prefetch(list(rest[:known]), keep, source=Tier.REMOTE) > 0
        ask, waiting = self.remote.to_probe(rest, now)
        if ask:
            self._submit("probe", tuple(ask))
            return True
        return waiting

    def _extend_disk(self, hashes: Sequence[BlockHash]) -> tuple[TierHit, bool]:
        """`extend` with a disk tier: the hit, and whether a disk part of it was found (prefetching it now, or no
        host room for it: either way the pool is not asked)."""
        host_run: list[BlockHash] = []
        to_fetch: list[BlockHash] = []
        in_host: list[BlockMeta] = []  # ready host entries of this prefix: a prefetch for it must not evict them
        in_flight = False
        for h in hashes:
            meta = self.host.get(h)
            if meta is not None:
                if not meta.ready:
                    in_flight = True
                    break
                if not self._servable(self.host, [h]):
                    break
                in_host.append(meta)
                if not to_fetch:
                    host_run.append(h)
                continue
            if self.disk.ready(h) is None or not self._servable(self.disk, [h]):
                break
            to_fetch.append(h)
        if to_fetch and self._prefetch(to_fetch, in_host):
            in_flight = True  # else no host slot could be had: serve the host run, recompute the rest
        return TierHit(tuple(host_run), in_flight), bool(to_fetch)

    def _servable(self, tier: TierIndex, hashes: Sequence[BlockHash]) -> int:
        """How many leading `hashes` (ready in `tier`) may be served (`kv_meta.servable`: not older than the
        retention limit, in the tier's own format, the one its loads decode); those that may not are dropped
        (unless being read), counted."""
        slots, now = tier.slots(hashes), self.blocks.clock()
        cols = tier.cols
        stale = now - cols.produced_at_s[slots] > self.max_age_s
        bad = stale | (cols.codec[slots] != name_code(tier.codec))
        if not bad.any():
            return len(slots)
        for slot, why in zip(slots[bad].tolist(), np.where(stale[bad], "stale", "codec").tolist()):
            self.stats.unservable[why] += 1
            if not cols.busy[slot]:
                tier.discard(int(cols.block_hash[slot]))
        return int(np.argmax(bad))

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[BlockId], count: bool = True
             ) -> list[KVLoad]:
        """Loads of host entries `hashes` (distinct) into fresh device blocks `block_ids`; each entry stays busy
        until `loads_done`. With `count`, the hit tokens are counted by the tier each block was found in."""
        if not len(hashes):
            return []
        now, host = self.blocks.clock(), self.host
        cols = host.cols
        slots = host.slots(hashes)
        np.add.at(cols.busy, slots, 1)
        from_tier = cols.from_tier[slots]
        fetched = np.isin(from_tier, _FETCHED)
        if count:
            for tier in (Tier.HOST, Tier.DISK, Tier.REMOTE):
                n = int(np.count_nonzero(from_tier == TIER_CODE[tier])) if tier is not Tier.HOST else (
                    len(slots) - int(np.count_nonzero(fetched)))
                if n:
                    self.stats.hit_tokens[tier] += n * self.blocks.block_size
        cols.pinned_until_s[slots[fetched]] = 0.0  # the prefetch hold: it has been used
        cols.from_tier[slots] = 0
        self._used(cols, slots)
        self.moves.moves[("promotion", Stage.ACTIVE.value, Tier.HOST.value, Tier.DEVICE.value)] += len(slots)
        used = list(dict.fromkeys(hashes))
        host.touch_many(used, now)
        if self.disk is not None:  # in use: not the disk tier's next victim either
            self.disk.touch_many([h for h in used if h in self.disk.entries], now)
        slot_list = slots.tolist()
        loads = list(map(KVLoad._make, zip(block_ids, slot_list)))
        self._loading.update(zip(zip(block_ids, slot_list), hashes))
        self.stats.bytes_out[Tier.HOST] += len(loads) * self.block_bytes
        self.stats.bytes_in[Tier.DEVICE] += len(loads) * self.block_bytes
        return loads

    def promote(self, hashes: np.ndarray, block_ids: Sequence[BlockId]) -> list[KVLoad]:
        """Loads of host entries `hashes` (distinct, ready) into device blocks `block_ids` a holder took, ahead of
        an expected use (`kv_placement`): busy until `loads_done`, not counted as hits or uses."""
        slots = self.host.slots(hashes)
        self.host.cols.busy[slots] += 1
        slot_list = slots.tolist()
        loads = list(map(KVLoad._make, zip(block_ids, slot_list)))
        self._loading.update(zip(zip(block_ids, slot_list), hashes.tolist()))
        self.stats.bytes_out[Tier.HOST] += len(loads) * self.block_bytes
        self.stats.bytes_in[Tier.DEVICE] += len(loads) * self.block_bytes
        return loads

    def loads_done(self, loads: Sequence[KVLoad]) -> None:
        pop = self._loading.pop
        hashes = [h for h in (pop((load.block_id, load.host_slot), None) for load in loads) if h is not None]
        self.host.unbusy_many(hashes)

    # ---- long contexts: a request's oldest blocks read from host ---------------------------------------------
    def hold_cold(self, hashes: Sequence[BlockHash], count_hits: bool = False) -> tuple[int, bool]:
        """Keep the leading host-ready blocks of `hashes` in host for a request that reads them from there
        (busy until `release_cold`). Returns (how many, whether the next one is still being copied).
        `count_hits`: they are prefix hits (a prompt's head found in host), counted by tier."""
        count = 0
        for h in hashes:
            meta = self.host.ready(h)
            if meta is None:
                return count, self.host.get(h) is not None
            meta.busy += 1
            if count_hits:
                self._used(self.host.cols, np.array([meta.slot]))
                self.stats.hit_tokens[meta.from_tier or Tier.HOST] += self.blocks.block_size
                if meta.from_tier in (Tier.DISK, Tier.REMOTE):
                    meta.pinned_until_s = 0.0  # the prefetch hold: it has been used
                meta.from_tier = None
            count += 1
        return count, False

    def release_cold(self, hashes: Sequence[BlockHash]) -> None:
        """The request no longer reads these; entries it was receiving (never completed) are dropped."""
        for h in hashes:
            meta = self.host.get(h)
            if meta is None:
                continue
            if not meta.ready:
                self.host.discard(h)
            elif meta.busy:
                meta.busy -= 1

    def expect_cold(self, hashes: Sequence[BlockHash]) -> bool:
        """Book host entries for blocks a delivery writes straight into host (a long prompt's head on a
        decode worker): unready, held for the request. All or nothing; False when host has no room now or
        one of them is already there or on its way."""
        now, booked = self.blocks.clock(), []
        for h in hashes:
            meta = self.host.reserve(h, now)
            if meta is None:
                for b in booked:
                    self.host.discard(b)
                return False
            meta.busy = 1
            booked.append(h)
        return True

    def commit_cold(self, hashes: Sequence[BlockHash]) -> None:
        """The delivery into the entries `expect_cold` booked completed (verified): they are servable."""
        arrived = [h for h in hashes if (m := self.host.get(h)) is not None and not m.ready]
        for h in arrived:
            self.host.commit(h)
        self.stats.bytes_in[Tier.HOST] += len(arrived) * self.block_bytes
        self._flush(arrived)

    def _used(self, cols, slots: np.ndarray) -> None:
        """A request reads these host entries: those prefetched ahead of it are used prefetches."""
        ahead = slots[cols.prefetched[slots]]
        if len(ahead):
            self.moves.prefetch["used"] += len(ahead)
            cols.prefetched[ahead] = False

    def host_slot(self, block_hash: BlockHash) -> int:
        return self.host.slot(block_hash)

    def cold_slots(self, hashes: Sequence[BlockHash]) -> tuple[int, ...]:
        return tuple(self.host.slots(hashes).tolist())

    # ---- engine side: after each step, the runner's results in, new operations out -----------------------
    def after_step(self) -> list[KVOp]:
        """Copy newly registered device blocks down; reclaim above the watermarks. Returns new operations."""
        if self.host is not None and self.blocks.newly_cached:
            cached, self.blocks.newly_cached = self.blocks.newly_cached, []
            self._offload(cached)
        now = self.blocks.clock()
        if self.lifecycle is not None and self.lifecycle.next_due_s() <= now:
            self.lifecycle.run_due(now)
        for tier in self.tiers():
            tier.reclaim(now)
        if self.remote is not None:
            self.remote.sweep(now)
        if self.disk is not None and (self.disk.evicted or self.stale):
            evicted, self.disk.evicted = self.disk.evicted, []
            # not a hash indexed again since: its new file is written by a flush queued before this delete
            gone = [h for h in evicted + self.stale if h not in self.disk.entries]
            if gone:
                self._submit("delete", tuple(dict.fromkeys(gone)))
            self.stale = []
        return self.take_ops()

    def has_step_work(self, now: float) -> bool:
        """Whether `after_step` at `now` would do anything (a simulator skips the call when not)."""
        return self.next_work_s() <= now

    def next_work_s(self) -> float:
        """From when `after_step` would do something if nothing else changes: -inf at once, inf never."""
        if self.blocks.newly_cached or self._new_ops or self.stale:
            return -math.inf
        due = self.lifecycle.next_due_s() if self.lifecycle is not None else math.inf
        for tier in self._tiers:
            if tier.evicted:
                return -math.inf
            due = min(due, tier.next_reclaim_s())
        return due

    @property
    def has_new_ops(self) -> bool:
        return bool(self._new_ops)

    def take_ops(self) -> list[KVOp]:
        """Operations created since the last call (a lookup outside a step may start a prefetch)."""
        new, self._new_ops = self._new_ops, []
        return new

    def complete(self, op_id: int, failures: Mapping[int, str] | None = None) -> None:
        """The runner finished operation `op_id`; `failures` maps each hash that failed to why: "corrupt"
        (prefetch: a damaged file), "missing" (prefetch: the file is gone), "disk_full" (flush), or any
        other text. Hashes not in it succeeded."""
        op = self._ops.pop(op_id)
        failures = failures or {}
        self._ahead_done = op_id in self._ahead
        self._ahead.discard(op_id)
        if op.kind == "offload" and not failures:  # the common case, in one pass
            self.host.commit_slots(op.hashes, op.dst)
            self._moved(Tier.DEVICE, Tier.HOST, len(op.hashes))
        else:
            done = getattr(self, f"_done_{op.kind}")
            for h in _ints(op.hashes):
                done(h, failures.get(h))
        if op.kind == "offload":
            self.blocks.free(op.holder)
            if self.disk is not None or self.remote is not None:
                self._flush([h for h in _ints(op.hashes) if h not in failures])
        for reason in failures.values():
            if reason == ABSENT:  # (a probe's answer, not a failure)
                continue
            self.stats.failed_ops[op.kind] += 1
            if reason == "corrupt":
                self.stats.corrupt[Tier.REMOTE if op.kind == "fetch" else Tier.DISK] += 1
            elif reason == "disk_full":
                self.stats.disk_full += 1
                self.disk_writable = False  # stop writing; keep serving what is there

    def _done_offload(self, h: BlockHash, failed: str | None) -> None:
        if failed:
            self.host.discard(h)
            return
        self.host.commit(h)
        self._moved(Tier.DEVICE, Tier.HOST)

    def _done_flush(self, h: BlockHash, failed: str | None) -> None:
        meta = self.host.get(h)
        if meta is not None and meta.busy:
            meta.busy -= 1
        if failed:
            self.disk.discard(h)
            return
        self.disk.commit(h)
        self._moved(Tier.HOST, Tier.DISK)

    def _done_prefetch(self, h: BlockHash, failed: str | None) -> None:
        if failed:
            self.host.discard(h)
            if failed in ("corrupt", "missing"):
                self.disk.discard(h)  # never offered again
            return
        self.host.commit(h)
        meta = self.host.get(h)
        meta.from_tier = Tier.DISK
        self._moved(Tier.DISK, Tier.HOST)
        if self._ahead_done:  # ahead of an expected use: no request waits, nothing pinned
            meta.prefetched = True
            self.moves.moves[("promotion", Stage.DECAY.value, Tier.DISK.value, Tier.HOST.value)] += 1
            return
        # Held until the waiting request loads it (or PREFETCH_HOLD_S passes): two lookups prefetching into
        # a small host tier must not evict each other's blocks forever.
        meta.pinned_until_s = max(meta.pinned_until_s, self.blocks.clock() + PREFETCH_HOLD_S)
        self.moves.moves[("promotion", Stage.ACTIVE.value, Tier.DISK.value, Tier.HOST.value)] += 1

    def _done_delete(self, h: BlockHash, failed: str | None) -> None:
        pass

    def _done_probe(self, h: BlockHash, failed: str | None) -> None:
        self.remote.probed(h, failed, self.blocks.clock())

    def _done_fetch(self, h: BlockHash, failed: str | None) -> None:
        if failed:
            self.host.discard(h)
            # not there (evicted), damaged (never read again here), or the pool down: a miss
            if failed == "corrupt":
                self.remote.refuse(h)
            self.remote.forget(h)
            self.remote.probed(h, DOWN if failed == DOWN else ABSENT, self.blocks.clock())
            return
        self.host.commit(h)
        meta = self.host.get(h)
        meta.from_tier = Tier.REMOTE
        meta.pinned_until_s = max(meta.pinned_until_s, self.blocks.clock() + PREFETCH_HOLD_S)
        self._moved(Tier.REMOTE, Tier.HOST)
        self.moves.moves[("promotion", Stage.ACTIVE.value, Tier.REMOTE.value, Tier.HOST.value)] += 1

    def _done_publish(self, h: BlockHash, failed: str | None) -> None:
        self._publishing -= 1
        meta = self.host.get(h)
        if meta is not None and meta.busy:
            meta.busy -= 1
        if failed == DOWN:
            self.remote.down(self.blocks.clock())
        elif not failed:
            self.remote.learn(h, written=True)
            self._moved(Tier.HOST, Tier.REMOTE)

    def _moved(self, src: Tier, dst: Tier, count: int = 1) -> None:
        self.stats.bytes_out[src] += count * self.block_bytes
        self.stats.bytes_in[dst] += count * self.block_bytes

    # ---- operations ---------------------------------------------------------------------------------------
    def _submit(self, kind: str, hashes: tuple, src: tuple = (), dst: tuple = ()) -> KVOp:
        op = KVOp(next(self._ids), kind, hashes, src, dst)
        self._ops[op.op_id] = op
        self._new_ops.append(op)
        return op

    def _offload(self, cached: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Write newly registered device blocks through to host: `cached` holds (block ids, hashes) arrays."""
        ids, keys = cached[0] if len(cached) == 1 else map(np.concatenate, zip(*cached))
        if len(cached) > 1:  # a hash registered twice since (freed and registered again): its last block
            _, last = np.unique(keys[::-1], return_index=True)
            if len(last) < len(keys):
                keep = np.sort(len(keys) - 1 - last)
                ids, keys = ids[keep], keys[keep]
        live = self.blocks.cached_as(ids, keys)  # not reused for something else since
        if not live.all():
            ids, keys = ids[live], keys[live]
        if not len(ids):
            return
        booked, slots, rest = self.host.reserve_many(keys, self.blocks.clock(), self.blocks.cols, ids)
        if len(booked):  # (an offload's hashes, blocks and slots are arrays: hundreds per prompt)
            src = ids[booked]
            op = self._submit("offload", keys[booked], src, slots)
            self.blocks.hold(op.holder, src.tolist())
        if len(rest):
            self._flush(keys[rest].tolist())  # in host already (e.g. loaded from there): make sure disk has it

    def _flush(self, hashes: Sequence[BlockHash]) -> None:
        """Copy the host-ready entries of `hashes` to disk (those not there yet, while it has room) and to the
        shared pool (those it is not known to hold)."""
        if self.remote is not None and len(hashes):
            self._publish(hashes)
        if self.disk is None or not self.disk_writable or not len(hashes):
            return
        keys = np.fromiter(dict.fromkeys(_ints(hashes)), np.uint64)
        keys = keys[self.host.present_mask(keys) == 1]
        if not len(keys):
            return
        src = self.host.slots(keys)
        if not self.disk_sealed:  # secret KV is never written in the clear (`pdserve.core.pd.sensitivity`)
            secret = self.host.cols.secret[src]
            if secret.any():
                self.stats.secret_off_disk += int(np.count_nonzero(secret))
                keys, src = keys[~secret], src[~secret]
                if not len(keys):
                    return
        booked, _, _ = self.disk.reserve_many(keys, self.blocks.clock(), self.host.cols, src)
        if len(booked):
            src = src[booked]
            self.host.cols.busy[src] += 1
            self._submit("flush", tuple(keys[booked].tolist()), tuple(src.tolist()))

    def _publish(self, hashes: Sequence[BlockHash]) -> None:
        """Write the host-ready entries of `hashes` the pool is not known to hold through to it (secret ones only
        when it is sealed), at most `MAX_PUBLISHING` blocks (or a quarter of host) at once: the rest skipped,
        counted."""
        if not self.remote.up(self.blocks.clock()):
            return
        known = self.remote.known
        keys = [h for h in dict.fromkeys(_ints(hashes)) if h not in known or h in self.remote.bad]
        keys = np.asarray(keys, np.uint64)
        keys = keys[self.host.present_mask(keys) == 1] if len(keys) else keys
        if not len(keys):
            return
        src = self.host.slots(keys)
        if not self.remote_sealed:  # secret KV is never written in the clear (`pdserve.core.pd.sensitivity`)
            secret = self.host.cols.secret[src]
            self.stats.secret_off_remote += int(np.count_nonzero(secret))
            keys, src = keys[~secret], src[~secret]
        room = max(max(MAX_PUBLISHING, self.host.capacity // 4) - self._publishing, 0)
        self.stats.remote_skipped += max(len(keys) - room, 0)
        keys, src = keys[:room], src[:room]
        if len(keys):
            self.host.cols.busy[src] += 1
            self._publishing += len(keys)
            self._submit("publish", tuple(keys.tolist()), tuple(src.tolist()))

    def prefetch_ahead(self, hashes: list[BlockHash], keep: Sequence[BlockMeta] = ()) -> int:
        """Start reading disk blocks `hashes` into host ahead of an expected use (`kv_placement`), without
        evicting the host entries `keep`; how many started."""
        return self._prefetch(hashes, keep, ahead=True)

    def _prefetch(self, hashes: list[BlockHash], keep: Sequence[BlockMeta] = (), ahead: bool = False,
                  source: Tier = Tier.DISK) -> int:
        """Start fetching `hashes` (distinct, on disk or in the shared pool: `source`) into host without evicting
        the host entries `keep`; how many started (the first ones, while host had room)."""
        keys = np.asarray(hashes, np.uint64)
        for meta in keep:
            meta.busy += 1
        try:
            src = (self.disk.cols, self.disk.slots(keys)) if source is Tier.DISK else ()  # (the pool's: fresh)
            booked, slots, _ = self.host.reserve_many(keys, self.blocks.clock(), *src)
        finally:
            for meta in keep:
                meta.busy -= 1
        if not len(booked):  # (fewer than asked: host full of busy or pinned blocks, the rest later)
            return 0
        kind = "prefetch" if source is Tier.DISK else "fetch"
        op = self._submit(kind, tuple(keys[booked].tolist()), dst=tuple(slots.tolist()))
        if ahead:
            self._ahead.add(op.op_id)
        return len(booked)

    # ---- what the metrics show --------------------------------------------------------------------------
    def stage_counts(self) -> dict[str, dict[str, int]]:
        now = self.blocks.clock()
        out = {Tier.DEVICE.value: self.blocks.stage_counts(now)}
        for tier in self.tiers():
            out[tier.tier.value] = tier.stage_counts(now)
        return {t: {s.value: int(c.get(s, 0)) for s in Stage} for t, c in out.items()}

    def capacities(self) -> dict[str, int]:
        out = {Tier.DEVICE.value: self.blocks.num_blocks}
        out.update({t.tier.value: t.capacity for t in self.tiers()})
        return out

    @property
    def num_ops_in_flight(self) -> int:
        return len(self._ops)


def _ints(values) -> Sequence[int]:
    """An operation's hashes as Python ints (an offload's are a uint64 array)."""
    return values.tolist() if isinstance(values, np.ndarray) else values


def capacity_blocks(blocks: KVBlockManager, tiers: TieredKV | None) -> int:
    """The KV blocks a worker can hold, all its tiers together (what its `ready` event reports)."""
    return sum(tiers.capacities().values()) if tiers is not None else blocks.num_blocks


def build_tiered_kv(blocks: KVBlockManager, capacity, eviction: EvictionPolicy, lifecycle: LifecycleConfig,
                    restored: Sequence[tuple[int, float, float]] = (), wall_now: float | None = None,
                    max_age_s: float = math.inf) -> TieredKV:
    """Tiers sized by `capacity` (`host_blocks`, `disk_blocks`, `block_bytes`, each tier's codec), the disk
    tier re-indexing `restored` blocks [(hash, produced-at, last use) in wall-clock seconds] from an earlier run,
    aged by `wall_now` (the wall clock now, which the caller reads: core reads no clock); those produced more
    than `max_age_s` ago are deleted instead (the retention limit, `kv_meta.servable`)."""
    named = lambda name: blocks.codec if name in (None, "auto") else name  # noqa: E731 ("auto": the pool's)
    host_codec, disk_codec = named(capacity.host_codec), named(capacity.disk_codec or capacity.host_codec)
    host = TierIndex(Tier.HOST, capacity.host_blocks, eviction, lifecycle, keep_evicted=False, codec=host_codec)
    disk = (TierIndex(Tier.DISK, capacity.disk_blocks, eviction, lifecycle, codec=disk_codec)
            if capacity.disk_blocks else None)
    remote = RemoteBook() if getattr(capacity, "remote", False) else None
    tiers = TieredKV(blocks, host, disk, capacity.block_bytes, max_age_s, remote)
    tiers.disk_sealed = getattr(capacity, "disk_sealed", False)
    tiers.remote_sealed = getattr(capacity, "remote_sealed", False)
    if disk is not None and restored:
        if wall_now is None:
            raise ValueError("restored blocks need wall_now, the wall clock they were stamped by")
        now = blocks.clock()
        restored = sorted(restored, key=lambda r: r[2])  # least recently used first, as the index keeps them
        over = max(len(restored) - disk.capacity, 0)
        tiers.stale.extend(block_hash for block_hash, _, _ in restored[:over])  # the least recently used go
        for block_hash, produced, used in restored[over:]:
            age_produced, age_used = max(wall_now - produced, 0.0), max(wall_now - used, 0.0)
            if age_produced > max_age_s:
                tiers.stats.unservable["stale"] += 1
                tiers.stale.append(block_hash)
                continue
            meta = BlockMeta(block_hash, Tier.DISK, -1, now - age_produced, now - age_used, heat_at_s=now)
            if not disk.restore(meta):
                tiers.stale.append(block_hash)  # over this run's capacity: deleted by the first step
    return tiers
