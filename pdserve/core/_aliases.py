"""The flat module names `pdserve.core` had before it was grouped by concern, kept importable: importing
`pdserve.core.scheduler` gives the very module `pdserve.core.sched.scheduler` (one module object, one state),
with a `DeprecationWarning` naming the new place."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

GROUPS = {
    "sched": ("scheduler", "schedule", "waiting_queue", "policy", "step_budget", "hot_window", "decode_cadence",
              "kv_reservations", "stage_passes", "tier_share", "online_fit"),
    "kvstore": ("block_manager", "block_hash", "block_holds", "kv_codecs", "kv_columns", "kv_meta", "kv_ops",
                "kv_tier_index", "kv_tiers", "lru_queue", "u64map", "native"),
    "pd": ("decode_books", "push_range", "delivery", "production_pace"),
}
OLD_TO_NEW = {f"pdserve.core.{m}": f"pdserve.core.{g}.{m}" for g, mods in GROUPS.items() for m in mods}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in OLD_TO_NEW:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = OLD_TO_NEW[spec.name]
        warnings.warn(f"{spec.name} moved to {new}", DeprecationWarning, stacklevel=3)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        """Nothing to run: the module ran already, under its new name."""


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
