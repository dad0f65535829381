"""The records between a worker's tier bookkeeping (`pdserve.core.kvstore.kv_tiers.TieredKV`) and the rest: the
loads a step performs, the I/O operations a runner carries out (`pdserve.kv.tier_io`, the simulator's
`SimTierIO`), the capacity it reports, a lookup's answer and the counters. Plain frozen dataclasses (a
load: a named tuple).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.core.kvstore.block_hash import BlockHash


class KVLoad(NamedTuple):  # (a named tuple: a long prompt's host hits make hundreds per request)
    """Copy host slot `host_slot` into device block `block_id` before the step's forward."""

    block_id: int
    host_slot: int


@dataclass(frozen=True, eq=False)  # (compared by identity: its fields may be arrays)
class KVOp:
    op_id: int
    kind: str  # offload | flush | prefetch | delete; the shared pool's: probe | fetch | publish
    hashes: Sequence[int]  # an offload's: a uint64 array (hundreds per prompt); the others' a tuple
    src: Sequence[int] = ()  # offload: device block ids (an int64 array); flush, publish: host slots
    dst: Sequence[int] = ()  # offload (an int64 array), prefetch, fetch: host slots

    @property
    def holder(self) -> str:
        return f"kvop:{self.op_id}"


@dataclass(frozen=True)
class TierCapacity:
    """What a worker's tier bookkeeping is sized from (its I/O runner's `capacity`)."""

    host_blocks: int
    disk_blocks: int
    block_bytes: int
    host_codec: str | None = None  # the format each tier holds (None: the pool's; the disk's: the host's)
    disk_codec: str | None = None
    disk_sealed: bool = False  # its files are encrypted (`--kv-disk-key-file`): secret KV may go there
    remote: bool = False  # a shared pool below (`--kv-remote`, `pdserve.core.kvstore.kv_remote`)
    remote_sealed: bool = False  # its values are encrypted (with the disk tier's key): secret KV may go there


@dataclass(frozen=True)
class TierHit:
    """A device prefix hit continued through the lower tiers."""

    host: tuple[BlockHash, ...] = ()  # ready in host, right after the device hit, in order
    waiting: bool = False  # more of the prefix is on disk and being prefetched: ask again later


@dataclass
class TierStats:
    hit_tokens: Counter = field(default_factory=Counter)  # by Tier
    bytes_in: Counter = field(default_factory=Counter)  # by Tier: written into that tier
    bytes_out: Counter = field(default_factory=Counter)  # by Tier: read out of it
    corrupt: Counter = field(default_factory=Counter)  # by Tier: blocks found damaged, dropped
    failed_ops: Counter = field(default_factory=Counter)  # by kind
    disk_full: int = 0  # writes refused for lack of space (the disk tier then stops writing)
    unservable: Counter = field(default_factory=Counter)  # by why (stale, codec): found, dropped, not served
    secret_off_disk: int = 0  # secret blocks not written to an unsealed disk tier (each time one was offered)
    secret_off_remote: int = 0  # secret blocks not written to an unsealed shared pool
    remote_skipped: int = 0  # blocks not written to the pool: too many writes to it already under way


@dataclass
class PlacementStats:
    """Blocks moved between tiers by cause (`pdserve.core.kvstore.kv_placement`): `moves` counts (kind, stage,
    src, dst) -> blocks, kind promotion (up: a request's hit is `active`, one ahead of an expected use `decay`),
    demotion (a block left a tier and lives on below) or drop (it left with no copy below, dst `none`), stage the
    block's lifecycle stage when it moved; `prefetch` counts blocks moved up ahead of an expected use (issued),
    read by a request since (used), and evicted or lapsed unread (wasted)."""
    moves: Counter = field(default_factory=Counter)
    prefetch: Counter = field(default_factory=Counter)

    def report(self) -> dict:
        return {"moves": [{"kind": k, "stage": s, "src": a, "dst": b, "blocks": n}
                          for (k, s, a, b), n in sorted(self.moves.items())],
                "prefetch": {k: self.prefetch[k] for k in ("issued", "used", "wasted")}}
