"""Quantized weights (`pdserve.model.quant`, `kernels/qgemm.c`): the blocks against ggml's own (gguf-py's
reference quantizers and dequantizers, the embedded GGUF file's tensors), and the kernels against a torch
dequantize-then-matmul reference, on this host's build and (in a subprocess) the AVX2 build."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdserve.model import kernels, quant

pytestmark = pytest.mark.skipif(kernels.qgemm_isa() == "none",
                                reason=f"no quantized kernels here ({kernels.unavailable()} / {kernels.qgemm_isa()})")

GGUF_TYPES = {"q8_0": "Q8_0", "q4_1": "Q4_1"}


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next(line for line in f if line.startswith("flags")).split(":")[1].split())


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> quant.QBlocks:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return quant.quantize(w, kind)


def test_qgemm_isa_is_the_hosts():
    flags, cflags = cpu_flags(), os.environ.get("PDSERVE_KERNEL_CFLAGS", "")
    expected = ("avx512" if "avx512f" in flags and "-mno-avx512f" not in cflags else
                "avx2" if {"avx2", "fma", "f16c"} <= flags and "-mno-avx2" not in cflags else "none")
    assert kernels.qgemm_isa() == expected


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
def test_quantize_is_ggmls_reference(kind):
    """Requantizing at load rounds as ggml does: the same blocks as gguf-py's reference quantizer."""
    import gguf.quants
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(1))
    w[3, :32] = 0.0  # an all-zero block (d = 0)
    w[5, :32] = torch.tensor([127.0, 2.5, -2.5, 0.5, -1.5] + [0.0] * 27)  # q8_0: d = 1, ties round away from 0
    ref = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[GGUF_TYPES[kind]])
    ours, theirs = quant.quantize(w, kind), quant.from_gguf(ref, GGUF_TYPES[kind])
    assert torch.equal(ours.q, theirs.q) and torch.equal(ours.d, theirs.d)
    assert ours.m is None if kind == "q8_0" else torch.equal(ours.m, theirs.m)
    deq = gguf.quants.dequantize(ref, gguf.GGMLQuantizationType[GGUF_TYPES[kind]])
    assert torch.equal(ours.dequantize(), torch.from_numpy(np.ascontiguousarray(deq)).reshape(40, 96))


