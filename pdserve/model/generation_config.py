"""`--generation-config auto|vllm|PATH`: the sampling defaults of the fields a request leaves unset, read from a
model's `generation_config.json` as vLLM reads them (`pdserve.core.sampling_params.SamplingDefaults` applies them).

auto: the served model's own `generation_config.json` (a Hugging Face directory); the embedded GGUF model's
converted directory has none that samples, so it takes its model card's recommendation. vllm: nothing from the
model. PATH: that file, or the `generation_config.json` in that directory. No torch: the gateway reads it.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.core.sampling_params import DEFAULTABLE, SamplingDefaults
from pdserve.errors import InvalidRequestError

FILE_NAME = "generation_config.json"
# The embedded SmolLM2-135M-Instruct's model card (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct, "How to
# use") generates with
#     outputs = model.generate(inputs, max_new_tokens=50, temperature=0.2, top_p=0.9, do_sample=True)
# (its GGUF carries no sampling fields); at OpenAI's temperature 1.0 this 135M model answers gibberish.
EMBEDDED_MODEL_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}
EMBEDDED_MODEL_SOURCE = "the SmolLM2-135M-Instruct model card's recommendation"
# Fields of vLLM's default sampling params pdserve does not sample with: named at start when a file sets them
# to anything but their neutral value (`do_sample` is ignored, as vLLM ignores it)
NOT_DONE = {"repetition_penalty": 1.0, "min_p": 0.0, "max_new_tokens": None}


def sampling_defaults(choice: str, model: str | None, model_dir: str | Path) -> SamplingDefaults:
    """The defaults `--generation-config choice` puts in force for `model` (None: the embedded default), whose
    Hugging Face directory is `model_dir`. A bad path or an unreadable file: a one-line `InvalidRequestError`."""
    if choice == "vllm":
        return SamplingDefaults()
    if choice == "auto":
        if _is_embedded(model):
            return SamplingDefaults(dict(EMBEDDED_MODEL_DEFAULTS), EMBEDDED_MODEL_SOURCE)
        path = Path(model_dir) / FILE_NAME
        if not path.is_file():
            return SamplingDefaults(source=f"none from the model (it has no {FILE_NAME})")
        return read_generation_config(path)
    path = Path(choice).expanduser()
    if path.is_dir():
        path = path / FILE_NAME
        if not path.is_file():
            raise _error(f"{choice!r} holds no {FILE_NAME}")
    elif not path.is_file():
        raise _error(f"{choice!r} does not exist (give auto, vllm, a {FILE_NAME} or the directory holding one)")
    return read_generation_config(path)


def read_generation_config(path: Path) -> SamplingDefaults:
    """The sampling defaults a Hugging Face `generation_config.json` sets (only the fields it names)."""
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise _error(f"cannot read {str(path)!r}: {getattr(e, 'strerror', None) or e}") from None
    except ValueError as e:
        raise _error(f"{str(path)!r} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise _error(f"{str(path)!r} is not a JSON object")
    values = {k: config[k] for k in DEFAULTABLE if config.get(k) is not None}
    ignored = tuple(f"{k}={config[k]}" for k, neutral in NOT_DONE.items() if config.get(k) not in (None, neutral))
    source = f"the generation config {str(path)!r}" if values else f"none from the model ({str(path)!r} sets none)"
    try:
        return SamplingDefaults(values, source, ignored)
    except InvalidRequestError as e:
        raise _error(f"{str(path)!r}: {e.message}") from None


def _is_embedded(model: str | None) -> bool:
    """Whether `model` is the embedded SmolLM2 GGUF (None, or its path given)."""
    if model is None:
        return True
    path = Path(model).expanduser()
    if path.suffix != ".gguf":
        return False
    from pdserve.errors import ModelNotFoundError
    from pdserve.model.loader import default_model_path
    try:
        return path.resolve() == default_model_path().resolve()
    except ModelNotFoundError:
        return False


def _error(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"--generation-config: {message}", param="generation_config")
