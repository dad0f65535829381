"""The compiled part of the KV bookkeeping (`kvcore.c`: a block-hash map and a slot order), built at first use.

`kvcore.c` is a CPython extension module compiled with the host's C compiler the first time a block manager or
tier index is made (about a second; cached per source, compiler and CPU by `pdserve.cbuild`). Where it cannot
be built or loaded (no compiler, no Python headers, `PDSERVE_NATIVE=0`), callers take the pure-Python
implementations of the same contracts (`DictMap`, `ChunkQueue`) and say so through `fallback()`:
`fallback_count()` structures made that way, `fallback_reason()` why, logged once as a warning (workers
export it as `pdserve_fallbacks_total{kind="native_kv_core"}`). Nothing falls back silently.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import sysconfig
from pathlib import Path
from types import ModuleType

from pdserve import cbuild

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kvcore.c")
HEADERS = [Path(__file__).with_name(n) for n in ("u64map.h", "order.h", "hash_chain.h", "columns.h")]  # included by kvcore.c
_module: ModuleType | None = None
_reason: str | None = None
_fallbacks = 0


def load() -> ModuleType | None:
    """The compiled `_kvcore` module (built at first call), or None when it cannot be had."""
    global _module, _reason
    if _module is None and _reason is None:
        try:
            if os.environ.get("PDSERVE_NATIVE", "1") == "0":
                raise RuntimeError("turned off by PDSERVE_NATIVE=0")
            flags = ["-O2", "-fPIC", "-shared", "-std=gnu11", f"-I{sysconfig.get_paths()['include']}"]
            path = cbuild.build("pdserve_kvcore", [SOURCE], flags, HEADERS)
            loader = importlib.machinery.ExtensionFileLoader("_kvcore", str(path))
            module = importlib.util.module_from_spec(importlib.util.spec_from_loader("_kvcore", loader))
            loader.exec_module(module)
            _module = module
        except Exception as e:  # noqa: BLE001 - any build or load failure means the Python versions, counted
            _reason = f"{type(e).__name__}: {e}"
            log.warning("compiled KV bookkeeping unavailable, using the Python versions (slower): %s", _reason)
    return _module


def fallback() -> None:
    """Count one structure made in Python because the compiled module is unavailable."""
    global _fallbacks
    _fallbacks += 1


def fallback_count() -> int:
    return _fallbacks


def fallback_reason() -> str | None:
    return _reason
