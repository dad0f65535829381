"""Prefill attention on CPU: the compiled kernel serves a step's prefill chunks (one query per prompt token over
the paged cache, `attention_cpu.prefill_plan`) and must equal the torch reference (SDPA chunk by chunk); the
chunks it leaves to the reference are the ones it says, and nothing falls back."""

from __future__ import annotations

import pytest
import torch

from pdserve.core.sampling_params import SamplingParams
from pdserve.core.sched.schedule import ScheduledChunk
from pdserve.model import attention_cpu, kernels
from pdserve.model.attention import paged_attention
from pdserve.model.attention_torch import write_kv
from pdserve.model.input_batch import CacheLayout, build_input_batch

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {kernels._load_error}")

BLOCK, NUM_BLOCKS = 16, 256


def step(chunk_specs, num_kv, seed=0):
    """Chunks (start_pos, num_tokens) with shuffled block tables; a 1-token chunk is a decode."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    chunks = []
    for i, (start, n) in enumerate(chunk_specs):
        blocks = tuple(free.pop() for _ in range(-(-(start + n) // BLOCK)))
        chunks.append(ScheduledChunk(f"r{i}", tuple(range(5, 5 + n)), start, blocks, True, SamplingParams()))
    chunks = [c for c in chunks if c.num_tokens == 1] + [c for c in chunks if c.num_tokens > 1]  # the engine's order
    return build_input_batch(chunks, CacheLayout(BLOCK, NUM_BLOCKS, num_kv), torch.device("cpu"))


def run(chunk_specs, num_heads, num_kv, head_dim, seed=0):
    """The step's attention with the kernels and with the torch reference -> (out, reference, paths used)."""
    batch = step(chunk_specs, num_kv, seed)
    t = batch.input_ids.numel()
    g = torch.Generator().manual_seed(seed + 1)
    cache = torch.randn(2, num_kv, NUM_BLOCKS, BLOCK, head_dim, generator=g)  # earlier context: random
    q, k, v = (torch.randn(t, h, head_dim, generator=g) for h in (num_heads, num_kv, num_kv))
    write_kv(cache[0], cache[1], k, v, batch.meta.slot_rows)  # the step's own keys, as rope_write leaves them
    before, fallbacks = kernels.paths_used().get("prefill_attention", {}), kernels.fallback_count()
    out = paged_attention(q, k, v, cache[0], cache[1], batch.meta, head_dim ** -0.5)
    after = kernels.paths_used()["prefill_attention"]
    assert kernels.fallback_count() == fallbacks, kernels.fallback_reason()
    with kernels.disabled():
        ref = paged_attention(q, k, v, cache[0], cache[1], batch.meta, head_dim ** -0.5)
    used = {path: n - before.get(path, 0) for path, n in after.items() if n != before.get(path, 0)}
    return out, ref, used


@pytest.mark.parametrize("num_heads,num_kv,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 20)])
def test_prefill_chunks_match_the_reference(num_heads, num_kv, head_dim):
    # fresh prompts (one shorter than a block, one not a block multiple), a chunk after a cached prefix that
    # starts mid-block, a later chunk of a prompt, and decodes in the same step
    specs = [(0, 128), (0, 7), (0, 37), (20, 45), (64, 64), (30, 1), (99, 1)]
    out, ref, used = run(specs, num_heads, num_kv, head_dim)
    assert used == {"kernel": 5}
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_chunks_the_kernel_leaves_to_sdpa_keep_their_rows(monkeypatch):
    # a long context between two short chunks: the kernel's rows are not contiguous
    monkeypatch.setattr(attention_cpu, "KERNEL_MAX_PAIRS", attention_cpu.causal_pairs(0, 60))
    specs = [(0, 50), (180, 40), (0, 33), (5, 1)]
    out, ref, used = run(specs, 9, 3, 64, seed=3)
    assert used == {"kernel": 2, "torch_sdpa": 1}
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_causal_pairs():
    assert attention_cpu.causal_pairs(0, 1) == 1 and attention_cpu.causal_pairs(0, 3) == 6
    assert attention_cpu.causal_pairs(10, 2) == 11 + 12


def test_one_plan_per_step_and_a_new_one_for_the_next():
    backend = attention_cpu.CpuKernelAttention()
    first, second = step([(0, 20), (16, 9)], 3).meta, step([(0, 40)], 3).meta
    cache = torch.zeros(2, 3, NUM_BLOCKS, BLOCK, 64)
    for meta, tokens in ((first, 29), (first, 29), (second, 40)):
        q = torch.randn(tokens, 9, 64)
        out = torch.empty(tokens, 9 * 64)
        backend.prefills(q, q[:, :3], q[:, :3], cache[0], cache[1], meta, 0.125, 0, None, out)
        assert backend._plan[0] is meta
        assert backend._plan[1].lens.numel() == tokens


def test_the_kernel_off_is_a_counted_fallback():
    batch = step([(0, 24)], 3)
    cache = torch.zeros(2, 3, NUM_BLOCKS, BLOCK, 64)
    q = torch.randn(24, 9, 64)
    before = kernels.fallback_count()
    with kernels.disabled():
        paged_attention(q, q[:, :3].contiguous(), q[:, :3].contiguous(), cache[0], cache[1], batch.meta, 0.125,
                        backend=attention_cpu.CpuKernelAttention())
    assert kernels.fallback_count() == before + 1
