"""The model registry (`pdserve.model.registry`): one entry gives an architecture to the engine (the class it
builds) and to the simulator (the description it times), and an unknown architecture is a one-line error on
both sides."""

from __future__ import annotations

import json
import shutil

import pytest

from pdserve.core.sampling_params import SamplingParams
from pdserve.errors import UnsupportedModelError
from pdserve.model import registry
from pdserve.model.config import ModelConfig
from pdserve.model.llama import LlamaModel
from pdserve.sim.hardware import get_model, model_from_hf_config

TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 100, "torch_dtype": "float32"}
BUILT: list[object] = []


class RecordingModel(LlamaModel):
    """A second "family": the Llama decoder, recording that the engine built it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        BUILT.append(self)


@pytest.fixture
def fake_arch(monkeypatch):
    monkeypatch.setattr(registry, "ARCHITECTURES", dict(registry.ARCHITECTURES))
    registry.register(registry.Architecture("FakeForCausalLM", "fake", "llama",
                                            runtime="test_model_registry:RecordingModel"))
    return {**TINY, "architectures": ["FakeForCausalLM"]}


def test_one_registration_reaches_the_engine_config_and_the_simulator(fake_arch):
    config = ModelConfig.from_hf_dict(fake_arch)
    assert (config.architecture, config.family) == ("FakeForCausalLM", "llama")
    assert registry.model_class(config.architecture) is RecordingModel
    spec = model_from_hf_config(fake_arch, "fake")
    assert (spec.num_layers, spec.num_kv_heads, spec.hd, spec.dtype_bytes) == (2, 2, 16, 4)
    assert ModelConfig.from_hf_dict({**TINY, "model_type": "fake"}).architecture == "FakeForCausalLM"


def test_the_engine_builds_the_registered_class(fake_arch, tiny_llama_dir, tmp_path):
    from pdserve import LLM
    model_dir = tmp_path / "fake"
    shutil.copytree(tiny_llama_dir, model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, "architectures": ["FakeForCausalLM"]}))
    params = SamplingParams(temperature=0, max_tokens=3)
    expected = LLM(str(tiny_llama_dir), block_size=4).generate([[11, 12, 13]], params)[0].token_ids
    BUILT.clear()
    assert LLM(str(model_dir), block_size=4).generate([[11, 12, 13]], params)[0].token_ids == expected
    assert len(BUILT) == 1


def test_an_unknown_architecture_is_a_one_line_error_for_the_engine_and_the_simulator(tmp_path):
    cfg = {**TINY, "architectures": ["MixtralForCausalLM"]}
    message = r"^unsupported architecture \['MixtralForCausalLM'\]; pdserve runs \['LlamaForCausalLM', "
    with pytest.raises(UnsupportedModelError, match=message) as e:
        ModelConfig.from_hf_dict(cfg)
    assert "\n" not in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=message):
        get_model(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'Nope'"):
        registry.model_class("Nope")
