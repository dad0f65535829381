"""What every KV block carries beside its bytes, the lifecycle stage those fields give, and the policies
that read them to decide which block leaves a tier first.

Stages (`stage_of`), evaluated at a time `now`:

    PREWARM   computed ahead of demand by a prewarm call and pinned until `pinned_until_s`; no request
              has used it yet
    ACTIVE    held by a live request, or used within the last `active_s` seconds
    DECAY     idle: its heat decays (half-life `heat_half_life_s`) and it is an eviction candidate
    RECLAIM   picked for eviction from its tier: its slot is being taken back

A block moves PREWARM -> ACTIVE on its first use by a request, ACTIVE -> DECAY when idle, DECAY -> ACTIVE
when used again (a hit), DECAY -> RECLAIM when an eviction policy picks it. Pinned blocks are never picked.

Eviction policies are one method, `score(meta, now)`: the lowest score leaves first. A tier looks at its
`sample` least recently used candidates (not pinned, not busy) and evicts the lowest-scoring one, so LRU
is exact and any other policy costs O(sample) per eviction, however large the tier. A third policy is a
class with a `score` method added to `EVICTION_POLICIES`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class Tier(str, enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


STORAGE_TIERS = tuple(t.value for t in Tier)  # where KV lives, top down (service tiers: SERVICE_TIERS)


class Stage(str, enum.Enum):
    PREWARM = "prewarm"
    ACTIVE = "active"
    DECAY = "decay"
    RECLAIM = "reclaim"


@dataclass(frozen=True)
class LifecycleConfig:
    active_s: float = 30.0
    """A block used within this many seconds is ACTIVE even when no request holds it."""
    heat_half_life_s: float = 120.0
    """Heat (a decayed use count) halves every this many seconds."""
    eviction_sample: int = 16
    """Least recently used candidates an eviction policy chooses among."""


@dataclass(slots=True)
class BlockMeta:
    block_hash: int
    tier: Tier
    slot: int  # device block id, host slot; -1 on disk (the file is named by the hash)
    produced_at_s: float
    last_use_s: float
    use_count: int = 0
    heat: float = 0.0  # decayed use count as of `heat_at_s`
    heat_at_s: float = 0.0
    expected_use_at_s: float | None = None
    pinned_until_s: float = 0.0
    prewarmed: bool = False  # produced by a prewarm and not used by a request since
    codec: str = "float32"
    sla_class: str = "default"
    reclaiming: bool = False
    ready: bool = True  # False while its bytes are being written into this tier
    busy: int = 0  # in-flight reads of its bytes (a load or a copy down): not evictable meanwhile
    from_tier: Tier | None = None  # where it came from when promoted (a disk hit prefetched to host)

    def heat_now(self, now: float, half_life_s: float) -> float:
        return self.heat * math.exp2(-(now - self.heat_at_s) / half_life_s) if self.heat else 0.0

    def touch(self, now: float, half_life_s: float, by_request: bool = True) -> None:
        """One use: heat += 1 (after decaying it to `now`)."""
        self.heat = self.heat_now(now, half_life_s) + 1.0
        self.heat_at_s = now
        self.last_use_s = max(self.last_use_s, now)
        self.use_count += 1
        if by_request:
            self.prewarmed = False

    def pinned(self, now: float) -> bool:
        return self.pinned_until_s > now


def stage_of(meta: BlockMeta, now: float, in_use: bool, config: LifecycleConfig) -> Stage:
    if meta.reclaiming:
        return Stage.RECLAIM
    if meta.prewarmed and meta.pinned(now):
        return Stage.PREWARM
    if in_use or now - meta.last_use_s < config.active_s:
        return Stage.ACTIVE
    return Stage.DECAY


class EvictionPolicy(Protocol):
    def score(self, meta: BlockMeta, now: float) -> float:
        """Lower leaves its tier first."""
        ...


class LRUPolicy:
    """Least recently used first."""

    def score(self, meta: BlockMeta, now: float) -> float:
        return meta.last_use_s


class HeatPolicy:
    """Coldest first: decayed use count, so a prefix used by many requests outlives one used once even if
    the latter was touched more recently; a block expected back within `horizon_s` counts as hot."""

    def __init__(self, half_life_s: float = 120.0, horizon_s: float = 60.0) -> None:
        self.half_life_s = half_life_s
        self.horizon_s = horizon_s

    def score(self, meta: BlockMeta, now: float) -> float:
        heat = meta.heat_now(now, self.half_life_s)
        if meta.expected_use_at_s is not None and 0 <= meta.expected_use_at_s - now <= self.horizon_s:
            heat += 1e6
        return heat + meta.last_use_s * 1e-12  # ties: least recently used first


EVICTION_POLICIES: dict[str, type] = {"lru": LRUPolicy, "heat": HeatPolicy}


def make_eviction_policy(name: str, config: LifecycleConfig | None = None) -> EvictionPolicy:
    if name not in EVICTION_POLICIES:
        raise ValueError(f"unknown KV eviction policy {name!r}; choose from {sorted(EVICTION_POLICIES)}")
    if name == "heat":
        return HeatPolicy((config or LifecycleConfig()).heat_half_life_s)
    return EVICTION_POLICIES[name]()


def pick_victim(candidates: Iterable[BlockMeta], policy: EvictionPolicy, now: float, sample: int
                ) -> BlockMeta | None:
    """The lowest-scoring of the first `sample` evictable candidates (given least recently used first)."""
    best, best_score, seen = None, math.inf, 0
    for meta in candidates:
        if meta.busy or not meta.ready or meta.pinned(now):
            continue
        score = policy.score(meta, now)
        if score < best_score:
            best, best_score = meta, score
        seen += 1
        if seen >= sample:
            break
    return best
