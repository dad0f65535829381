"""Which prompt an idle prefill worker computes ahead while its decode worker has no room (staging).

The conductor core (`ConductorCore.reserve_waiting`, `staged`, `_stage_next`) asks `StagePlan.pick` when a
prefill worker may have become idle. A prefill worker advertises in its `ready` event how many blocks of staged
KV it can keep (`stage_blocks`: its host tier, else half its pool; 0 under `--delivery fifo`: no staging) and
the longest prompt it can reuse whole (`stage_max_blocks`: a long-context worker reuses at most its hot window).
One stage pass at a time per worker; the first waiting prompt in (tier rank, arrival) order whose decode worker
had no room; only while what the worker keeps staged (staged, not yet reserved) and this prompt fit.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.core.service_tiers import ServiceTiers


class StagePlan:
    def __init__(self, tiers: ServiceTiers) -> None:
        self.tiers = tiers
        self.blocks: dict[str, int] = {}  # prefill worker -> blocks of staged KV it can keep (0: none)
        self.max_blocks: dict[str, int] = {}  # prefill worker -> the longest prompt (blocks) it reuses whole
        self.staging: dict[str, str] = {}  # prefill worker -> the request it is staging now

    def worker_ready(self, name: str, info: dict) -> None:
        self.blocks[name] = info.get("stage_blocks", 0)
        self.max_blocks[name] = info.get("stage_max_blocks", self.blocks[name])

    def may_stage(self, prefill: str | None) -> bool:
        return prefill is not None and bool(self.blocks.get(prefill)) and prefill not in self.staging

    def pick(self, prefill: str, flights: Iterable, block_size: int):
        """The flight `prefill` should stage now (marked "staging"), or None."""
        mine = [f for f in flights if f.prefill == prefill and f.kv_addr is None]
        kept = sum(_blocks(f, block_size) for f in mine if f.staged)
        waiting = [f for f in mine if f.waiting_room and not f.staged
                   and _blocks(f, block_size) <= self.max_blocks[prefill]]
        if not waiting:
            return None
        f = min(waiting, key=lambda g: (self.tiers[g.tier].rank, g.arrival_s))
        if kept + _blocks(f, block_size) > self.blocks[prefill]:
            return None
        f.staged, self.staging[prefill] = "staging", f.rid
        return f

    def done(self, prefill: str | None, rid: str) -> None:
        """`rid`'s stage pass on `prefill` ended, or is moot."""
        if prefill is not None and self.staging.get(prefill) == rid:
            del self.staging[prefill]


def _blocks(f, block_size: int) -> int:
    return -(-len(f.prompt) // block_size)
