"""The attention backend seam (`pdserve.model.attention`, `pdserve.model.attention_registry`): backends by name,
`auto`'s choice by device (with the torch reference's fallback counted), a backend chosen by name that cannot run
here refused (never a fallback), and a backend registered from outside that the model uses with no caller
changed."""

from __future__ import annotations

import pytest
import torch

from pdserve.core.sampling_params import SamplingParams
from pdserve.errors import InvalidRequestError
from pdserve.model import attention, attention_registry, kernels
from pdserve.model.attention_cpu import CpuKernelAttention
from pdserve.model.attention_torch import TorchAttention


@pytest.fixture
def backends(monkeypatch):
    """The registry, restored after the test."""
    monkeypatch.setattr(attention_registry, "BACKENDS", dict(attention_registry.BACKENDS))
    return attention_registry.BACKENDS


def test_backends_by_name_and_auto_by_device(backends):
    assert isinstance(attention.select_backend("torch"), TorchAttention)
    assert isinstance(attention.select_backend("cpu_kernels"), CpuKernelAttention)
    before = kernels.fallback_count()
    assert isinstance(attention.select_backend("auto", torch.device("cpu")), CpuKernelAttention)
    assert kernels.fallback_count() == before
    # a device only the reference serves: chosen, and counted as a fallback
    assert isinstance(attention.select_backend("auto", torch.device("meta")), TorchAttention)
    assert kernels.fallback_count() == before + 1
    assert "meta" in kernels.fallback_reason()


def test_an_unknown_backend_is_a_one_line_error(backends):
    with pytest.raises(InvalidRequestError, match=r"unknown attention backend 'flash'; choose auto, cpu_kernels, "
                                                  r"torch$") as e:
        attention.select_backend("flash")
    assert e.value.param == "attention_backend"
    assert isinstance(e.value, ValueError)  # what a Python caller expects of a bad argument


def test_a_backend_chosen_by_name_that_cannot_run_here_is_an_error_not_a_fallback(backends):
    before = kernels.fallback_count()
    cpu = torch.device("cpu")
    for device, dtype, reason in ((torch.device("meta"), torch.float32, "run on CPU, not meta"),
                                  (cpu, torch.bfloat16, "run float32 models, not bfloat16")):
        with pytest.raises(InvalidRequestError, match=f"attention backend cpu_kernels cannot run this model on "
                                                      f"this machine: the compiled CPU kernels {reason}$") as e:
            attention.select_backend("cpu_kernels", device, dtype)
        assert e.value.param == "attention_backend"
    with kernels.disabled(), pytest.raises(InvalidRequestError, match=r"they are turned off \(PDSERVE_KERNELS=0"):
        attention.select_backend("cpu_kernels", cpu)
    assert kernels.fallback_count() == before  # refused, not counted as a fallback taken
    # the reference runs anywhere; auto still takes the kernels' counted per-call fallback path
    assert isinstance(attention.select_backend("torch", torch.device("meta"), torch.bfloat16), TorchAttention)
    with kernels.disabled():
        assert isinstance(attention.select_backend("auto", cpu), CpuKernelAttention)


class _Recording(TorchAttention):
    """A backend added from outside: the reference, recording each call."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def _count(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1

    def write_kv(self, *args):
        self._count("write_kv")
        return super().write_kv(*args)

    def decode(self, *args):
        self._count("decode")
        return super().decode(*args)

    def prefill(self, *args):
        self._count("prefill")
        return super().prefill(*args)


def test_a_registered_backend_runs_the_model_with_no_caller_changed(backends, tiny_llama_dir):
    from pdserve import LLM
    params = SamplingParams(temperature=0, max_tokens=4)
    prompts = [[11, 12, 13, 14, 15], [7] * 9]
    expected = [o.token_ids for o in LLM(str(tiny_llama_dir), block_size=4).generate(prompts, params)]
    made: list[_Recording] = []
    attention.register_backend("recording", lambda: made.append(_Recording()) or made[-1],
                               lambda device: device.type == "cpu")
    assert list(backends)[0] == "recording"  # auto tries it first
    llm = LLM(str(tiny_llama_dir), block_size=4)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert len(made) == 1  # chosen once, for the model
    calls = made[0].calls
    num_layers = 2
    assert calls["prefill"] >= len(prompts) * num_layers and calls["decode"] >= 3 * num_layers
    assert calls["write_kv"] >= 4 * num_layers
