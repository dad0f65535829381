"""Models on quantized weights (`--weights q8_0 | q4 | auto`): greedy output on held-constant prompts equals a
torch dequantize-then-matmul reference model (the same quantized weights, dequantized to fp32 at load and run
on the torch path), for the embedded GGUF (its own Q4_1 / Q8_0 blocks) and for Hugging Face checkpoints
(requantized at load); and the flag's errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from test_quant_kernels import assert_bf16_close, int8_rows_reference

from pdserve import LLM, SamplingParams
from pdserve.engine import model_executor
from pdserve.errors import PdserveError
from pdserve.model import kernels, quant
from pdserve.model.linear import Linear

pytestmark = pytest.mark.skipif(kernels.qgemm_isa() == "none", reason="no quantized kernels on this host")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
LINEAR_SUFFIXES = tuple(f"{p}_proj.weight" for p in ("q", "k", "v", "o", "gate", "up", "down"))


def generate(llm: LLM) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(PROMPTS, GREEDY)]


def reference_tokens(monkeypatch, model: str | None, kind: str | None, head_kind: str | None) -> list[list[int]]:
    """Greedy tokens of the fp32 model whose layers' linear weights are quantized to `kind` and its lm_head to
    `head_kind` (the embedding lookup stays as it is), dequantized at load, all on the torch path. None: as they
    are (the embedded GGUF's fp32 weights are its blocks dequantized: Q4_1 layers, a Q8_0 tied lm_head)."""
    load = model_executor.load_safetensors_dir

    def dequantized(path):
        weights = load(path)
        return {n: quant.quantize(w, kind).dequantize() if kind and n.endswith(LINEAR_SUFFIXES) else w
                for n, w in weights.items()}

    with monkeypatch.context() as m:
        m.setattr(model_executor, "load_safetensors_dir", dequantized)
        with kernels.disabled():
            llm = LLM(model, weights="fp32", num_threads=2)
            if head_kind is not None:  # (a tied lm_head is the embedding's weight until here)
                head = llm.engine.executor.model.lm_head
                llm.engine.executor.model.lm_head = Linear(quant.quantize(head.weight, head_kind).dequantize())
            return generate(llm)


@pytest.fixture
def fp32_rows(monkeypatch):
    """Q8_0 weights on fp32 rows at every row count (no int8-row kernel: quant.I8_ROWS empty), the arithmetic of
    the dequantized fp32 model; int8 rows have their own reference (test_int8_rows_match_...)."""
    monkeypatch.setattr(quant, "I8_ROWS", {})


@pytest.mark.parametrize("weights,kind", [("q4", None), ("q8_0", "q8_0")])
def test_default_model_matches_the_dequantized_reference(monkeypatch, fp32_rows, weights, kind):
    """The embedded Q4_1 GGUF: q4 runs its own blocks (Q4_1 layers, the Q8_0 tied embedding as lm_head), whose
    dequantized values are the fp32 model's weights; q8_0 requantizes the Q4_1 layers and keeps the Q8_0 head."""
    llm = LLM(weights=weights, num_threads=2)
    before = dict(kernels.paths_used().get("gemm", {}))
    tokens = generate(llm)
    used = {p: n - before.get(p, 0) for p, n in kernels.paths_used()["gemm"].items() if n > before.get(p, 0)}
    isa = kernels.qgemm_isa()
    assert llm.engine.executor.info.weights == weights
    if weights == "q4":
        assert used.get(f"q4_1_{isa}", 0) > 0 and used.get(f"q8_0_{isa}", 0) > 0
    assert set(used) <= {f"q4_1_{isa}", f"q8_0_{isa}", "q4_1_dequant", "q8_0_dequant"}, used  # no fp32 path
    assert tokens == reference_tokens(monkeypatch, None, kind, None)


@pytest.mark.parametrize("weights,kind", [("q4", "q4_1"), ("q8_0", "q8_0")])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_checkpoint_requantized_matches_the_reference(monkeypatch, fp32_rows, tmp_path, default_model_dir, weights,
                                                         kind, arch):
    """A Hugging Face fp32 checkpoint, requantized at load (qwen2: with q/k/v biases)."""
    from conftest import make_tiny_model
    model = str(make_tiny_model(tmp_path / arch, default_model_dir, arch=arch))
    llm = LLM(model, weights=weights, num_threads=2)
    assert llm.engine.executor.model.quant.sources == {f"{kind} requantized": 7 * 2 + 1}
    assert generate(llm) == reference_tokens(monkeypatch, model, kind, kind)


def torch_quant_linear(self: quant.QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """QuantLinear in torch: int8 rows (the exact integer sums, scaled) where quant.I8_ROWS says, else fp32 rows
    times the dequantized weight."""
    lo, hi = self.i8_rows
    if not lo <= x.shape[0] <= hi:
        return F.linear(x, quant.unpack(self.panels, self.kind, self.n, self.k), self.bias)
    p, blocks = self.panels.shape[0], self.k // quant.QK
    d = self.panels[..., :quant.QW * 2].contiguous().view(torch.float16)  # [panels, blocks, QW]
    q = self.panels[..., quant.QW * 2:].contiguous().view(torch.int8).reshape(p, blocks, quant.QK, quant.QW)
    b = quant.QBlocks("q8_0", q.permute(0, 3, 1, 2).reshape(-1, blocks, quant.QK)[:self.n],
                      d.permute(0, 2, 1).reshape(-1, blocks)[:self.n])
    y = int8_rows_reference(x, b).float()
    return y if self.bias is None else y + self.bias


@pytest.mark.skipif(kernels.qgemm_i8_isa() == "none", reason="no VNNI int8-row kernel on this host")
@pytest.mark.parametrize("arch", ["default", "qwen2"])
def test_int8_rows_match_a_torch_reference_that_quantizes_rows_alike(monkeypatch, tmp_path, default_model_dir, arch):
    """Q8_0 on int8 rows (the prefill of the three prompts, 16-128 rows: quant.I8_ROWS): each linear layer's output
    in the model's own forward equals, within fp32 summation, a torch reference on the same input that quantizes the
    rows alike (exact integer sums, scaled). (Not greedy tokens against a torch model: rounding to int8 is
    discontinuous, so fp32-level differences elsewhere in a torch model change some rows' int8 values and, over 30
    layers, a near-tie token; quality is measured instead: bench_weights_quality.py.)"""
    from conftest import make_tiny_model
    model = None if arch == "default" else str(make_tiny_model(tmp_path / arch, default_model_dir, arch=arch))
    llm = LLM(model, weights="q8_0", num_threads=2, enable_prefix_caching=False)
    kernel, checked = quant.QuantLinear.__call__, []

    def compared(self, x):
        y = kernel(self, x)
        if self.kernel_format(x.shape[0]) == kernels.FMT_Q8_0_I8:
            with kernels.disabled():
                ref = torch_quant_linear(self, x)
            bound = 1e-6 * (x.abs() @ quant.unpack(self.panels, self.kind, self.n, self.k).abs().T) + 1e-5
            checked.append(bool(((y - ref).abs() <= bound).all()))
        return y

    monkeypatch.setattr(quant.QuantLinear, "__call__", compared)
    generate(llm)
    layers = llm.engine.executor.model.config.num_layers
    assert len(checked) >= 4 * layers and all(checked)


@pytest.mark.parametrize("weights", ["q4", "q8_0"])
def test_bf16_rows_in_the_models_forward_match_a_bf16_reference(monkeypatch, weights):
    """A prompt of more than quant.BF16_ROWS tokens prefills on the bf16 path (where the CPU multiplies bf16
    natively: AMX here, injected elsewhere): each linear layer's output in the model's own forward, the lm_head's
    too, against the bf16 dequantize-then-matmul reference on the same input. (Not greedy tokens against a torch
    model: the bf16 product is rounded, so fp32-level differences elsewhere move some roundings and, over 30
    layers, a near-tie token; the quality is measured: bench_weights_quality.py.)"""
    monkeypatch.setattr(kernels, "bf16_isa", lambda: "amx")
    llm = LLM(weights=weights, num_threads=2, enable_prefix_caching=False)
    kernel, checked = quant.QuantLinear.__call__, []

    def compared(self, x):
        y = kernel(self, x)
        if x.shape[0] >= self.bf16_from:
            with kernels.disabled():
                assert_bf16_close(y, x, quant.unpack(self.panels, self.kind, self.n, self.k), self.bias)
            checked.append(self.n)
        return y

    monkeypatch.setattr(quant.QuantLinear, "__call__", compared)
    before = dict(kernels.paths_used().get("gemm", {}))
    prompt = " ".join(PROMPTS * 12)  # ~130 tokens: one prefill chunk past BF16_ROWS
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))
    layers = llm.engine.executor.model.config.num_layers
    assert len(out[0].prompt_token_ids) >= max(quant.BF16_ROWS["amx"].values())
    assert len(checked) >= 4 * layers + 1, len(checked)  # the layers' products and the prompt's logits
    assert llm.engine.executor.model.lm_head.n in checked
    bf16 = sum(n - before.get(p, 0) for p, n in kernels.paths_used()["gemm"].items() if p.endswith("_bf16"))
    assert bf16 == len(checked)


