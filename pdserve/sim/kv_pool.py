"""`SimKVPool`: the shared KV pool of a simulated cluster (`--kv-remote-pool-gb`, as Mooncake Store is for the real
workers' `--kv-remote`), one object every engine's `pdserve.sim.tier_io.SimTierIO` reads and writes.

It owns the pool's contents (block hashes, least recently used evicted first at `capacity_blocks`) and its link
(`bw` bytes/s each way and `rtt_s` per operation, per engine: each engine reaches the pool over a connection of
its own, full duplex). What one engine knows of the pool is the real `pdserve.core.kvstore.kv_remote.RemoteBook`
inside its real `TieredKV`; this object only answers its operations, on simulated time:
* a block published by an operation ending at `t` is found by every probe or fetch that reaches the pool from `t`
  on (`visible_at`), so the order in which engines start their operations does not matter, only their times;
* a probe finds the hashes present (published and not evicted); a fetch reads them (a block evicted by then is
  `missing`: a miss for the reader, as the real runner's), and a read counts as a use for eviction.
No bytes move and nothing fails otherwise (the pool is never down here).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.core.kvstore.kv_remote import ABSENT

MISSING = "missing"  # a fetched block the pool no longer holds (the real runner's reason: `pdserve.kv.tier_io`)


@dataclass
class SimKVPool:
    capacity_blocks: int
    bw: float  # bytes/s, each engine's link to the pool, each way
    rtt_s: float  # one operation's round trip (a probe is only that)
    block_bytes: int  # a block as the pool holds it (the host tier's codec)
    blocks: OrderedDict = field(default_factory=OrderedDict)  # hash -> visible from (simulated s), LRU first
    peak_blocks: int = 0
    evicted: int = 0
    published: int = 0  # blocks written (an upsert of one held already counts too)
    fetched: int = 0  # blocks read out
    fetch_missing: int = 0  # blocks asked for that it did not hold (evicted, or not yet written)
    probed: int = 0
    probe_found: int = 0

    def __post_init__(self) -> None:
        if self.capacity_blocks < 1:
            raise ValueError("a shared KV pool holds at least one block")

    def has(self, h: int, at_s: float) -> bool:
        t = self.blocks.get(h)
        return t is not None and t <= at_s

    def probe(self, hashes: Sequence[int], at_s: float) -> dict[int, str]:
        """Which of `hashes` the pool holds at `at_s`: the failures map of a probe (those absent)."""
        self.probed += len(hashes)
        absent = {h: ABSENT for h in hashes if not self.has(h, at_s)}
        self.probe_found += len(hashes) - len(absent)
        return absent

    def fetch(self, hashes: Sequence[int], at_s: float) -> dict[int, str]:
        """Read `hashes` at `at_s`: the failures map of a fetch (those it does not hold); a read is a use."""
        missing = {}
        for h in hashes:
            if self.has(h, at_s):
                self.blocks.move_to_end(h)
            else:
                missing[h] = MISSING
        self.fetched += len(hashes) - len(missing)
        self.fetch_missing += len(missing)
        return missing

    def publish(self, hashes: Sequence[int], visible_at_s: float) -> None:
        """Write `hashes`, found from `visible_at_s` on (an upsert: one held already keeps its earlier time),
        evicting the least recently used beyond capacity."""
        blocks = self.blocks
        for h in hashes:
            t = blocks.get(h)
            blocks[h] = visible_at_s if t is None else min(t, visible_at_s)
            blocks.move_to_end(h)
        self.published += len(hashes)
        over = len(blocks) - self.capacity_blocks
        self.peak_blocks = max(self.peak_blocks, min(len(blocks), self.capacity_blocks))
        for _ in range(max(over, 0)):
            blocks.popitem(last=False)
        self.evicted += max(over, 0)

    def stats(self) -> dict:
        bb = self.block_bytes
        return {"capacity_bytes": self.capacity_blocks * bb, "peak_bytes": self.peak_blocks * bb,
                "held_bytes": len(self.blocks) * bb, "link_bw": self.bw, "rtt_s": self.rtt_s,
                "published_blocks": self.published, "fetched_blocks": self.fetched,
                "fetch_missing_blocks": self.fetch_missing, "probed_blocks": self.probed,
                "probe_found_blocks": self.probe_found, "evicted_blocks": self.evicted}
