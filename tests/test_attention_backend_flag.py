"""`--attention-backend` (`EngineConfig.attention_backend`): it reaches the engine (each backend runs the default
model to the same greedy tokens, through its own kernels), an unknown name is a one-line error on every command
that takes it and a ValueError from the Python API, and a backend named that cannot run here stops `pdserve
serve` with one line, naming why."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.bench.server_proc import free_port
from pdserve.core.sampling_params import SamplingParams
from pdserve.model import kernels
from pdserve.model.attention_cpu import CpuKernelAttention
from pdserve.model.attention_torch import TorchAttention

PROMPT = "The capital of France is"
NAMES = "choose auto, cpu_kernels, torch"


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _paths(part: str) -> dict[str, int]:
    return dict(kernels.paths_used().get(part, {}))


@pytest.mark.skipif(kernels.unavailable() is not None, reason=f"no compiled kernels: {kernels.unavailable()}")
def test_each_backend_runs_the_default_model_to_the_same_greedy_tokens():
    from pdserve import LLM
    params = SamplingParams(temperature=0.0, max_tokens=12)
    tokens, ran = {}, {}
    for name, cls in (("torch", TorchAttention), ("cpu_kernels", CpuKernelAttention)):
        llm = LLM(attention_backend=name)
        assert type(llm.engine.executor.model.attention) is cls
        before = _paths("decode_attention")
        tokens[name] = llm.generate(PROMPT, params)[0].token_ids
        after = _paths("decode_attention")
        ran[name] = {path for path in after if after[path] > before.get(path, 0)}
        del llm
    assert len(tokens["torch"]) == 12
    assert tokens["cpu_kernels"] == tokens["torch"]
    assert ran == {"torch": {"torch"}, "cpu_kernels": {"kernel"}}  # each ran its own decode attention


def test_an_unknown_backend_is_a_value_error_from_the_python_api():
    from pdserve import LLM
    with pytest.raises(ValueError, match=f"^unknown attention backend 'flash'; {NAMES}$"):
        LLM(attention_backend="flash")


@pytest.mark.parametrize("command", [("serve",), ("worker", "--role", "decode", "--join", "tcp://127.0.0.1:9"),
                                     ("generate", "--prompt", PROMPT)], ids=lambda c: c[0])
def test_an_unknown_backend_is_a_one_line_cli_error(command):
    proc = _cli(*command, "--attention-backend", "flash", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"error: unknown attention backend 'flash'; {NAMES}"]


def test_serve_stops_in_one_line_when_the_named_backend_cannot_run_its_workers_model():
    # bfloat16 weights: the compiled kernels run float32 only; named, they are refused (auto would fall back)
    proc = _cli("serve", "--mode", "colocated", "--instances", "1", "--port", str(free_port()), "--dtype",
                "bfloat16", "--attention-backend", "cpu_kernels", timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "error: worker colocated-0 could not start: attention backend cpu_kernels cannot run this model on this "
        "machine: the compiled CPU kernels run float32 models, not bfloat16"]
