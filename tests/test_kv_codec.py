"""KV codecs: encode/decode round trips within each codec's error bound (hypothesis), the CPU kernels equal to
the torch reference bit for bit, attention over a coded pool against exact attention, and an engine whose
pool, host tier and capacity follow the codec."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.core.kvstore import kv_codecs
from pdserve.errors import InvalidRequestError
from pdserve.kv.codec import KVCodec
from pdserve.model import kernels
from pdserve.model.attention import paged_attention
from pdserve.model.attention_torch import decode_attention as _decode_attention
from test_kernels import decode_batch

CODED = ["fp16", "bf16", "fp8_e4m3", "int8", "int4"]
# worst error of one element, relative to the largest magnitude of its token (a bound, not a typical error)
BOUND = {"fp16": 1e-3, "bf16": 8e-3, "fp8_e4m3": 7e-2, "int8": 5e-3, "int4": 0.2}
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="kernels unavailable")


def rows(seed: int, n: int, d: int, scale: float, outlier: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * scale
    x[:, 3] *= outlier  # keys have a few large channels
    return x


@pytest.mark.parametrize("name", CODED)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 40), scale=st.floats(1e-3, 1e3), outlier=st.floats(1, 50))
def test_round_trip_within_bound(name, seed, n, scale, outlier):
    codec = KVCodec(name, 64, torch.float32)
    x = rows(seed, n, 64, scale if name != "fp16" else min(scale, 100), outlier)
    records = codec.encode(x)
    assert records.dtype == torch.uint8 and records.shape == (n, codec.token_bytes)
    err = (codec.decode(records) - x).abs().amax(dim=1) / x.abs().amax(dim=1)
    assert err.max().item() <= BOUND[name]
    assert torch.equal(codec.encode(codec.decode(records)), records) or name in ("int4", "fp8_e4m3")


@pytest.mark.parametrize("name", CODED)
def test_zero_and_constant_rows_are_exact(name):
    codec = KVCodec(name, 64, torch.float32)
    x = torch.stack([torch.zeros(64), torch.full((64,), 0.5)])
    if name == "int4":  # coded rotated: a constant row is not constant there
        torch.testing.assert_close(codec.decode(codec.encode(x)), x, atol=1e-3, rtol=0)
    else:
        assert torch.equal(codec.decode(codec.encode(x)), x)


def test_fp16_saturates():
    codec = KVCodec("fp16", 64, torch.float32)
    x = torch.full((1, 64), 1e6)
    assert codec.decode(codec.encode(x)).eq(65504).all()


def test_token_bytes_and_errors():
    sizes = {n: kv_codecs.token_bytes(n, 64, 4) for n in ["auto", *CODED]}
    assert list(sizes.values()) == [256, 128, 128, 68, 68, 40]
    # what the codecs really write per token is what pools, links and tiers are sized by
    x = rows(5, 4, 64, 1.0, 10.0)
    written = {n: KVCodec(n, 64, torch.float32).encode(x).nbytes // len(x) for n in sizes}
    assert written == sizes
    # int8 >= 3.5x and int4 >= 6x the tokens of fp32 in the same bytes
    assert written["auto"] / written["int8"] >= 3.5 and written["auto"] / written["int4"] >= 6
    with pytest.raises(InvalidRequestError, match="choose from auto, fp16, bf16, fp8_e4m3, int8, int4"):
        kv_codecs.check("int3")


@needs_kernels
@pytest.mark.parametrize("name", CODED)
def test_kernel_encode_is_bit_exact(name):
    codec = KVCodec(name, 64, torch.float32)
    x = rows(7, 3 * 8 * 16, 64, 2.0, 40.0)
    x[5], x[6] = 0.0, 1.5
    slots = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1))
    cache = torch.zeros(3, 8, 16, codec.width, dtype=torch.uint8)
    decoded = torch.empty_like(x)
    kernels.kv_encode(codec, x, cache, slots, decoded)
    records = codec.encode(x)
    expected = torch.zeros_like(cache)
    expected.view(-1, codec.width).index_copy_(0, slots, records)
    assert torch.equal(cache, expected)
    torch.testing.assert_close(decoded, codec.decode(records), rtol=1e-6, atol=1e-6)  # int4: the rotation back


def coded_pool(codec: KVCodec, fp: torch.Tensor) -> torch.Tensor:
    """An fp32 pool [2, Hkv, nb, bs, D] as `codec` stores it."""
    two, hkv, nb, bs, d = fp.shape
    return codec.encode(fp.reshape(-1, d)).view(two, hkv, nb, bs, codec.width)


@pytest.mark.parametrize("name", CODED)
def test_decode_attention_through_codec_vs_exact(name):
    lengths = [1, 16, 17, 200, 65]
    batch = decode_batch(lengths, 16, num_blocks=96, num_kv=3)
    g = torch.Generator().manual_seed(2)
    pool = torch.randn(2, 3, 96, 16, 64, generator=g)
    pool[0, :, :, :, 5] *= 8  # an outlier key channel
    q = torch.randn(len(lengths), 9, 64, generator=g)
    exact = _decode_attention(q, pool[0], pool[1], batch.meta, 0.125).reshape(len(lengths), -1)
    codec = KVCodec(name, 64, torch.float32)
    coded = coded_pool(codec, pool)
    meta = batch.meta.__class__(**{**batch.meta.__dict__, "codec": codec})
    with kernels.disabled():
        torch_out = paged_attention(q, None, None, coded[0], coded[1], meta, 0.125)
    rel = (torch_out - exact).norm() / exact.norm()
    assert rel < {"int4": 0.1, "fp8_e4m3": 0.05, "int8": 0.03}.get(name, 0.01), rel
    if kernels.available():  # the kernel reads the same records: equal to the torch path up to fp32 rounding
        out = paged_attention(q, None, None, coded[0], coded[1], meta, 0.125)
        assert kernels.paths_used()["decode_attention"].get(f"kernel_{name}")
        torch.testing.assert_close(out, torch_out, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_engine_pool_tiers_and_capacity_follow_the_codec(tiny_llama_dir, name):
    from pdserve.core.sampling_params import SamplingParams
    from pdserve.engine.llm import LLM
    auto = LLM(str(tiny_llama_dir), kv_cache_gb=0.01, kv_host_gb=0.01)
    coded = LLM(str(tiny_llama_dir), kv_cache_gb=0.01, kv_host_gb=0.01, kv_cache_dtype=name)
    ex_a, ex_c = auto.engine.executor, coded.engine.executor
    d = ex_a.model.config.head_dim
    ratio = d * 4 / kv_codecs.token_bytes(name, d, 4)
    cfg = ex_a.model.config  # int4's residual window (each running sequence's last block, fp16) is in the budget
    window = kv_codecs.residual_bytes_per_seq(name, cfg.num_layers, cfg.num_kv_heads, d, 16) * coded.config.max_num_seqs
    assert (window > 0) == (name == "int4") and window == (0 if ex_c.residual is None else ex_c.residual.data.nbytes)
    assert ex_c.info.num_kv_blocks >= int(ex_a.info.num_kv_blocks * ratio * (1 - window / (0.01 * 2**30)) * 0.99)
    assert ex_c.kv_pool.layers[0].dtype == torch.uint8 and ex_c.kv_io.host.data.dtype == torch.uint8
    assert ex_c.kv_io.host.num_slots >= int(ex_a.kv_io.host.num_slots * ratio * 0.99)
    sp = SamplingParams(max_tokens=8, temperature=0)
    prompt = list(range(3, 40))
    first = coded.generate([prompt], sp)[0]
    assert len(first.token_ids) == 8
    again = coded.generate([prompt], sp)[0]  # its coded blocks reused from the prefix cache, same tokens
    assert again.num_cached_tokens > 0 and again.token_ids == first.token_ids


def test_unknown_kv_cache_dtype_is_a_clear_error():
    from pdserve.engine.config import EngineConfig
    with pytest.raises(InvalidRequestError, match="unknown kv_cache_dtype 'fp4'"):
        EngineConfig(kv_cache_dtype="fp4")


@pytest.mark.parametrize("src,dst", [("auto", "int8"), ("int8", "auto"), ("bf16", "int4"), ("fp8_e4m3", "fp16")])
def test_a_delivered_chunk_transcodes_token_by_token(src, dst):
    from pdserve.kv.block_io import chunk_nbytes, gather_blocks
    from pdserve.kv.transcode import codec_of, payload_nbytes, transcode
    a, b = KVCodec(src, 64, torch.float32), KVCodec(dst, 64, torch.float32)
    values = rows(3, 2 * 3 * 10 * 16, 64, 1.0, 10.0).view(2, 3, 10, 16, 64)
    layer = values if src == "auto" else coded_pool(a, values)
    ids = [7, 2, 3]
    wire = bytearray(chunk_nbytes(layer, len(ids)))
    gather_blocks(layer, ids, wire)
    assert len(wire) == payload_nbytes(a, 3, 16, len(ids))
    got = np.frombuffer(bytes(transcode(memoryview(wire), codec_of(a.format, b), b)), np.uint8)
    got = got.reshape(-1, b.token_bytes)
    # the reference: the codecs' formats (`pdserve.core.kvstore.kv_codecs`) read and written in numpy, not by pdserve
    sent = layer[:, :, ids].reshape(-1, a.width).contiguous().view(torch.uint8).numpy()  # wire order
    want = np_decode(src, sent)
    if dst == "int4":  # rounding in a rotated basis: within half a level of what numpy computes
        rotated = want @ np_hadamard(64)
        groups = rotated.reshape(-1, 2, 32)
        lo, hi = groups.min(axis=2), groups.max(axis=2)
        scale, got_lo = np_int4_params(got)
        np.testing.assert_allclose(scale, (hi - lo) / 15, rtol=2e-3, atol=1e-6)
        np.testing.assert_allclose(got_lo, lo, rtol=2e-3, atol=1e-6)
        err = np.abs(np_int4_levels(got) - groups)
        assert (err <= scale[:, :, None] * 0.501 + 2e-3 * np.abs(groups).max(axis=2, keepdims=True)).all()
        np.testing.assert_allclose(np_decode("int4", got), want, atol=0.2 * np.abs(want).max())
    else:
        assert got.tobytes() == np_encode(dst, want).tobytes()


def np_decode(name: str, records: np.ndarray) -> np.ndarray:
    """[N, token_bytes] uint8 records -> [N, 64] float32 values, read as the module doc of kv_codecs has them."""
    if name == "auto":
        return records.view(np.float32)
    if name == "fp16":
        return records.view(np.float16).astype(np.float32)
    if name == "bf16":
        return (records.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if name == "int4":
        return np_int4_levels(records).reshape(-1, 64) @ np_hadamard(64)
    codes, scale = records[:, :64], records[:, 64:].copy().view(np.float32)
    if name == "int8":
        return codes.view(np.int8).astype(np.float32) * scale
    sign = np.where(codes >> 7, -1.0, 1.0)  # fp8 e4m3: bias 7, subnormals below exponent 1
    exp, man = (codes >> 3) & 15, (codes & 7).astype(np.float64)
    value = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp.astype(np.float64) - 7))
    return (sign * value).astype(np.float32) * scale


def np_encode(name: str, x: np.ndarray) -> np.ndarray:
    if name == "auto":
        return x.astype(np.float32)
    if name == "fp16":
        return np.clip(x, -65504, 65504).astype(np.float16)
    assert name == "int8"
    scale = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    scale = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
    codes = np.clip(np.round(x / scale), -127, 127).astype(np.int8)  # half to even, as numpy rounds
    return np.concatenate([codes.view(np.uint8), scale.view(np.uint8)], axis=1)


def np_int4_params(records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int4 records -> (scale, minimum) [N, 2] of the two channel groups (fp16 each, after the 32 code bytes)."""
    p = records[:, 32:].copy().view(np.float16).astype(np.float32).reshape(-1, 2, 2)
    return p[:, :, 0], p[:, :, 1]


