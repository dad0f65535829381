"""KV checkpoints of a decode worker's requests, for moving them when the worker dies (issue 15).

**Taking one.** A worker with a disk KV tier already writes every full block through to it (device -> host ->
disk, `pdserve.core.kvstore.kv_tiers`), its decoded tokens' blocks included (in runs of at most `every` tokens): a
running request's leading blocks that are on disk are its checkpoint, in files that outlive the process
(`<dir>/<identity>/<worker>/<hash>.kv`, `pdserve.kv.disk_store`). `KVCheckpoints.due` tells the conductor how many of a request's tokens are there,
each time that number grew by `every` tokens (`--kv-checkpoint-tokens`) since the last report.

**Restoring one.** When the worker dies, the conductor moves each request with a checkpoint to another worker
with `restore: {peer, tokens}` (`pdserve.conductor.recovery`). That worker `adopt`s the dead peer's files of
the request's first `tokens` tokens: each is hard-linked into its own disk folder and indexed in its disk tier,
in chain order, up to the first one missing. The request then finds them as prefix hits like any other
(prefetched disk -> host -> device); the worker computes the rest itself (at most about `every` tokens, the
part decoded since the checkpoint, plus the block being filled), with no prefill worker. Each file is checked
(header, checksum, block hash) when read; a damaged or missing one is a miss, and a miss past what the
worker can compute itself sends the request to a prefill worker as if there were no checkpoint, counted
(`pdserve_fallbacks_total{kind="kv_checkpoint_missing"}`). Equal hashes mean equal token prefixes under the
same model identity folder, so adopted KV is never another sequence's.

**Through the shared pool** (`--kv-remote`, no shared filesystem needed): a worker with a pool writes every full
block through to it as it does to disk, so a request's leading blocks the pool holds (written by this worker,
`RemoteBook.known`) are a checkpoint too, in memory that outlives the process (the pool's store servers'). The
worker a request moves to asks the pool which of them it holds (`adopt`: one lookup; with the pool known down,
none) and finds them as prefix hits like any other (fetched pool -> host -> device).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from pdserve.core.kvstore.kv_meta import BlockMeta, Tier
from pdserve.core.request import RequestStatus
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv.disk_store import DiskKVStore


class KVCheckpoints:
    def __init__(self, engine: LLMEngine, disk: DiskKVStore | None, every: int) -> None:
        """`disk`: the worker's disk tier's files (None: checkpoints live in the shared pool only)."""
        self.engine = engine
        self.disk = disk
        self.every = every
        self.reported: dict[str, int] = {}  # request id -> tokens on disk at its last report
        blocks = engine.block_manager
        if every > 0:  # decoded blocks go down in runs (`WRITE_THROUGH_TOKENS`): no longer than a checkpoint
            blocks.offload_unit = max(1, min(blocks.offload_unit, every // blocks.block_size))

    def due(self) -> list[tuple[str, int]]:
        """[(request id, tokens of it whose KV is on disk)] for the running requests whose checkpoint grew by
        `every` tokens since their last report (counted from the start of the request's sequence here)."""
        blocks = self.engine.block_manager
        out, live = [], set()
        for req in self.engine.scheduler.running:
            if req.status is not RequestStatus.DECODING:
                continue
            rid = req.request_id
            live.add(rid)
            last = self.reported.get(rid, 0)
            start = last // blocks.block_size  # (blocks are written in order: look past the last report only)
            durable = (start + self._durable(blocks.registered_hashes(rid)[start:])) * blocks.block_size
            if durable - last >= self.every:
                self.reported[rid] = durable
                out.append((rid, durable))
        self.reported = {rid: n for rid, n in self.reported.items() if rid in live}
        return out

    def _durable(self, hashes: Sequence[int]) -> int:
        """How many leading `hashes` outlive this process: on disk, or written to the shared pool."""
        tiers = self.engine.tiers
        on_disk = tiers.disk.ready_prefix(hashes)[0] if tiers.disk is not None else 0
        return max(on_disk, tiers.remote.leading(hashes)) if tiers.remote is not None else on_disk

    def adopt(self, peer: str, token_ids: Sequence[int]) -> int:
        """Take the dead worker `peer`'s checkpoint of `token_ids` (whole blocks, in chain order, up to the first
        one missing): its disk files into this worker's disk tier, else what the shared pool holds of it. Returns
        how many tokens they cover."""
        blocks = self.engine.block_manager
        hashes = blocks.sequence_hashes(token_ids)
        linked = self._link_all(peer, hashes) if self.disk is not None else 0
        if linked < len(hashes) and self.engine.tiers.remote is not None:
            linked = max(linked, self._in_pool(hashes))
        return linked * blocks.block_size

    def _in_pool(self, hashes: Sequence[int]) -> int:
        """How many leading `hashes` the pool holds: one lookup on this thread (a rare path: a peer died), none
        while the pool is known down; what it finds is learnt, so the request's lookup fetches it at once."""
        from pdserve.kv.remote_store import PoolDown
        book, store = self.engine.tiers.remote, self.engine.kv_io.remote
        if not book.up(self.engine.block_manager.clock()):
            return 0
        try:
            found = store.exists(list(hashes))
        except PoolDown:
            book.down(self.engine.block_manager.clock())
            return 0
        count = found.index(False) if False in found else len(found)
        for h in hashes[:count]:
            book.learn(h)
        return count

    def _link_all(self, peer: str, hashes: Sequence[int]) -> int:
        tiers, blocks = self.engine.tiers, self.engine.block_manager
        source = self.disk.dir.parent / peer
        now, wall = blocks.clock(), time.time()
        count = 0
        for h in hashes:
            if tiers.disk.get(h) is None and not self._link(source, h, now, wall):
                break
            count += 1
        return count

    def _link(self, source, block_hash: int, now: float, wall: float) -> bool:
        mine = self.disk.path(block_hash)
        theirs = source / mine.name
        try:
            produced = theirs.stat().st_mtime
            os.link(theirs, mine)
        except FileExistsError:
            pass  # an earlier run of this worker left it: indexed below all the same
        except OSError:
            return False
        meta = BlockMeta(block_hash, Tier.DISK, -1, now - max(wall - produced, 0.0), now, heat_at_s=now)
        if self.engine.tiers.disk.restore(meta):
            return True
        mine.unlink(missing_ok=True)  # this worker's disk tier is full
        return False
