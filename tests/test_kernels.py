"""The compiled CPU kernels against the torch path they replace, on random inputs, and their fallback."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pdserve.core.sampling_params import SamplingParams
from pdserve.core.sched.schedule import ScheduledChunk
from pdserve.model import kernels
from pdserve.model.attention import default_backend, paged_attention
from pdserve.model.attention_torch import decode_attention as _decode_attention
from pdserve.model.input_batch import CacheLayout, build_input_batch
from pdserve.model.rope import RotaryEmbedding

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {kernels._load_error}")


def decode_batch(lengths, block_size, num_blocks, num_kv, seed=0):
    """Decode chunks with shuffled, non-contiguous block tables covering `lengths` tokens each."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    chunks = []
    for i, n in enumerate(lengths):
        blocks = tuple(perm.pop() for _ in range(-(-n // block_size)))
        chunks.append(ScheduledChunk(f"r{i}", (5,), n - 1, blocks, True, SamplingParams()))
    layout = CacheLayout(block_size, num_blocks, num_kv)
    return build_input_batch(chunks, layout, torch.device("cpu"))


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv,head_dim", [(4, 4, 64), (9, 3, 64), (8, 1, 32), (6, 2, 20)])
def test_decode_attention_matches_torch(block_size, num_heads, num_kv, head_dim):
    lengths = [1, 7, block_size, block_size + 1, 3 * block_size - 1, 200, 65, 129]
    batch = decode_batch(lengths, block_size, num_blocks=1024 // block_size + 64, num_kv=num_kv)
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, num_kv, 1024 // block_size + 64, block_size, head_dim, generator=g)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=g)
    ref = _decode_attention(q, cache[0], cache[1], batch.meta, head_dim ** -0.5).reshape(len(lengths), -1)
    out = torch.full_like(ref, float("nan"))
    kernels.decode_attention(q, cache[0], cache[1], batch.meta.decode_rows, batch.meta.decode_lens, out,
                             head_dim ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_attention_large_scores_stay_finite():
    batch = decode_batch([300, 2], 16, 64, 2)
    g = torch.Generator().manual_seed(6)
    cache = torch.randn(2, 2, 64, 16, 64, generator=g) * 30  # scores in the thousands: the online softmax
    q = torch.randn(2, 4, 64, generator=g) * 30  # must rescale its running sums, or overflow
    ref = _decode_attention(q.double(), cache[0].double(), cache[1].double(), batch.meta, 0.125).reshape(2, -1)
    out = torch.empty(ref.shape)
    kernels.decode_attention(q, cache[0], cache[1], batch.meta.decode_rows, batch.meta.decode_lens, out, 0.125)
    assert out.isfinite().all()
    # values are ~30, and near-tied top scores amplify fp32 rounding (over 200 seeds the kernel stayed
    # within a quarter of this tolerance)
    torch.testing.assert_close(out.double(), ref, rtol=1e-3, atol=2e-2)


@pytest.mark.parametrize("num_heads,num_kv,head_dim", [(9, 3, 64), (4, 2, 16), (2, 2, 6)])
def test_rope_write_kv_is_bit_exact(num_heads, num_kv, head_dim):
    t, block_size, num_blocks = 11, 4, 16
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(t, (num_heads + 2 * num_kv) * head_dim, generator=g)
    rope = RotaryEmbedding(head_dim, 64, 10000.0, None, torch.float32, torch.device("cpu"))
    cos, sin = rope.lookup(torch.randint(0, 64, (t,), generator=g))
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slot_rows = CacheLayout(block_size, num_blocks, num_kv).slot_rows(slots)
    results = []
    for use_kernels in (True, False):
        cache = torch.zeros(2, num_kv, num_blocks, block_size, head_dim)
        with kernels.disabled() if not use_kernels else contextlib.nullcontext():
            q, k, v, _ = default_backend().write_kv(qkv, cos, sin, cache[0], cache[1], slot_rows, num_heads,
                                                    num_kv, None)
        results.append((q, k, v, cache))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rows,hidden", [(1, 64), (16, 576), (3, 100), (300, 576)])
def test_add_rms_norm_and_silu_mul(rows, hidden):
    g = torch.Generator().manual_seed(3)
    x, res, w = (torch.randn(r, hidden, generator=g) for r in (rows, rows, 1))
    w = w[0]
    x_k = x.clone()
    out = kernels.add_rms_norm(x_k, res, w, 1e-5)
    torch.testing.assert_close(x_k, x + res, rtol=0, atol=0)
    torch.testing.assert_close(out, F.rms_norm(x + res, w.shape, w, 1e-5), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernels.add_rms_norm(x.clone(), None, w, 1e-5), F.rms_norm(x, w.shape, w, 1e-5))
    gu = torch.randn(rows, 2 * hidden, generator=g) * 10
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gu), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_paged_attention_mixed_batch_uses_kernel_and_matches_torch():
    chunks = [ScheduledChunk("d0", (5,), 20, (3, 7, 9), True, SamplingParams()),
              ScheduledChunk("p0", tuple(range(6)), 4, (1, 2), True, SamplingParams())]
    batch = build_input_batch(chunks, CacheLayout(8, 16, 2), torch.device("cpu"))
    g = torch.Generator().manual_seed(4)
    cache = torch.randn(2, 2, 16, 8, 32, generator=g)
    q, k, v = (torch.randn(7, h, 32, generator=g) for h in (4, 2, 2))
    before = kernels.fallback_count()
    out = paged_attention(q, k, v, cache[0], cache[1], batch.meta, 0.2)
    assert kernels.fallback_count() == before
    with kernels.disabled():
        ref = paged_attention(q, k, v, cache[0], cache[1], batch.meta, 0.2)
    assert kernels.fallback_count() > before
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_unsupported_tensors_fall_back_and_are_counted():
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    before = kernels.fallback_count()
    out = kernels.add_rms_norm(x, None, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    assert out.dtype == torch.bfloat16
    assert kernels.fallback_count() == before + 1
    assert "bfloat16" in kernels.fallback_reason()


def test_engine_on_cpu_fp32_never_falls_back(tiny_llama_dir):
    from pdserve import LLM
    before = kernels.fallback_count()  # loading counts too: choosing MKL on some host is no fallback
    llm = LLM(str(tiny_llama_dir), block_size=4)
    out = llm.generate([[11, 12, 13, 14, 15], [7] * 9], SamplingParams(temperature=0, max_tokens=6))
    assert all(len(o.token_ids) == 6 for o in out)
    assert kernels.fallback_count() == before, kernels.fallback_reason()


def cpu_flags() -> set[str]:
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_gemm_isa_is_the_hosts():
    """The GEMM kernel is built for what this CPU has (or what PDSERVE_KERNEL_CFLAGS leaves of it)."""
    flags, cflags = cpu_flags(), os.environ.get("PDSERVE_KERNEL_CFLAGS", "")
    expected = ("avx512" if "avx512f" in flags and "-mno-avx512f" not in cflags else
                "avx2" if {"avx2", "fma"} <= flags and "-mno-avx2" not in cflags else "none")
    assert kernels.isa() == expected


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 16, 17, 32, 64])
@pytest.mark.parametrize("n,k", [(960, 576), (40, 24), (7, 3), (100, 300)])
def test_gemm_matches_linear(rows, n, k):
    from pdserve.model.linear import Linear
    g = torch.Generator().manual_seed(5)
    w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(rows, k, generator=g)
    lin = Linear(w, b, pack=True)
    if lin.panels is None:
        pytest.skip(f"no GEMM kernel for this CPU (isa {kernels.isa()}): MKL serves every matmul")
    torch.testing.assert_close(kernels.gemm(x, lin.panels), x @ w.T, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    wide = torch.randn(rows, 2 * k, generator=g)[:, :k]  # a row stride wider than k
    torch.testing.assert_close(kernels.gemm(wide, lin.panels), wide @ w.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["host", "avx512_amd"])
@pytest.mark.parametrize("rows", [1, 3, 16, 64, 256, 257, 600])
def test_linear_paths_match_f_linear(monkeypatch, rows, kind):
    """Every path Linear can take (compiled GEMM, MKL's packed sgemm, oneDNN, F.linear) against F.linear, each
    one counted as taken: on this host's rule, and on an AMD AVX-512 host's (injected: oneDNN past the kernel)."""
    from pdserve.model.linear import KERNEL_ROWS, ONEDNN_FROM, PACKED_MAX_ROWS, Linear
    if kind != "host":
        monkeypatch.setattr(kernels, "host_kind", lambda: kind)
    kind = kernels.host_kind()
    g = torch.Generator().manual_seed(7)
    w, b, x = torch.randn(200, 96, generator=g), torch.randn(200, generator=g), torch.randn(rows, 96, generator=g)

    def check(lin: Linear, path: str) -> None:
        before = kernels.paths_used().get("gemm", {}).get(path, 0)
        torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        assert kernels.paths_used()["gemm"][path] == before + 1

    lin = Linear(w, b, pack=True)
    lo, hi = KERNEL_ROWS.get(kind, (1, 0)) if lin.panels is not None else (1, 0)
    check(lin, lin.isa if lo <= rows <= hi else
          "mkl_packed" if lin.packed is not None and rows <= PACKED_MAX_ROWS else
          "onednn" if rows >= ONEDNN_FROM.get(kind, 1 << 62) else "torch_linear")
    with kernels.disabled():  # as where the kernels failed to build: MKL's packed sgemm for every row count
        lin = Linear(w, b, pack=True)
        assert lin.panels is None and lin.packed is not None
        check(lin, "mkl_packed" if rows <= PACKED_MAX_ROWS else
              "onednn" if rows >= ONEDNN_FROM.get(kernels.host_kind(), 1 << 62) else "torch_linear")


def test_a_failed_build_is_a_counted_fallback(tmp_path):
    code = ("import torch; from pdserve.model import kernels; x = torch.ones(2, 4); "
            "h = kernels.add_rms_norm(x, None, torch.ones(4), 1e-5); "
            "print(kernels.available(), kernels.fallback_count(), kernels.fallback_reason())")
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), PDSERVE_KERNEL_CACHE=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.startswith("False 1 ") and "no-such-cc" in out.stdout
    assert "falling back to torch" in out.stderr


NO_GEMM_SCRIPT = """
import sys, torch
from pdserve import LLM, SamplingParams
from pdserve.model import kernels
llm = LLM(sys.argv[1], block_size=4)
llm.generate([[11, 12, 13]], SamplingParams(temperature=0, max_tokens=4))
print(kernels.isa(), kernels.fallback_count(), kernels.paths_used()["gemm"])
"""


def test_a_cpu_without_gemm_kernel_is_a_decision_not_a_fallback(tmp_path, tiny_llama_dir):
    """Built without AVX2/FMA (as for an older CPU), every matmul runs on MKL: no fallback counted,
    nothing on stderr, the other kernels still used."""
    env = dict(os.environ, PDSERVE_KERNEL_CFLAGS="-mno-avx2 -mno-fma -mno-avx512f",
               PDSERVE_KERNEL_CACHE=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", NO_GEMM_SCRIPT, str(tiny_llama_dir)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    isa, fallbacks, gemm = out.stdout.split(" ", 2)
    assert (isa, fallbacks) == ("none", "0")
    assert "mkl_packed" in gemm and "avx2" not in gemm
    assert out.stderr.strip() == ""


@pytest.mark.skipif(os.environ.get("PDSERVE_KERNEL_CFLAGS") is not None, reason="already a nested build")
@pytest.mark.parametrize("cflags,isa", [("-mno-avx512f", "avx2")])
def test_kernels_built_for_another_isa_pass_this_module(tmp_path, cflags, isa):
    """CI on an AVX-512 host runs the AVX2 build too (on an AVX2 host this is the native build again), so
    neither path rots unseen: this whole module in a subprocess, against a build with `cflags`."""
    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA")
    env = dict(os.environ, PDSERVE_KERNEL_CFLAGS=cflags, PDSERVE_KERNEL_CACHE=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:]
    assert " passed" in out.stdout and " failed" not in out.stdout


def test_the_avx512_gemm_compiles_on_any_x86_host(tmp_path):
    """Hosts without AVX-512 cannot run that tiling, but they can compile it: a syntax or type error in
    it fails here, not first on an AVX-512 host."""
    from pdserve import cbuild
    from pdserve.model.kernels import build
    for source in build.SOURCES:
        proc = subprocess.run([cbuild.compiler(), "-O2", "-march=skylake-avx512", "-fopenmp", "-std=gnu11",
                               "-Werror", "-c", str(source), "-o", str(tmp_path / (source.stem + ".o"))],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