def np_int4_levels(records: np.ndarray) -> np.ndarray:
    """int4 records -> [N, 2, 32] values in the rotated basis (channel 2k in byte k's low nibble, 2k+1 high)."""
    codes = records[:, :32]
    q = np.stack([codes & 15, codes >> 4], axis=2).reshape(-1, 2, 32).astype(np.float32)
    scale, lo = np_int4_params(records)
    return q * scale[:, :, None] + lo[:, :, None]


def np_hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1), np.float32)
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(np.sqrt(n))


def test_unknown_chunk_formats_name_no_codec():
    from pdserve.kv.transcode import codec_of
    own = KVCodec("int8", 64, torch.float32)
    assert codec_of("float32", own).name == "auto" and codec_of("int4", own).name == "int4"
    assert codec_of("int3", own) is None and codec_of("int64", own) is None and codec_of(5, own) is None


@pytest.mark.parametrize("name", ["int8", pytest.param("int4", marks=pytest.mark.extended)])
def test_coded_blocks_evicted_to_host_and_disk_come_back_unchanged(tiny_llama_dir, tmp_path, name):
    """The host and disk tiers hold coded blocks as they are: a prefix evicted from the device is loaded back
    from host, and after a restart from disk, and the greedy tokens are those of the first run."""
    import time

    from pdserve.core.kvstore.kv_columns import Tier
    from pdserve.core.sampling_params import SamplingParams
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm import build_engine_at

    def engine():
        cfg = EngineConfig(kv_cache_dtype=name, block_size=4, num_kv_blocks=12, num_threads=1, kv_host_gb=0.01,
                           kv_disk_dir=str(tmp_path / "kv"))
        return build_engine_at(tiny_llama_dir, cfg, detokenize=False, worker="w", long_context=False)

    def run(e, prompt):
        e.add_request(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), request_id=str(prompt[0]))
        final = None
        while e.has_unfinished():
            final = ([o for o in e.step() if o.finished] or [final])[0]
        return final

    a, b, c = ([(k * 31 + j * 7) % 400 + 10 for j in range(17)] for k in (1, 2, 3))
    e = engine()
    first = run(e, a)
    assert e.executor.kv_io.host.data.dtype == torch.uint8
    run(e, b), run(e, c)  # a's blocks leave the 12-block device pool
    again = run(e, [*a])
    assert again.num_cached_tokens == 16 and e.tiers.stats.hit_tokens[Tier.HOST] > 0
    assert again.token_ids == first.token_ids
    deadline = time.monotonic() + 30
    while not all(e.tiers.disk.ready(h) is not None for h in e.block_manager.find_prefix(a).block_hashes):
        assert time.monotonic() < deadline, "never flushed to disk"
        e.poll_kv()
        time.sleep(0.01)
    del e
    restarted = engine()
    from_disk = run(restarted, [*a])
    assert from_disk.num_cached_tokens == 16 and restarted.tiers.stats.hit_tokens[Tier.DISK] > 0
    assert from_disk.token_ids == first.token_ids
