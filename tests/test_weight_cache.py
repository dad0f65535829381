"""The prepared-weights cache (`--weights-cache`, `pdserve.model.weight_cache`): a second load maps what the first
prepared and computes bit-identical outputs; another format or kernel build misses; a truncated or corrupted file
is rebuilt and counted; `off` writes nothing; two processes loading at once both end with correct weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.model import kernels, weight_cache

pytestmark = pytest.mark.skipif(not kernels.available() or kernels.qgemm_isa() == "none",
                                reason="the cache holds the compiled kernels' layouts: none on this host")

ROWS = (1, 8, 40, 300)  # the GEMM kernel, MKL's packed sgemm (fp32) or the int8-row kernel (q8_0), F.linear


@pytest.fixture(scope="module")
def model(tmp_path_factory, default_model_dir) -> str:
    from conftest import make_tiny_model
    return str(make_tiny_model(tmp_path_factory.mktemp("cached"), default_model_dir, arch="qwen2"))


def load(model: str, root: Path | str, weights: str = "fp32") -> LLM:
    return LLM(model, weights=weights, weights_cache=str(root), num_threads=2, num_kv_blocks=16)


def outputs(llm: LLM) -> list[torch.Tensor]:
    """Every linear layer's output for each row count in ROWS (fixed inputs), and the greedy tokens of a prompt."""
    m = llm.engine.executor.model
    gen = torch.Generator().manual_seed(0)
    linears = [f for layer in m.layers for f in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [m.lm_head]
    with torch.inference_mode():
        out = [f(torch.randn(rows, f.k if hasattr(f, "k") else f.weight.shape[1], generator=gen))
               for f in linears for rows in ROWS]
    tokens = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    return out + [torch.tensor(tokens[0].token_ids)]


def state(llm: LLM) -> dict:
    return llm.engine.executor.weights_cache


def cache_files(root: Path) -> list[Path]:
    return sorted(root.glob("*.safetensors"))


def assert_identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"output {i} differs"


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> dict[str, list[torch.Tensor]]:
    """Each format's outputs without a cache."""
    return {w: outputs(load(model, "off", w)) for w in ("fp32", "q8_0")}


@pytest.mark.parametrize("weights", ["fp32", "q8_0"])
def test_second_load_hits_and_computes_the_same(model, reference, tmp_path, weights):
    first = load(model, tmp_path, weights)
    assert state(first) == {"state": "miss", "rebuilds": 0, "write_failures": 0}
    assert len(cache_files(tmp_path)) == 1
    second = load(model, tmp_path, weights)
    assert state(second)["state"] == "hit"
    assert_identical(outputs(first), reference[weights])
    assert_identical(outputs(second), reference[weights])
    if weights == "q8_0":  # the quantized loader's counts as the load that prepared the blocks had them
        assert second.engine.executor.model.quant.sources == first.engine.executor.model.quant.sources


def test_another_format_or_kernel_build_misses(model, tmp_path, monkeypatch):
    load(model, tmp_path, "fp32")
    assert state(load(model, tmp_path, "q8_0"))["state"] == "miss"
    assert len(cache_files(tmp_path)) == 2  # one file per format
    assert state(load(model, tmp_path, "fp32"))["state"] == "hit"
    from pdserve.model.kernels import build
    real = build.build()
    monkeypatch.setattr(build, "build", lambda: real.with_name("pdserve_kernels-another-isa.so"))
    assert state(load(model, tmp_path, "fp32"))["state"] == "miss"
    assert len(cache_files(tmp_path)) == 2  # the format's file of the older key was replaced


def _damage(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(raw[:len(raw) // 2])
    else:  # one byte of tensor data (the last byte of the file: the last tensor's)
        raw[-1] ^= 0x5A
        path.write_bytes(raw)


@pytest.mark.parametrize("how", ["truncated", "corrupted"])
def test_a_damaged_file_is_rebuilt_and_counted(model, reference, tmp_path, how):
    load(model, tmp_path, "q8_0")
    [path] = cache_files(tmp_path)
    size = path.stat().st_size
    _damage(path, how)
    rebuilt = load(model, tmp_path, "q8_0")
    assert state(rebuilt) == {"state": "miss", "rebuilds": 1, "write_failures": 0}
    assert_identical(outputs(rebuilt), reference["q8_0"])
    assert path.stat().st_size == size  # written again, whole
    again = load(model, tmp_path, "q8_0")
    assert state(again) == {"state": "hit", "rebuilds": 0, "write_failures": 0}
    assert_identical(outputs(again), reference["q8_0"])


def test_off_writes_nothing(model, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_WEIGHTS_CACHE", str(tmp_path / "auto"))
    llm = LLM(model, weights="q8_0", weights_cache="off", num_threads=2, num_kv_blocks=16)
    assert state(llm)["state"] == "off"
    assert not (tmp_path / "auto").exists()
    assert state(LLM(model, weights="q8_0", num_threads=2, num_kv_blocks=16))["state"] == "miss"  # auto: the env's
    assert len(cache_files(tmp_path / "auto")) == 1


def test_an_unwritable_directory_is_counted_and_the_load_goes_on(model, reference, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    llm = load(model, blocker / "cache", "q8_0")
    assert state(llm) == {"state": "miss", "rebuilds": 0, "write_failures": 1}
    assert_identical(outputs(llm), reference["q8_0"])


_LOAD_IN_CHILD = """
import json, sys, torch
from pdserve import LLM
llm = LLM(sys.argv[1], weights="q8_0", weights_cache=sys.argv[2], num_threads=1, num_kv_blocks=16)
m = llm.engine.executor.model
x = torch.randn(4, m.config.hidden_size, generator=torch.Generator().manual_seed(1))
print(json.dumps({"state": llm.engine.executor.weights_cache["state"], "logits": m.logits(x).flatten().tolist()}))
"""


def test_two_processes_loading_at_once_both_end_with_correct_weights(model, tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", _LOAD_IN_CHILD, model, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    results = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    llm = load(model, "off", "q8_0")
    x = torch.randn(4, llm.engine.executor.model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    expected = llm.engine.executor.model.logits(x).flatten().tolist()
    assert [r["logits"] == expected for r in results] == [True, True]
    [path] = cache_files(tmp_path)  # one whole file, no temporary left behind
    assert not list(tmp_path.glob(".*"))
    assert state(load(model, tmp_path, "q8_0"))["state"] == "hit"
