"""A compact format per storage tier (`--kv-host-cache-dtype`, `--kv-disk-cache-dtype`, issue 39 item 4): blocks
copied down to the host or disk tier are encoded into that tier's codec and decoded back into the pool's on
load; each tier is sized in blocks of its own codec (`kv_codecs.tier_codecs`, `tier_blocks`)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from pdserve.core.kvstore import kv_codecs
from pdserve.errors import InvalidRequestError
from pdserve.kv.codec import KVCodec
from pdserve.kv.host_store import HostKVStore

LAYERS, HKV, BS, D = 2, 2, 4, 64
ALLOWED = "auto, fp16, bf16, fp8_e4m3, int8, int4"


def test_tier_codecs_default_to_the_tier_above():
    assert kv_codecs.tier_codecs("auto", None, None) == ("auto", "auto")
    assert kv_codecs.tier_codecs("int8", None, None) == ("int8", "int8")
    assert kv_codecs.tier_codecs("auto", "int8", None) == ("int8", "int8")  # the disk follows the host
    assert kv_codecs.tier_codecs("auto", None, "int4") == ("auto", "int4")
    with pytest.raises(InvalidRequestError, match=f"^unknown kv_disk_cache_dtype 'int3'; choose from {ALLOWED}$"):
        kv_codecs.tier_codecs("auto", None, "int3")


@pytest.mark.parametrize("pool,tier", [("auto", "int8"), ("auto", "fp16"), ("int8", "auto"), ("fp16", "int4")])
def test_host_store_encodes_on_the_way_down_and_decodes_on_the_way_up(pool, tier):
    """Blocks stored into a host tier of another codec are that codec's records; loaded back, they are the pool's
    records of the same values within the tier codec's error."""
    src, dst = KVCodec(pool, D, torch.float32), KVCodec(tier, D, torch.float32)
    torch.manual_seed(0)
    values = [torch.randn(2, HKV, 3, BS, D) for _ in range(LAYERS)]
    layers = [src.encode(v.reshape(-1, D)).view(2, HKV, 3, BS, src.width) for v in values]
    host = HostKVStore(4, LAYERS, HKV, BS, dst.width, dst.storage, recode=(src, dst))
    host.store(layers, [0, 2], [3, 1])
    assert host.data.dtype == dst.storage and host.slot_nbytes == LAYERS * 2 * HKV * BS * dst.token_bytes
    back = [torch.zeros_like(x) for x in layers]
    host.load(back, [3, 1], [1, 0])
    bound = {"int8": 2e-2, "fp16": 2e-3, "auto": 2e-2, "int4": 0.5}[tier if tier != "auto" else pool]
    for layer in range(LAYERS):
        held = dst.decode(host.data[3, layer])  # the tier holds the tier codec's records of block 0
        assert (held - values[layer][:, :, 0]).abs().max() < bound
        got = src.decode(back[layer][:, :, [1, 0]])
        assert (got - values[layer][:, :, [0, 2]]).abs().max() < bound
        if tier != "auto":  # it went through the tier's codec (an exact tier re-encodes the pool's codes exactly)
            assert (got - src.decode(layers[layer][:, :, [0, 2]])).abs().max() > 0


def _engine(model_dir, tmp_path, **kw):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm import build_engine_at
    cfg = EngineConfig(block_size=16, num_kv_blocks=8, num_threads=2, kv_host_gb=0.01,
                       kv_disk_dir=str(tmp_path / "kv"), **kw)
    return build_engine_at(model_dir, cfg, detokenize=False, worker="w", long_context=False)


def _run(e, prompt, max_tokens=8):
    from pdserve.core.sampling_params import SamplingParams
    e.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                  request_id=f"r{time.monotonic_ns()}")
    final = None
    while e.has_unfinished():
        final = ([o for o in e.step() if o.finished] or [final])[0]
    return final


def _until_on_disk(e, hashes) -> None:
    deadline = time.monotonic() + 60
    while not all(e.tiers.disk.ready(h) is not None for h in hashes):
        assert time.monotonic() < deadline, "never flushed to disk"
        e.poll_kv()
        time.sleep(0.01)


