"""The `BlockMeta` fields of every slot of one tier, as numpy columns indexed by slot.

A worker's tiers hold 10^5 blocks and a long prompt registers, copies down and frees ~10^3 of them at once:
kept as columns, a run of blocks is registered, copied to the tier below, touched or counted by stage with a
few array operations instead of one Python object per block (what lets the simulator replay an hour-long
trace in well under a minute per engine-hour). `view(slot)` is a `BlockMeta`-shaped window onto one slot
(reads and writes go to the columns) for the code that works a block at a time: policies, tests, rare paths.
`codec` and `sla_class` are stored as small codes into one process-wide table of names. A run's rows are
copied to the tier below and set fresh by the compiled `copy_rows` / `fill_rows` (`pdserve.core.kvstore.native`), one
call for every column instead of a numpy gather and scatter each; numpy does it where that is unavailable.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from pdserve.core.kvstore import native
from pdserve.core.kvstore.kv_meta import PATTERNS, BlockMeta, LifecycleConfig, Stage, Tier
from pdserve.core.service_tiers import retention_weight

_NAMES: list[str] = ["float32", "default"]
_CODES: dict[str, int] = {"float32": 0, "default": 1}
_TIERS: list[Tier | None] = [None, Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.REMOTE]
TIER_CODE = {t: i for i, t in enumerate(_TIERS)}  # `from_tier` column values


def name_code(name: str) -> int:
    code = _CODES.get(name)
    if code is None:
        code = _CODES[name] = len(_NAMES)
        _NAMES.append(name)
    return code


_WEIGHTS: list = [np.ones(0)]


def class_weights() -> np.ndarray:
    """`service_tiers.retention_weight` of every name code (indexed by the `sla_class` column)."""
    if len(_WEIGHTS[0]) != len(_NAMES):
        _WEIGHTS[0] = np.array([retention_weight(n) for n in _NAMES])
    return _WEIGHTS[0]


def claim_class(cols, slots: np.ndarray, name: str) -> None:
    """Blocks at `slots` are used by a request of class `name`: it becomes theirs if it is worth more."""
    code = name_code(name)
    weights = class_weights()
    better = slots[weights[cols.sla_class[slots]] < weights[code]]
    cols.sla_class[better] = code


# field -> (dtype, value of a fresh slot); every one is copied down to the tier below except `_NOT_COPIED`
_FIELDS = {"produced_at_s": (np.float64, 0.0), "last_use_s": (np.float64, 0.0), "use_count": (np.int64, 0),
           "heat": (np.float64, 0.0), "heat_at_s": (np.float64, 0.0), "expected_use_at_s": (np.float64, math.nan),
           "pinned_until_s": (np.float64, 0.0), "prewarmed": (np.bool_, False), "codec": (np.int16, 0),
           "sla_class": (np.int16, 1), "pattern": (np.int8, 0), "block_hash": (np.uint64, 0),
           "reclaiming": (np.bool_, False), "ready": (np.bool_, True), "busy": (np.int32, 0),
           "from_tier": (np.int8, 0), "prefetched": (np.bool_, False), "secret": (np.bool_, False)}
# (`secret`: a `secret`-labelled request's KV, `pdserve.core.pd.sensitivity`: never written to an unsealed disk)
# (`codec` is each tier's own: a copy into a tier is in that tier's format, `kv_codecs.tier_codecs`)
_NOT_COPIED = ("codec", "reclaiming", "ready", "busy", "from_tier", "prefetched")
_COPIED = [name for name in _FIELDS if name not in _NOT_COPIED]
_SET_BY_FRESH = {"block_hash", "produced_at_s", "last_use_s", "heat_at_s", "use_count", "heat", "ready"}
_RESET = [(name, value) for name, (_, value) in _FIELDS.items() if name not in _SET_BY_FRESH]
_FRESH = [name for name, _ in _RESET] + ["produced_at_s", "last_use_s", "heat_at_s", "use_count", "heat", "ready"]
_AFTER_COPY = (("codec", 0), ("reclaiming", False), ("ready", False), ("busy", 0), ("from_tier", 0),
               ("prefetched", False))


class MetaColumns:
    def __init__(self, num_slots: int, tier: Tier, codec: str = "float32") -> None:
        """`codec`: the format this tier holds its blocks in (what a fresh slot's `codec` says)."""
        self.tier = tier
        for name, (dtype, fresh) in _FIELDS.items():
            setattr(self, name, np.full(num_slots, fresh, dtype))
        self.codec[:] = name_code(codec)
        own = lambda pairs: [(n, name_code(codec) if n == "codec" else v) for n, v in pairs]  # noqa: E731
        self._reset, self._after = own(_RESET), own(_AFTER_COPY)
        self._reset_values = tuple(value for _, value in self._reset)
        self._after_copy_values = tuple(value for _, value in self._after)
        self._views: dict[int, MetaView] = {}
        self._rows = native.load()  # copy_rows / fill_rows, or None: numpy (counted)
        if self._rows is None:
            native.fallback()
        self._copied = tuple(getattr(self, name) for name in _COPIED)
        self._fresh = tuple(getattr(self, name) for name in _FRESH)
        self._after_copy = tuple(getattr(self, name) for name, _ in _AFTER_COPY)

    def class_weight(self, slots: np.ndarray) -> np.ndarray:
        """`service_tiers.retention_weight` of each slot's `sla_class`."""
        return class_weights()[self.sla_class[slots]]

    def view(self, slot: int) -> MetaView:
        v = self._views.get(slot)
        if v is None:
            v = self._views[slot] = MetaView(self, slot)
        return v

    def fresh(self, slots: np.ndarray, hashes: np.ndarray, now: float, use_count: int, ready: bool) -> None:
        """New blocks at `slots`: produced and last used now, used `use_count` times (heat as much)."""
        if not isinstance(slots, int) and len(slots) == 1:  # a scalar store is ~10x cheaper than a fancy one
            slots, hashes = int(slots[0]), int(hashes[0])
        elif self._rows is not None and not isinstance(slots, int):
            self._rows.fill_rows(self._fresh, (*self._reset_values, now, now, now, use_count, float(use_count), ready),
                                 np.ascontiguousarray(slots, np.int64))
            self.block_hash[slots] = hashes
            return
        for name, value in self._reset:
            getattr(self, name)[slots] = value
        self.block_hash[slots] = hashes
        self.produced_at_s[slots] = now
        self.last_use_s[slots] = now
        self.heat_at_s[slots] = now
        self.use_count[slots] = use_count
        self.heat[slots] = float(use_count)
        self.ready[slots] = ready

    def copy_from(self, src: MetaColumns, src_slots: np.ndarray, slots: np.ndarray) -> None:
        """Slots `slots` take the metadata of `src`'s `src_slots` (a copy into this tier: not ready yet)."""
        if len(slots) == 1:
            slots, src_slots = int(slots[0]), int(src_slots[0])
        elif self._rows is not None:
            slots = np.ascontiguousarray(slots, np.int64)
            self._rows.copy_rows(self._copied, src._copied, slots, np.ascontiguousarray(src_slots, np.int64))
            self.last_use_s[slots] = np.maximum(self.last_use_s[slots], 0.0)
            self._rows.fill_rows(self._after_copy, self._after_copy_values, slots)
            return
        for name in _COPIED:
            getattr(self, name)[slots] = getattr(src, name)[src_slots]
        self.last_use_s[slots] = np.maximum(self.last_use_s[slots], 0.0)
        for name, value in self._after:
            getattr(self, name)[slots] = value

    def set_from(self, slot: int, meta) -> None:
        """Slot `slot` takes the fields of a `BlockMeta` (or a view of another tier)."""
        for name in _COPIED:
            value = getattr(meta, name)
            getattr(self, name)[slot] = _code(name, value)

    def touch(self, slots: np.ndarray, now: float, half_life_s: float, by_request: bool = True) -> None:
        """One use of each of `slots` (distinct): heat decayed to now, + 1."""
        heat = self.heat[slots]
        decayed = heat * np.exp2(-(now - self.heat_at_s[slots]) / half_life_s)
        self.heat[slots] = np.where(heat != 0, decayed, 0.0) + 1.0
        self.heat_at_s[slots] = now
        self.last_use_s[slots] = np.maximum(self.last_use_s[slots], now)
        self.use_count[slots] += 1
        if by_request:
            self.prewarmed[slots] = False

    def stages(self, slots: np.ndarray, in_use: np.ndarray, now: float, config: LifecycleConfig) -> Counter:
        """Counts by `stage_of` for `slots`, `in_use` saying which are held."""
        reclaim = self.reclaiming[slots]
        prewarm = ~reclaim & self.prewarmed[slots] & (self.pinned_until_s[slots] > now)
        active = ~reclaim & ~prewarm & (in_use | (now - self.last_use_s[slots] < config.active_s))
        counts = Counter({Stage.RECLAIM: int(reclaim.sum()), Stage.PREWARM: int(prewarm.sum()),
                          Stage.ACTIVE: int(active.sum())})
        counts[Stage.DECAY] = len(slots) - sum(counts.values())
        return +counts

    def evictable(self, slots: np.ndarray, now: float) -> np.ndarray:
        """Ready, not being read, not pinned."""
        return self.ready[slots] & (self.busy[slots] == 0) & (self.pinned_until_s[slots] <= now)

    def snapshot(self, slot: int, slot_number: int | None = None) -> BlockMeta:
        v = self.view(slot)
        return BlockMeta(v.block_hash, self.tier, slot if slot_number is None else slot_number, v.produced_at_s,
                         v.last_use_s, v.use_count, v.heat, v.heat_at_s, v.expected_use_at_s, v.pinned_until_s,
                         v.prewarmed, v.codec, v.sla_class, v.reclaiming, v.ready, v.busy, v.from_tier, v.pattern,
                         v.prefetched)


class _Field:
    def __init__(self, name: str, kind: type) -> None:
        self.name, self.kind = name, kind

    def __get__(self, view: MetaView, owner=None):
        value = getattr(view.cols, self.name)[view.slot].item()
        if self.name in ("codec", "sla_class"):
            return _NAMES[value]
        if self.name == "pattern":
            return PATTERNS[value]
        if self.name == "from_tier":
            return _TIERS[value]
        if self.name == "expected_use_at_s" and math.isnan(value):
            return None
        return self.kind(value)

    def __set__(self, view: MetaView, value) -> None:
        getattr(view.cols, self.name)[view.slot] = _code(self.name, value)


def _code(name: str, value):
    """A `BlockMeta` value as its column stores it (names as codes, None as nan)."""
    if name in ("codec", "sla_class"):
        return name_code(value)
    if name == "pattern":
        return PATTERNS.index(value)
    if name == "from_tier":
        return _TIERS.index(value)
    if name == "expected_use_at_s" and value is None:
        return math.nan
    return value


class MetaView:
    """One slot's metadata, read and written in place: the `BlockMeta` interface over `MetaColumns`."""

    __slots__ = ("cols", "slot")

    def __init__(self, cols: MetaColumns, slot: int) -> None:
        self.cols, self.slot = cols, slot

    @property
    def tier(self) -> Tier:
        return self.cols.tier

    def heat_now(self, now: float, half_life_s: float) -> float:
        return self.heat * math.exp2(-(now - self.heat_at_s) / half_life_s) if self.heat else 0.0

    def touch(self, now: float, half_life_s: float, by_request: bool = True) -> None:
        self.cols.touch(np.array([self.slot]), now, half_life_s, by_request)

    def pinned(self, now: float) -> bool:
        return self.pinned_until_s > now

    def __repr__(self) -> str:
        return f"MetaView({self.cols.snapshot(self.slot)!r})"


for _name, (_dtype, _) in _FIELDS.items():
    _kind = {np.float64: float, np.bool_: bool}.get(_dtype, int)
    setattr(MetaView, _name, _Field(_name, _kind))
