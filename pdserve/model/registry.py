"""The model architectures pdserve runs, in one table: a Hugging Face architecture (config.json's
`architectures`, else its `model_type`) -> the decoder family `ModelConfig` reads the config as, and the class
that runs it. Both the engine and the simulator read this table: `ModelConfig.from_hf_dict` looks the
architecture up (an unknown one is a one-line `UnsupportedModelError`), the engine builds `model_class(config)`,
and the simulator describes the same config (`pdserve.sim.hardware.ModelSpec.from_config`).

Pure Python (the simulator imports it): the model class is named as "module:Class" and imported only when the
engine asks for it.

A new architecture is one `register(Architecture(...))` line here (and, for a new decoder, its module).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from pdserve.errors import UnsupportedModelError


@dataclass(frozen=True)
class Architecture:
    name: str  # config.json's `architectures[0]`, e.g. "LlamaForCausalLM"
    model_type: str  # config.json's `model_type`, e.g. "llama" (read when `architectures` is missing)
    family: str  # `ModelConfig.family`: which biases and defaults the decoder has ("llama", "qwen2")
    runtime: str = "pdserve.model.llama:LlamaModel"  # "module:Class" that runs it (takes a ModelConfig)


ARCHITECTURES: dict[str, Architecture] = {}


def register(arch: Architecture) -> None:
    ARCHITECTURES[arch.name] = arch


register(Architecture("LlamaForCausalLM", "llama", "llama"))
register(Architecture("MistralForCausalLM", "mistral", "llama"))  # without a sliding window
register(Architecture("Qwen2ForCausalLM", "qwen2", "qwen2"))


def architecture_of(cfg: dict) -> Architecture:
    """The registered architecture of a config.json dict: the first of its `architectures` that is registered,
    else the one registered for its `model_type`."""
    archs = cfg.get("architectures") or []
    found = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if found is None and not archs:
        found = next((a for a in ARCHITECTURES.values() if a.model_type == cfg.get("model_type")), None)
    if found is None:
        raise UnsupportedModelError(f"unsupported architecture {archs or cfg.get('model_type')!r}; pdserve runs "
                                    f"{sorted(ARCHITECTURES)}")
    return found


def model_class(architecture: str) -> type:
    """The class that runs a registered architecture (imports its module: torch)."""
    if architecture not in ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported architecture {architecture!r}; pdserve runs "
                                    f"{sorted(ARCHITECTURES)}")
    module, _, name = ARCHITECTURES[architecture].runtime.partition(":")
    return getattr(importlib.import_module(module), name)