@pytest.mark.parametrize("host,disk", [("int8", None), ("int8", "fp16")])
def test_the_default_model_served_from_a_compact_host_and_disk_tier(default_model_dir, tmp_path, host, disk):
    """Pool fp32, host tier int8 (disk: the host's int8, or fp16): a prompt's blocks evicted from the device come
    back from the host tier decoded, and after a restart from disk, and the default model's greedy tokens for
    the short prompt are the pool's."""
    from pdserve.core.kvstore.kv_columns import Tier
    from pdserve.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(default_model_dir)
    prompt = tok.encode("Paris is the capital of France. Rome is the capital of Italy. Berlin is the capital of "
                        "Germany. Lisbon is the capital of Portugal. Vienna is the capital of")
    assert len(prompt) >= 33
    prompt = prompt[-33:]
    others = [[(k * 31 + j * 7) % 4000 + 10 for j in range(70)] for k in (1, 2)]
    e = _engine(default_model_dir, tmp_path, kv_host_cache_dtype=host, kv_disk_cache_dtype=disk)
    io = e.executor.kv_io
    assert io.host.codec.name == host and io.host.data.dtype == torch.uint8
    assert (io.disk_recode is None) == (disk is None)
    first = _run(e, prompt)
    hashes = e.block_manager.find_prefix(prompt).block_hashes
    assert len(hashes) == 2
    for o in others:  # the prompt's blocks leave the 8-block device pool
        _run(e, o, max_tokens=2)
    again = _run(e, [*prompt])
    assert again.num_cached_tokens == 32 and e.tiers.stats.hit_tokens[Tier.HOST] == 32
    assert again.token_ids == first.token_ids
    _until_on_disk(e, hashes)
    del e, io
    restarted = _engine(default_model_dir, tmp_path, kv_host_cache_dtype=host, kv_disk_cache_dtype=disk)
    from_disk = _run(restarted, [*prompt])
    assert from_disk.num_cached_tokens == 32 and restarted.tiers.stats.hit_tokens[Tier.DISK] == 32
    assert from_disk.token_ids == first.token_ids


def test_host_and_disk_capacity_in_blocks_follow_the_tier_codec(tiny_llama_dir, tmp_path):
    from pdserve.kv.disk_store import HEADER
    pool = _engine(tiny_llama_dir, tmp_path).executor.kv_io
    cfg = _engine(tiny_llama_dir, tmp_path).executor.model.config
    per_token = {name: kv_codecs.kv_bytes_per_token(name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4) * 16
                 for name in ("auto", "int8", "int4")}
    assert pool.host.num_slots == int(0.01 * 2**30) // per_token["auto"]
    compact = _engine(tiny_llama_dir, tmp_path, kv_host_cache_dtype="int8", kv_disk_cache_dtype="int4").executor.kv_io
    assert compact.host.num_slots == int(0.01 * 2**30) // per_token["int8"]
    assert compact.host.num_slots > 3 * pool.host.num_slots  # fp32 -> int8 (+ a scale per token and head: 64 vs 20 B)
    assert compact.capacity.host_blocks == compact.host.num_slots
    assert compact.capacity.disk_blocks == kv_codecs.tier_blocks(16.0, per_token["int4"] + HEADER.size)
    assert pool.capacity.disk_blocks == kv_codecs.tier_blocks(16.0, per_token["auto"] + HEADER.size)
    assert compact.disk.payload_nbytes == per_token["int4"]
    assert compact.disk.dir != pool.disk.dir  # another codec's files live under another identity


def test_an_unknown_tier_codec_is_a_clear_error_from_the_python_api():
    from pdserve.engine.config import EngineConfig
    with pytest.raises(InvalidRequestError, match=f"^unknown kv_host_cache_dtype 'fp4'; choose from {ALLOWED}$"):
        EngineConfig(kv_host_cache_dtype="fp4")


@pytest.mark.parametrize("command", [("serve",), ("worker", "--role", "decode", "--join", "tcp://127.0.0.1:9")],
                         ids=lambda c: c[0])
@pytest.mark.parametrize("flag", ["--kv-host-cache-dtype", "--kv-disk-cache-dtype"])
def test_an_unknown_tier_codec_is_a_one_line_cli_error(command, flag):
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", *command, flag, "int3"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    param = flag[2:].replace("-", "_")
    assert proc.stderr.splitlines() == [f"error: unknown {param} 'int3'; choose from {ALLOWED}"]


@pytest.mark.parametrize("host", ["fp16", "int8"])
def test_a_long_prompts_head_lands_transcoded_in_a_compact_decode_host_tier(tiny_llama_dir, tmp_path, host):
    """PD, prompts longer than both pools: the decode worker receives each prompt's head straight into its host
    tier, here of another codec than its pool's: staged and transcoded into the tier's records
    (`block_io.land_mixed`), then read back through that codec by attention. Delivered, and the tokens are
    one big-pool engine's (fp16), or agree with them within int8's error (the first tokens)."""
    from test_pd_engine import Pair, _reference

    from pdserve.core.kvstore.kv_columns import Tier
    prompts = [[(53 * (i + 1) + 11 * j) % 4000 + 10 for j in range(150 + 50 * i)] for i in range(3)]
    small = dict(num_kv_blocks=24, kv_host_gb=0.02, max_num_batched_tokens=32)
    pair = Pair(tiny_llama_dir, "tcp", tmp_path, prefill_kw=small, decode_kw=dict(small, kv_host_cache_dtype=host))
    try:
        host_store = pair.d_engine.executor.kv_io.host
        assert host_store.codec.name == host and host_store.data.dtype == torch.uint8
        got, want = pair.run(prompts), _reference(tiny_llama_dir, prompts)
        assert pair.outcomes == ["delivered"] * len(prompts)
        assert pair.d_engine.tiers.stats.bytes_in[Tier.HOST] > 0
        if host == "fp16":
            assert got == want
        else:
            assert [g[:2] for g in got] == [w[:2] for w in want]
        pair.assert_no_leak()
    finally:
        pair.close()