def test_the_gguf_files_own_blocks_dequantize_as_gguf_does():
    """The embedded file's Q4_1 and Q8_0 tensors read as blocks (q/k rows in the converted model's order)
    dequantize to what the converter wrote for them."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from pdserve.model.gguf_convert import _unpermute, raw_tensors
    from pdserve.model.loader import default_model_path as model_path
    default_model_path = model_path()
    raw = raw_tensors(default_model_path)
    reader = {t.name: t for t in GGUFReader(str(default_model_path)).tensors}
    cases = {"model.layers.0.mlp.down_proj.weight": ("blk.0.ffn_down.weight", None),
             "model.layers.1.self_attn.q_proj.weight": ("blk.1.attn_q.weight", 9),
             "model.layers.2.self_attn.k_proj.weight": ("blk.2.attn_k.weight", 3),
             "model.embed_tokens.weight": ("token_embd.weight", None)}
    for name, (gguf_name, heads) in cases.items():
        t = reader[gguf_name]
        expected = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        expected = expected if heads is None else _unpermute(expected, heads)
        blocks = quant.from_gguf(raw[name][1], raw[name][0])
        assert raw[name][0] == t.tensor_type.name and blocks is not None
        assert torch.equal(blocks.dequantize(), torch.from_numpy(np.ascontiguousarray(expected, np.float32)))
    q4_0 = quant.from_gguf(np.zeros((1, 18), np.uint8), "Q4_0")
    assert q4_0.kind == "q4_1" and q4_0.m is not None and quant.from_gguf(np.zeros((1, 210), np.uint8), "Q6_K") is None


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
@pytest.mark.parametrize("n,k", [(16, 32), (37, 64), (200, 576), (96, 1536)])
def test_packed_blocks_dequantize_exactly(kind, n, k):
    """The kernel's layout holds the blocks: its C and torch dequantizations give the reference's weights."""
    b = random_blocks(kind, n, k)
    panels = quant.pack(b)
    assert panels.shape[-1] == kernels._lib.pd_qblock_bytes(quant.KINDS[kind])
    assert torch.equal(kernels.qdequant(panels, quant.KINDS[kind], n, k), b.dequantize())
    assert torch.equal(quant.unpack(panels, kind, n, k), b.dequantize())


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 15, 16, 17, 33, 64])
@pytest.mark.parametrize("n,k", [(16, 32), (37, 64), (200, 576), (96, 1536)])
def test_qgemm_matches_dequantize_then_matmul(kind, rows, n, k):
    b = random_blocks(kind, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2))
    ref = x @ b.dequantize().T
    panels = quant.pack(b)
    torch.testing.assert_close(kernels.qgemm(x, panels, quant.KINDS[kind], n, k), ref, rtol=1e-4, atol=1e-4)
    wide = torch.randn(rows, 2 * k)[:, :k]  # a row stride wider than k
    torch.testing.assert_close(kernels.qgemm(wide, panels, quant.KINDS[kind], n, k), wide @ b.dequantize().T,
                               rtol=1e-4, atol=1e-4)


def assert_bf16_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """`got` is the bf16 path's x @ w^T (+ bias): the rows and the dequantized weight `w` rounded to bf16 and summed
    exactly (float64), within bf16's rounding of the product (2^-8 of it: oneDNN returns bf16, the bias is added
    after) plus fp32 summation error."""
    xb, wb = x.bfloat16().double(), w.bfloat16().double()
    product = xb @ wb.T
    ref = product if bias is None else product + bias.double()
    bound = 2.0 ** -8 * product.abs() + 1e-5 * (xb.abs() @ wb.abs().T) + 1e-6
    assert ((got.double() - ref).abs() <= bound).all(), ((got.double() - ref).abs() - bound).max()


def expected_path(lin: quant.QuantLinear, rows: int) -> str:
    """What the rule says a call of `rows` rows takes (KERNEL_ROWS, BF16_ROWS), as `paths_used()` names it."""
    return (lin.path(lin.kernel_format(rows)) if rows <= lin.max_rows else
            f"{lin.kind}_bf16" if rows >= lin.bf16_from else f"{lin.kind}_dequant")


@pytest.mark.parametrize("rows", [1, 16, 32, 33, 128, 300])
def test_quant_linear_paths_match_the_reference(rows):
    """Each path QuantLinear takes (the kernel for few rows, dequantize + F.linear for many, in bf16 where the CPU
    multiplies it natively) against its torch reference, counted as taken; with the kernels turned off, torch's
    dequantization in fp32, counted as a fallback."""
    b = random_blocks("q4_1", 70, 128)
    bias = torch.randn(70)
    x = torch.randn(rows, 128)
    lin = quant.QuantLinear(b, bias)
    path = expected_path(lin, rows)
    before = kernels.paths_used().get("gemm", {}).get(path, 0)
    if path == "q4_1_bf16":
        assert_bf16_close(lin(x), x, b.dequantize(), bias)
    else:
        torch.testing.assert_close(lin(x), F.linear(x, b.dequantize(), bias), rtol=1e-4, atol=1e-4)
    assert kernels.paths_used()["gemm"][path] == before + 1
    fallbacks = kernels.fallback_count()
    with kernels.disabled():
        torch.testing.assert_close(lin(x), F.linear(x, b.dequantize(), bias), rtol=1e-4, atol=1e-4)
    assert kernels.fallback_count() > fallbacks


@pytest.mark.skipif(os.environ.get("PDSERVE_KERNEL_CFLAGS") is not None, reason="already a nested build")
def test_the_avx2_build_passes_this_module(tmp_path):
    """On an AVX-512 host the AVX2 build (what an AVX2-only host compiles) runs this module too."""
    if not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    env = dict(os.environ, PDSERVE_KERNEL_CFLAGS="-mno-avx512f", PDSERVE_KERNEL_CACHE=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-x", __file__],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:]
    assert " passed, " in out.stdout and " failed" not in out.stdout
    # Skipped: this test (nested), and the int8-row tests where the CPU has no AVX-VNNI (AMD Zen 4: AVX512-VNNI only)
    allowed = {"already a nested build"} | ({"no VNNI int8-row kernel on this host"} if "avx_vnni" not in cpu_flags()
                                            else set())
    reasons = {ln.rsplit(": ", 1)[1] for ln in out.stdout.splitlines() if ln.startswith("SKIPPED")}
    assert "already a nested build" in reasons and reasons <= allowed, reasons


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_qgemm_is_bit_identical_to_the_fp32_kernel_on_the_dequantized_weight(kind, rows):
    """The weights are dequantized as torch rounds them and summed in the fp32 kernel's order: a GGUF's own
    blocks run exactly the arithmetic of the fp32 model converted from the file, wherever both use a kernel."""
    if kernels.isa() == "none":
        pytest.skip("no fp32 GEMM kernel on this host")
    b = random_blocks(kind, 200, 576, seed=rows)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(3))
    fp32 = kernels.gemm(x, kernels.PackedWeight(b.dequantize()))
    assert torch.equal(kernels.qgemm(x, quant.pack(b), quant.KINDS[kind], 200, 576), fp32)


def test_blocks_kept_in_a_huge_page_arena_compute_the_same():
    from pdserve.model.hugepages import Arena
    b, x = random_blocks("q8_0", 100, 192), torch.randn(4, 192)
    arena = Arena()
    arena.take(3)  # (not at the chunk's start)
    lin, held = quant.QuantLinear(b), quant.QuantLinear(b, arena=arena)
    assert held.panels.data_ptr() != lin.panels.data_ptr() and torch.equal(held.panels, lin.panels)
    assert torch.equal(held(x), lin(x))


def int8_rows_reference(x: torch.Tensor, b: quant.QBlocks) -> torch.Tensor:
    """Q8_0 blocks times rows quantized to int8 per block of 32 as ggml's quantize_row_q8_0 rounds them (fp32
    scale d = max|x| / 127, x / d rounded half away from zero): exact integer sums per block (in float64), scaled
    by both blocks' scales, summed over the blocks."""
    xb = x.reshape(x.shape[0], -1, quant.QK)
    d = xb.abs().amax(-1) / 127
    v = xb * torch.where(d > 0, 1 / d, torch.zeros_like(d)).unsqueeze(-1)
    q = v.sign() * (v.abs() + 0.5).floor()
    sums = torch.einsum("mbk,nbk->mnb", q.double(), b.q.double())  # |sum| <= 32 * 127 * 128: exact
    return (sums * d.double().unsqueeze(1) * b.d.double().unsqueeze(0)).sum(-1)


