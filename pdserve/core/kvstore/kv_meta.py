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

import numpy as np

from pdserve.core.service_tiers import retention_weight


class Tier(str, enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"  # the shared pool (`--kv-remote`): below every worker's own tiers


# where a worker's own KV lives, top down (service tiers: SERVICE_TIERS); the shared pool (Tier.REMOTE) is below
STORAGE_TIERS = tuple(t.value for t in Tier if t is not Tier.REMOTE)


class Pattern(str, enum.Enum):
    """How a block's prefix is reused (`pdserve.core.kvstore.prefix_patterns` infers it from its history)."""
    UNKNOWN = "unknown"  # no history yet
    ONE_OFF = "one_off"  # used once; its expected reuse did not come
    RECURRING = "recurring"  # turns of a conversation: each turn extends it, after a think time
    PERIODIC = "periodic"  # the same prefix asked again at a regular interval


PATTERNS = tuple(p.value for p in Pattern)  # the `pattern` column's codes (`kv_columns`)


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
    pattern: str = "unknown"  # its prefix's access pattern (`Pattern`): retention reads it
    prefetched: bool = False  # moved up ahead of an expected use and not used since (`kv_placement`)
    secret: bool = False  # a `secret`-labelled request's KV: never written to an unsealed disk tier

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

EXPECT_FLOOR_S = 1.0  # an expected use nearer than this counts as this near
ONE_OFF_WEIGHT = 0.25  # a one-off prefix's block counts a quarter


class StagedPolicy:
    """The stage-driven placement's eviction order (`--kv-placement staged`, `pdserve.core.kvstore.kv_placement`),
    lowest first, by how soon a block is likely to be read again (Belady's rule, estimated): its use rate so far
    (decayed heat per half-life, x ONE_OFF_WEIGHT for a one-off prefix: a DECAY block's falls, so decay demotes
    it to the tier below first) plus, when its prefix is expected back (`expected_use_at_s`, from its think
    time), the chance it comes back (`reuse_p`, per pattern, learnt by `prefix_patterns`) over the time until
    then (at least EXPECT_FLOOR_S; once overdue, as long as it is overdue: a late use's remaining wait grows);
    all x its class's `retention_weight` (at equal heat and expectation a guaranteed tier's prefix outlives a
    flex one). `scores` is the same over columns of slots."""

    def __init__(self, config: LifecycleConfig | None = None) -> None:
        self.half_life_s = (config or LifecycleConfig()).heat_half_life_s
        # per `kv_columns.PATTERNS` code: unknown, one_off, recurring, periodic (set as they are learnt)
        self.reuse_p = np.array([0.3, 0.05, 0.5, 0.8])

    def score(self, meta: BlockMeta, now: float) -> float:
        rate = meta.heat_now(now, self.half_life_s) / self.half_life_s
        if meta.pattern == Pattern.ONE_OFF:
            rate *= ONE_OFF_WEIGHT
        if meta.expected_use_at_s is not None:
            rate += self.reuse_p[PATTERNS.index(meta.pattern)] / max(abs(meta.expected_use_at_s - now), EXPECT_FLOOR_S)
        return retention_weight(meta.sla_class) * rate + meta.last_use_s * 1e-12

    def scores(self, cols, slots, now: float):
        """`score` of each of `slots` of `cols` (a `kv_columns.MetaColumns`), as an array."""
        heat = cols.heat[slots]
        heat = np.where(heat != 0, heat * np.exp2(-(now - cols.heat_at_s[slots]) / self.half_life_s), 0.0)
        pattern = cols.pattern[slots]
        rate = np.where(pattern == PATTERNS.index(Pattern.ONE_OFF.value), ONE_OFF_WEIGHT, 1.0) * heat / self.half_life_s
        ahead = np.maximum(np.abs(cols.expected_use_at_s[slots] - now), EXPECT_FLOOR_S)  # (nan: not expected)
        rate = rate + np.where(np.isnan(ahead), 0.0, self.reuse_p[pattern] / ahead)
        return cols.class_weight(slots) * rate + cols.last_use_s[slots] * 1e-12


def make_eviction_policy(name: str, config: LifecycleConfig | None = None, placement: str = "write-through"
                         ) -> EvictionPolicy:
    """The policy every tier evicts by: `name`'s under write-through placement; the staged placement's own."""
    if placement == "staged":
        return StagedPolicy(config)
    if name not in EVICTION_POLICIES:
        raise ValueError(f"unknown KV eviction policy {name!r}; choose from {sorted(EVICTION_POLICIES)}")
    if name == "heat":
        return HeatPolicy((config or LifecycleConfig()).heat_half_life_s)
    return EVICTION_POLICIES[name]()


def servable(meta: BlockMeta, now: float, codec: str, max_age_s: float) -> str | None:
    """Whether a lower tier's block may be served to the device pool now: None if so, else why not: "stale"
    (produced more than `max_age_s` ago: the KV retention limit, `--kv-max-age-s`) or "codec" (its bytes are in
    another format than `codec`, the tier's, which its loads decode into the pool's). `TieredKV` applies this
    rule over columns."""
    if now - meta.produced_at_s > max_age_s:
        return "stale"
    if meta.codec != codec:
        return "codec"
    return None


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
