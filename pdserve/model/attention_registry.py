"""The attention backends by name, in one table. Torch-free, so `--attention-backend` is checked on the command
line and in the gateway without loading torch; `pdserve.model.attention.select_backend` builds the chosen one.

- `cpu_kernels`: the compiled CPU kernels (`attention_cpu`); `auto` picks it on CPU.
- `torch`: the torch reference (`attention_torch`); serves every device.
- `auto` (the default): the first backend, in this table's order, that serves the model's device.

A new backend (CUDA kernels, say) is one `register_backend` call: `auto` tries it first on the devices it serves,
`--attention-backend NAME` (`EngineConfig.attention_backend`) names it, and no caller changes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.errors import UnknownNameError

AUTO = "auto"


@dataclass(frozen=True)
class BackendEntry:
    make: str | Callable[[], Any]  # "module:Class" (imported when a model is built), or a factory
    serves: Callable[[Any], bool]  # whether `auto` picks it for a model on this torch.device


BACKENDS: dict[str, BackendEntry] = {
    "cpu_kernels": BackendEntry("pdserve.model.attention_cpu:CpuKernelAttention", lambda device: device.type == "cpu"),
    "torch": BackendEntry("pdserve.model.attention_torch:TorchAttention", lambda device: True),
}


def register_backend(name: str, make: str | Callable[[], Any], serves: Callable[[Any], bool]) -> None:
    """Adds (or replaces) a backend; `auto` tries it before the ones already there."""
    others = {n: e for n, e in BACKENDS.items() if n != name}
    BACKENDS.clear()
    BACKENDS.update({name: BackendEntry(make, serves), **others})


def names() -> tuple[str, ...]:
    """What `--attention-backend` accepts: auto, then the registered backends."""
    return (AUTO, *BACKENDS)


def check(name: str) -> str:
    """`name`, when it is auto or a registered backend; else a one-line error that lists them."""
    if name != AUTO and name not in BACKENDS:
        raise UnknownNameError(f"unknown attention backend {name!r}; choose {', '.join(names())}",
                               param="attention_backend")
    return name


def make(name: str) -> Any:
    """A new instance of the registered backend `name` (not auto: `select_backend` resolves that); imports its
    module (torch)."""
    factory = BACKENDS[name].make
    if isinstance(factory, str):
        module, _, cls = factory.partition(":")
        factory = getattr(importlib.import_module(module), cls)
    return factory()