needs_i8 = pytest.mark.skipif(kernels.qgemm_i8_isa() == "none", reason="no VNNI int8-row kernel on this host")


def test_the_int8_row_kernel_is_the_hosts():
    """AVX-512 VNNI + VBMI, else AVX-VNNI, else none (the fp32-row kernel serves every row count: a decision)."""
    flags, cflags = cpu_flags(), os.environ.get("PDSERVE_KERNEL_CFLAGS", "")
    avx512 = kernels.qgemm_isa() == "avx512"
    expected = ("avx512" if avx512 and {"avx512_vnni", "avx512vbmi"} <= flags else
                "avx2" if kernels.qgemm_isa() != "none" and "avx_vnni" in flags and "-mno-avxvnni" not in cflags
                else "none")
    assert kernels.qgemm_i8_isa() == expected


@needs_i8
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 15, 16, 17, 33, 64])
@pytest.mark.parametrize("n,k", [(16, 32), (37, 64), (200, 576), (96, 1536)])
def test_int8_row_kernel_matches_the_int8_reference(rows, n, k):
    b = random_blocks("q8_0", n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(4)) * 3
    x[0, :32] = 0.0  # an all-zero block of a row (d = 0)
    x[-1, 32 % k:32 % k + 5] = torch.tensor([500.0, -499.0, 1.0, -1.0, 0.01])  # an outlier in a block
    ref = int8_rows_reference(x, b)
    scale = (x.abs() @ b.dequantize().abs().T).double()  # the size of the terms: fp32 summation error bound
    got = kernels.qgemm(x, quant.pack(b), kernels.FMT_Q8_0_I8, n, k).double()
    assert ((got - ref).abs() <= 1e-6 * scale + 1e-6).all(), (got - ref).abs().max()
    wide = torch.randn(rows, 2 * k)[:, :k]  # a row stride wider than k
    got = kernels.qgemm(wide, quant.pack(b), kernels.FMT_Q8_0_I8, n, k).double()
    assert ((got - int8_rows_reference(wide, b)).abs() <= 1e-6 * (wide.abs() @ b.dequantize().abs().T) + 1e-6).all()


@needs_i8
def test_quant_linear_runs_int8_rows_where_the_rule_says():
    """Q8_0 linears take the int8-row kernel for the row counts of quant.I8_ROWS (counted as *_i8), the fp32-row
    kernel elsewhere; q4_1 never."""
    lo, hi = quant.I8_ROWS[kernels.host_kind(kernels.qgemm_i8_isa())]
    b = random_blocks("q8_0", 70, 128)
    lin, q4 = quant.QuantLinear(b), quant.QuantLinear(random_blocks("q4_1", 70, 128))
    assert q4.kernel_format(lo) == quant.KINDS["q4_1"]
    for rows in (lo - 1, lo, min(hi, lin.max_rows, 300), *((hi, hi + 1) if hi < quant.ANY_ROWS else (2048,))):
        x = torch.randn(rows, 128)
        i8 = lo <= rows <= hi and rows <= lin.max_rows
        path = expected_path(lin, rows)
        assert path.endswith("_i8") == i8
        before = kernels.paths_used().get("gemm", {}).get(path, 0)
        if path == "q8_0_bf16":
            assert_bf16_close(lin(x), x, b.dequantize(), None)
        else:
            ref = int8_rows_reference(x, b).float() if i8 else x @ b.dequantize().T
            torch.testing.assert_close(lin(x), ref, rtol=1e-4, atol=1e-4)
        assert kernels.paths_used()["gemm"][path] == before + 1