def test_auto_picks_the_measured_format_and_says_so(caplog):
    llm = LLM(weights="auto", num_threads=2)
    chosen = quant.AUTO[kernels.qgemm_isa()]
    assert llm.engine.executor.info.weights == chosen
    said = [r for r in caplog.records if "--weights auto" in r.getMessage()]
    assert len(said) == 1 and f"-> {chosen} " in said[0].getMessage()
    assert said[0].levelname == "WARNING"  # (on stderr without a logging setup, as the CLI runs)


def test_a_quantized_format_where_it_cannot_run_is_an_error():
    cpu = torch.device("cpu")
    with pytest.raises(PdserveError, match="--weights q8_0 cannot run here: the model must run on CPU in float32"):
        quant.resolve_weights("q8_0", cpu, torch.bfloat16)
    with kernels.disabled():
        with pytest.raises(PdserveError, match="--weights q4 cannot run here: they are turned off"):
            quant.resolve_weights("q4", cpu, torch.float32)
        assert quant.resolve_weights("auto", cpu, torch.float32) == "fp32"
    assert quant.resolve_weights("fp32", cpu, torch.bfloat16) == "fp32"


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"], ["profile", "--output", "x.json"]])
def test_a_bad_weights_value_is_a_one_line_error(command):
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", *command, "--weights", "q3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr == "error: --weights must be one of auto, fp32, q8_0, q4, got 'q3'\n"
