"""The routing policies by name (`--routing`): `least-loaded` and `prefix-affinity` (`pdserve.conductor.routing`),
`predicted-ttft` (`pdserve.conductor.ttft_routing`, which builds on them)."""

from __future__ import annotations

from pdserve.conductor.routing import LeastLoaded, PrefixAffinity, RoutingPolicy
from pdserve.conductor.ttft_routing import PredictedTtft

POLICIES = {"least-loaded": LeastLoaded, "prefix-affinity": PrefixAffinity, "predicted-ttft": PredictedTtft}


def make_routing_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name]()