def test_bf16_isa_is_the_hosts(monkeypatch):
    """AMX-BF16, else AVX512-BF16, else none, as the CPU says; oneDNN capped below AMX (ONEDNN_MAX_CPU_ISA) is
    the AVX512-BF16 path of the same CPU."""
    flags = cpu_flags()
    bf16 = "avx512_bf16" if "avx512_bf16" in flags else "none"
    assert kernels.bf16_isa() == ("amx" if {"amx_bf16", "amx_tile"} <= flags else bf16)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert kernels.bf16_isa() == bf16


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
@pytest.mark.parametrize("n,k", [(16, 32), (37, 64), (200, 576), (96, 1536)])
def test_bf16_dequantize_is_torchs_rounding(kind, n, k):
    """pd_qdequant_bf16t: the fp32 weight rounded to nearest even, bit for bit torch's .bfloat16(), transposed in
    the scratch it is given (and nothing past n * k values of it written)."""
    b = random_blocks(kind, n, k, seed=n)
    out = torch.full((n * k + 40,), 7.0, dtype=torch.bfloat16)
    w = kernels.qdequant_bf16t(quant.pack(b), quant.KINDS[kind], n, k, out)
    assert w.shape == (n, k) and w.dtype == torch.bfloat16 and w.stride() == (1, n)
    assert torch.equal(w, b.dequantize().bfloat16())
    assert (out[n * k:] == 7.0).all()


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
@pytest.mark.parametrize("rows", [96, 128, 517])
def test_bf16_rows_match_a_bf16_reference(monkeypatch, kind, rows):
    """Where the CPU multiplies bf16 (AMX here; injected elsewhere so the path runs on any host with the
    kernels), rows from BF16_ROWS take the bf16 path: the bf16 dequantize-then-matmul reference (with a bias),
    counted as *_bf16."""
    monkeypatch.setattr(kernels, "bf16_isa", lambda: "amx")
    b, bias = random_blocks(kind, 200, 576, seed=rows), torch.randn(200)
    lin = quant.QuantLinear(b, bias)
    assert lin.bf16_from == quant.BF16_ROWS["amx"][kind] and expected_path(lin, rows) == f"{kind}_bf16"
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(5))
    before = kernels.paths_used().get("gemm", {}).get(f"{kind}_bf16", 0)
    assert_bf16_close(lin(x), x, b.dequantize(), bias)
    assert kernels.paths_used()["gemm"][f"{kind}_bf16"] == before + 1


@pytest.mark.parametrize("bf16", ["amx", "avx512_bf16", "none"])
def test_the_prefill_rule_with_the_cpu_injected(monkeypatch, bf16):
    """Which path for which rows, per CPU: the kernels up to KERNEL_ROWS[isa] or BF16_ROWS[bf16] - 1 rows, bf16
    from BF16_ROWS[bf16] where it is measured, fp32 dequantize + F.linear past the kernels on a CPU without
    (native bf16 not measured, or none: a decision)."""
    monkeypatch.setattr(kernels, "bf16_isa", lambda: bf16)
    lin = quant.QuantLinear(random_blocks("q4_1", 70, 128))
    kernel_rows = quant.KERNEL_ROWS[lin.isa]
    if kernels.host_kind(bf16) in quant.BF16_ROWS:  # (AVX512-BF16: measured on AMD only)
        start = quant.BF16_ROWS[kernels.host_kind(bf16)]["q4_1"]
        assert lin.max_rows == min(kernel_rows, start - 1) and lin.bf16_from == start
        paths = [expected_path(lin, r) for r in (min(kernel_rows, start - 1), start, 4096)]
        assert paths == [f"q4_1_{lin.isa}", "q4_1_bf16", "q4_1_bf16"]
        if kernel_rows + 1 < start:  # (the AVX2 build's kernels stop at 32: fp32 in between)
            assert expected_path(lin, kernel_rows + 1) == "q4_1_dequant"
    else:
        assert lin.max_rows == kernel_rows and lin.bf16_from > 1 << 40
        assert [expected_path(lin, r) for r in (kernel_rows, kernel_rows + 1)] == [f"q4_1_{lin.isa}", "q4_1_dequant"]
    for rows in (lin.max_rows, lin.max_rows + 1):  # what the rule says is what a call takes
        before = dict(kernels.paths_used().get("gemm", {}))
        lin(torch.randn(rows, 128))
        after = kernels.paths_used()["gemm"]
        assert {p for p in after if after[p] != before.get(p, 0)} == {expected_path(lin, rows)}


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory, default_model_dir):
    from conftest import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), default_model_dir, arch="qwen2")


