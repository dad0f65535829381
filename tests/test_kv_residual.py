"""int4's residual window (`pdserve.kv.residual`): its bookkeeping, attention that reads a query's own block from
it and every other key through the codec (decode on the torch path and the kernel, prefill chunks) against a
reference written out key by key, and an engine whose prefill and decode agree on the same tokens."""

from __future__ import annotations

import pytest
import torch

from pdserve.core.sampling_params import SamplingParams
from pdserve.core.sched.schedule import ScheduledChunk
from pdserve.kv.codec import KVCodec
from pdserve.kv.residual import ChunkWindow, ResidualWindow
from pdserve.model import kernels
from pdserve.model.attention import paged_attention
from pdserve.model.input_batch import CacheLayout, build_input_batch

BS, HKV, HQ, D = 16, 3, 9, 64


def chunk(rid: str, start: int, n: int, blocks=(), sample=True) -> ScheduledChunk:
    return ScheduledChunk(rid, (5,) * n, start, tuple(blocks) or tuple(range(-(-(start + n) // BS))), sample,
                          SamplingParams())


def test_a_window_follows_its_sequence_block_by_block():
    w = ResidualWindow(1, 1, 4, block_size=4, slots=2, device=torch.device("cpu"))
    [a] = w.plan([chunk("a", 0, 6)])  # a prompt: positions 0-5, its last block holds 4 and 5
    assert a.exact_from == 0
    assert w.plan([chunk("a", 6, 1)]) == [ChunkWindow(a.slot, 4)]  # decoding on in the same block: 4 on exact
    assert w.plan([chunk("a", 7, 1)]) == [ChunkWindow(a.slot, 4)]
    assert w.plan([chunk("a", 8, 1)]) == [ChunkWindow(a.slot, 8)]  # a new block: only itself
    assert w.plan([chunk("a", 6, 3)]) == [ChunkWindow(a.slot, 6)]  # not where the window ended: starts afresh
    assert w.plan([chunk("a", 9, 1)]) == [ChunkWindow(a.slot, 8)]


def test_slots_are_freed_reused_and_taken_least_recently_used_first():
    w = ResidualWindow(1, 1, 4, block_size=4, slots=2, device=torch.device("cpu"))
    a, b = w.plan([chunk("a", 0, 3), chunk("b", 0, 3)])
    assert a.slot != b.slot
    w.release(["a"])
    [c] = w.plan([chunk("c", 0, 2)])
    assert c.slot == a.slot and w.evictions == 0
    w.plan([chunk("c", 2, 1)])  # b is now the least recently computed
    [d] = w.plan([chunk("d", 0, 2)])
    assert d.slot == b.slot and w.evictions == 1
    [b2] = w.plan([chunk("b", 3, 1)])  # b lost its window: it starts a new one at its next token
    assert b2.exact_from == 3 and w.evictions == 2
    with pytest.raises(ValueError, match="3 sequences in one step but 2"):
        w.plan([chunk("x", 0, 1), chunk("y", 0, 1), chunk("z", 0, 1)])


def _setup(num_blocks=64, slots=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    codec = KVCodec("int4", D, torch.float32)
    fp = torch.randn(2, HKV, num_blocks, BS, D, generator=g)
    fp[0, ..., 5] *= 8  # an outlier key channel
    pool = codec.encode(fp.reshape(-1, D)).view(2, HKV, num_blocks, BS, codec.width)
    window = ResidualWindow(1, HKV, D, BS, slots, torch.device("cpu"))
    window.data.copy_(torch.randn(window.data.shape, generator=g).half())
    return g, codec, pool, window


def _key(codec, pool, window, kv: int, h: int, blocks, slot: int, exact_from: int, p: int) -> torch.Tensor:
    """Key (kv=0) or value (kv=1) of head h at position p as the window semantics define it."""
    if p >= exact_from:
        return codec.window_decode(window.data[0, kv, h, slot, p % BS])
    return codec.decode(pool[kv, h, blocks[p // BS], p % BS])


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q [G, D] over keys, values [L, D] -> [G, D]."""
    return torch.softmax(q @ keys.T * D ** -0.5, dim=-1) @ values


@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_decode_reads_its_own_block_from_the_window_and_the_rest_through_the_codec(path):
    if path == "kernel" and not kernels.available():
        pytest.skip("kernels unavailable")
    g, codec, pool, window = _setup()
    perm = torch.randperm(64, generator=g).tolist()
    lengths, froms = [1, 16, 17, 40, 65], [0, 12, 16, 34, 64]  # exact from the block's start or within it
    chunks = [chunk(f"r{i}", n - 1, 1, [perm.pop() for _ in range(-(-n // BS))]) for i, n in enumerate(lengths)]
    windows = [ChunkWindow(i + 1, f) for i, f in enumerate(froms)]
    meta = build_input_batch(chunks, CacheLayout(BS, 64, HKV), torch.device("cpu"), codec=codec, window=window,
                             windows=windows).meta
    q = torch.randn(len(lengths), HQ, D, generator=g)
    with kernels.disabled() if path == "torch" else _nothing():
        out = paged_attention(q, None, None, pool[0], pool[1], meta, D ** -0.5)
    used = kernels.paths_used()["decode_attention"]
    assert used.get("kernel_int4" if path == "kernel" else "torch")
    for b, (c, w) in enumerate(zip(chunks, windows)):
        for h in range(HKV):
            kv = [torch.stack([_key(codec, pool, window, i, h, c.block_ids, w.slot, w.exact_from, p)
                               for p in range(lengths[b])]) for i in (0, 1)]
            group = slice(h * HQ // HKV, (h + 1) * HQ // HKV)
            expected = _attend(q[b, group], *kv).reshape(-1)
            got = out[b].view(HQ, D)[group].reshape(-1)
            torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("path", ["flash_merge", "concat"])
@pytest.mark.parametrize("start,exact_from", [(0, 0), (20, 17), (32, 32), (5, 0)])
def test_a_prefill_chunk_reads_each_query_own_block_exactly(start, exact_from, path, monkeypatch):
    from pdserve.model import residual_attention
    if path == "concat":  # what a device without the CPU flash kernel runs
        monkeypatch.setattr(residual_attention, "prefill_attention", lambda *args: None)
    before = kernels.paths_used().get("prefill_window", {}).get(path, 0)
    g, codec, pool, window = _setup(seed=1)
    n = 30
    c = chunk("p", start, n, sample=False)
    windows = [ChunkWindow(2, exact_from)]
    meta = build_input_batch([c], CacheLayout(BS, 64, HKV), torch.device("cpu"), codec=codec, window=window,
                             windows=windows).meta
    q = torch.randn(n, HQ, D, generator=g)
    k_coded, v_coded = (codec.decode(pool[i, :, :4].reshape(-1, codec.width)).view(HKV, -1, D)[:, start:start + n]
                        .transpose(0, 1).contiguous() for i in (0, 1))  # what a fresh chunk's k, v decode to
    exact = tuple(torch.randn(n, HKV, D, generator=g) for _ in range(2))
    out = paged_attention(q, k_coded, v_coded, pool[0], pool[1], meta, D ** -0.5, 0, exact)
    assert kernels.paths_used()["prefill_window"][path] == before + 1
    for r in range(n):
        i = start + r
        first_exact = max(exact_from, i // BS * BS)
        for h in range(HKV):
            kv = []
            for which in (0, 1):
                rows = []
                for p in range(i + 1):
                    if p < first_exact:
                        rows.append(codec.decode(pool[which, h, p // BS, p % BS]))
                    elif p < start:
                        rows.append(codec.window_decode(window.data[0, which, h, 2, p % BS]))
                    else:
                        rows.append(exact[which][p - start, h])
                kv.append(torch.stack(rows))
            group = slice(h * HQ // HKV, (h + 1) * HQ // HKV)
            # the merge swaps a block's coded keys for exact ones inside a finished softmax: its sums cancel to
            # ~1e-4 (below the 5e-4 of the window's fp16); the concatenated keys are one plain softmax
            tol = 2e-4 if path == "flash_merge" else 2e-5
            torch.testing.assert_close(out[r].view(HQ, D)[group], _attend(q[r, group], *kv), rtol=tol, atol=tol)


def test_prefill_and_decode_agree_on_the_same_tokens(tiny_llama_dir):
    """A sequence decoded token by token (its window filling and moving block by block) scores its tokens as a
    prefill of the whole sequence does (each token reading its own block exactly there too)."""
    from pdserve.engine.llm import LLM
    llm = LLM(str(tiny_llama_dir), kv_cache_gb=0.01, kv_host_gb=0, kv_cache_dtype="int4",
              enable_prefix_caching=False)
    prompt = list(range(3, 24))
    out = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, logprobs=0))[0]
    decoded = [entry[0] for entry in out.logprobs]
    scored = llm.generate([prompt + out.token_ids], SamplingParams(max_tokens=1, temperature=0,
                                                                    prompt_logprobs=0))[0]
    prefilled = [entry[0] for entry in scored.prompt_logprobs[len(prompt):]]
    diffs = [abs(a - b) for a, b in zip(decoded, prefilled)]
    assert len(diffs) == 40 and max(diffs) < 2e-3, diffs
