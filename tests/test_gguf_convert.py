"""The GGUF converter run from scratch on the embedded model (every other test reuses the warm cache).

The result is compared with the cached conversion rather than generated from: that directory is what the
end-to-end tests generate from and what test_model_hf checks against transformers' own GGUF loading."""

from __future__ import annotations

import json
import stat

import numpy as np
from safetensors.numpy import load_file

from pdserve.model import gguf_convert
from pdserve.model.loader import resolve_model_dir

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def assert_same_tensors(fresh_file, cached_file) -> None:
    fresh, cached = load_file(str(fresh_file)), load_file(str(cached_file))
    assert sorted(fresh) == sorted(cached)
    for name, tensor in fresh.items():
        assert tensor.dtype == np.float32, name
        assert np.array_equal(tensor, cached[name]), name


def _must_not_convert(path, out_dir):
    raise AssertionError(f"converted {path} again")


def test_the_embedded_gguf_converts_from_scratch(tmp_path, monkeypatch, default_model_dir):
    """A fresh conversion is a whole HF directory, equal to the cached one (an output change without a
    CONVERTER_VERSION bump would leave every warm cache stale), and the next start reuses it."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    fresh = resolve_model_dir(None)
    assert fresh.parent == tmp_path / "gguf"  # converted here, not taken from the warm cache
    assert sorted(p.name for p in fresh.iterdir()) == FILES
    assert [p.name for p in fresh.parent.iterdir()] == [fresh.name]  # no half-written .convert-* left behind
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in fresh.iterdir()}
    assert set(modes.values()) == {"0o644"}, modes  # peers running as other users read the files too

    config = json.loads((fresh / "config.json").read_text())
    assert (config["architectures"], config["hidden_size"], config["num_hidden_layers"]) == \
        (["LlamaForCausalLM"], 576, 30)
    template = json.loads((fresh / "tokenizer_config.json").read_text()).get("chat_template")
    assert template and "<|im_start|>" in template
    for name in FILES:
        if name.endswith(".json"):
            assert json.loads((fresh / name).read_text()) == json.loads((default_model_dir / name).read_text()), name
    assert_same_tensors(fresh / "model.safetensors", default_model_dir / "model.safetensors")

    # The second start converts nothing (a redone conversion would be thrown away unseen: the directory exists).
    monkeypatch.setattr(gguf_convert, "convert_gguf", _must_not_convert)
    assert resolve_model_dir(None) == fresh