@pytest.mark.parametrize("weights,arch,batch", [("q8_0", "llama", 3), ("q4", "llama", 3), ("q8_0", "qwen2", 3),
                                                ("q8_0", "llama", 17), ("q8_0", "qwen2", 17)])
def test_the_fused_decode_step_is_the_layer_by_layer_step(request, weights, arch, batch):
    """A decode step in one compiled call (pdserve.model.fused_decode) gives the logits of the same step run layer
    by layer, bit for bit (17 rows: Q8_0 on int8 rows where this host has them; qwen2: q/k/v biases), and counts
    its parts as that would."""
    from pdserve import LLM, SamplingParams
    model_dir = request.getfixturevalue("tiny_llama_dir" if arch == "llama" else "tiny_qwen2_dir")
    llm = LLM(str(model_dir), weights=weights, num_threads=2, enable_prefix_caching=False)
    model = llm.engine.executor.model
    assert model.fused is not None
    logits, head = [], model.logits
    model.logits = lambda h: logits.append(head(h)) or logits[-1]
    prompts = [f"{i} is a number, and so" for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    fused = model.fused
    runs = []
    for on in (True, False):
        model.fused = fused if on else None
        logits.clear()
        before = kernels.paths_used()
        tokens = [list(o.token_ids) for o in llm.generate(prompts, params)]
        after = kernels.paths_used()
        runs.append((tokens, list(logits), {p: n - before.get(part, {}).get(p, 0)
                                            for part in after for p, n in after[part].items() if part == "gemm"},
                     after.get("decode_step", {}).get("fused", 0) - before.get("decode_step", {}).get("fused", 0)))
    (tokens, fused_logits, fused_gemm, steps), (ref_tokens, ref_logits, ref_gemm, ref_steps) = runs
    assert steps == 5 and ref_steps == 0  # (the first token comes from the prefill step)
    assert tokens == ref_tokens
    assert len(fused_logits) == len(ref_logits) == 6
    assert all(torch.equal(a, b) for a, b in zip(fused_logits, ref_logits))
    assert fused_gemm == ref_gemm
    if batch >= 16 and kernels.qgemm_i8_isa() != "none" and weights == "q8_0":
        assert fused_gemm.get(f"q8_0_{kernels.qgemm_isa()}_i8", 0) >= 5 * 4 * 2


def test_the_fused_step_keeps_one_scratch_for_every_batch_size(tiny_llama_dir):
    """Batches that grow and shrink (3, 17, then a batch that finishes one sequence a step: 5 down to 1) give the
    layer-by-layer logits bit for bit, and the fused step's scratch is one set sized to the most rows seen (a set
    per batch size would grow by megabytes with every new size a server meets)."""
    from pdserve import LLM, SamplingParams
    llm = LLM(str(tiny_llama_dir), weights="q8_0", num_threads=2, enable_prefix_caching=False)
    model = llm.engine.executor.model
    fused, head, logits = model.fused, model.logits, []
    model.logits = lambda h: logits.append(head(h)) or logits[-1]
    batches = [[SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * 3,
               [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * 17,
               [SamplingParams(temperature=0.0, max_tokens=2 + i, ignore_eos=True) for i in range(5)]]
    for params in batches:
        prompts = [f"{i} is a number, and so" for i in range(len(params))]
        runs = []
        for on in (True, False):
            model.fused = fused if on else None
            logits.clear()
            tokens = [list(o.token_ids) for o in llm.generate(prompts, params)]
            runs.append((tokens, list(logits)))
        assert runs[0][0] == runs[1][0]
        assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1])), len(params)
    assert fused.capacity == 17 and all(h.shape[0] == 17 for h in fused.held[:-1])
    # every step structure made since the buffers last grew points into them (none into freed ones)
    assert set(fused.steps) == {17, 1, 2, 3, 4, 5}
    assert all(step.h == fused.held[0].data_ptr() and step.qscratch == fused.held[-1].data_ptr()
               for step in fused.steps.values())
