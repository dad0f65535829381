"""Service tiers (OpenAI's `service_tier` field): who is served first, with which SLO and which reserved share.

Three tiers, as in OpenAI's API:

* `priority` — the **guaranteed** class. Its `share` (0..1) of every worker's decode slots (`max_num_seqs`),
  KV blocks and per-step token budget is reserved for it: lent to the other tiers while no priority request
  needs it, taken back at the next step (elastic requests are preempted, flex first, counted per tier).
* `default` and `flex` — the **elastic** classes: they share the rest. Their order is earliest virtual
  deadline first: `arrival_s + horizon_s / weight`, where `horizon_s` is the tier's TTFT SLO (or
  `BEST_EFFORT_HORIZON_S` without one) and `weight` is the tier's weight (default 1, flex 0.5: flex yields
  first). A request's key is fixed when it arrives, yet the order is the order of SLO slack: the request
  whose deadline is nearest (least slack left, longest queued relative to its SLO) goes first. Load and
  transfer progress enter through admission (`pdserve.conductor.admission`): a request whose predicted TTFT
  or TPOT misses its SLO under the current load is refused before it queues.

A tier without an SLO is best effort: admission never refuses it by prediction (only a full queue does).

    --service-tier priority:ttft_ms=500,tpot_ms=100,share=0.3 --service-tier default:ttft_ms=2000
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from pdserve.errors import InvalidRequestError

SERVICE_TIERS = ("priority", "default", "flex")  # SLA classes, best first (storage tiers: kv_meta.STORAGE_TIERS)
AUTO = "auto"
BEST_EFFORT_HORIZON_S = 30.0  # an elastic tier without a TTFT SLO orders as if it had this one
_WEIGHTS = {"priority": 1.0, "default": 1.0, "flex": 0.5}
_RANK = {"priority": 0, "default": 1, "flex": 1}  # priority always ahead; default and flex by deadline


def retention_weight(name: str) -> float:
    """How much a block a tier's requests use is worth keeping in a KV tier, relative to `default`'s: the
    tier's weight, doubled for the guaranteed tier (so at equal heat a priority prefix outlives a default one,
    which outlives a flex one; `pdserve.core.kvstore.kv_meta.StagedPolicy`). An unknown name counts as default."""
    return _WEIGHTS.get(name, 1.0) * (2.0 if _RANK.get(name) == 0 else 1.0)


@dataclass(frozen=True)
class ServiceTier:
    name: str
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    share: float = 0.0  # reserved fraction of each worker's capacity (priority only)
    weight: float = 1.0

    @property
    def has_slo(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    @property
    def rank(self) -> int:
        return _RANK[self.name]

    @property
    def horizon_s(self) -> float:
        base = self.ttft_ms / 1000.0 if self.ttft_ms is not None else BEST_EFFORT_HORIZON_S
        return base / self.weight


def parse_service_tier(spec: str) -> ServiceTier:
    """`NAME:ttft_ms=X,tpot_ms=Y[,share=Z][,weight=W]` -> ServiceTier; InvalidRequestError naming the fault."""
    name, _, rest = str(spec).partition(":")
    name = name.strip()
    if name not in SERVICE_TIERS:
        raise InvalidRequestError(f"--service-tier {spec!r}: unknown tier {name!r}; choose from "
                                  f"{', '.join(SERVICE_TIERS)}", param="service_tier")
    fields: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in ("ttft_ms", "tpot_ms", "share", "weight") or key in fields:
            raise InvalidRequestError(f"--service-tier {spec!r}: expected NAME:ttft_ms=X,tpot_ms=Y[,share=Z]"
                                      f"[,weight=W], got {item!r}", param="service_tier")
        try:
            fields[key] = float(value)
        except ValueError:
            raise InvalidRequestError(f"--service-tier {spec!r}: {key} must be a number, got {value!r}",
                                      param="service_tier") from None
    _check_fields(spec, name, fields)
    return ServiceTier(name, fields.get("ttft_ms"), fields.get("tpot_ms"), fields.get("share", 0.0),
                       fields.get("weight", _WEIGHTS[name]))


def _check_fields(spec: str, name: str, fields: dict[str, float]) -> None:
    for key in ("ttft_ms", "tpot_ms", "weight"):
        if key in fields and not fields[key] > 0:
            raise InvalidRequestError(f"--service-tier {spec!r}: {key} must be positive", param="service_tier")
    if "share" in fields:
        if name != "priority":
            raise InvalidRequestError(f"--service-tier {spec!r}: only the priority tier has a reserved share",
                                      param="service_tier")
        if not 0 <= fields["share"] < 1:
            raise InvalidRequestError(f"--service-tier {spec!r}: share must be in [0, 1)", param="service_tier")


@dataclass(frozen=True)
class ServiceTiers:
    """The configured tiers (every one of `SERVICE_TIERS` exists; unconfigured ones are best effort)."""

    tiers: Mapping[str, ServiceTier] = field(default_factory=lambda: {n: ServiceTier(n, weight=_WEIGHTS[n])
                                                                       for n in SERVICE_TIERS})

    @classmethod
    def from_specs(cls, specs: Iterable[str | ServiceTier] = ()) -> ServiceTiers:
        tiers = dict(cls().tiers)
        seen = set()
        for spec in specs:
            tier = spec if isinstance(spec, ServiceTier) else parse_service_tier(spec)
            if tier.name in seen:
                raise InvalidRequestError(f"--service-tier {tier.name!r} given twice", param="service_tier")
            seen.add(tier.name)
            tiers[tier.name] = tier
        return cls(tiers)

    def __getitem__(self, name: str) -> ServiceTier:
        return self.tiers[name]

    @property
    def any_slo(self) -> bool:
        return any(t.has_slo for t in self.tiers.values())

    @property
    def reserved_share(self) -> float:
        return self.tiers["priority"].share

    def resolve(self, requested: str | None, key_default: str | None = None) -> str:
        """The tier a request runs in: `auto` (or none) is the API key's default, else `default`. Raises a 400
        naming the allowed values for anything else."""
        if requested is None or requested == AUTO:
            return key_default or "default"
        if requested not in SERVICE_TIERS:
            raise InvalidRequestError(f"unknown service_tier {requested!r}; allowed: {AUTO}, "
                                      f"{', '.join(SERVICE_TIERS)}", param="service_tier")
        return requested

    def specs(self) -> list[str]:
        """The configured tiers as `--service-tier` specs (to pass them on to workers)."""
        out = []
        for t in self.tiers.values():
            parts = [f"{k}={v:g}" for k, v in (("ttft_ms", t.ttft_ms), ("tpot_ms", t.tpot_ms)) if v is not None]
            if t.share:
                parts.append(f"share={t.share:g}")
            if t.weight != _WEIGHTS[t.name]:
                parts.append(f"weight={t.weight:g}")
            if parts:
                out.append(f"{t.name}:{','.join(parts)}")
        return out

    def with_tier(self, tier: ServiceTier) -> ServiceTiers:
        return ServiceTiers({**self.tiers, tier.name: replace(tier)})
