"""KV checkpoints (`pdserve.engine.checkpoints`) with real engines (a tiny random Llama) and real disk tiers:
a decode engine's request is checkpointed through its disk tier; another engine adopts the dead one's files,
computes only the tail itself (no prefill worker) and goes on with the tokens an undisturbed run gives; a
missing or damaged checkpoint block sends it to a prefill worker instead, counted, never serving wrong KV."""

from __future__ import annotations

import time
import uuid

import pytest

from pdserve.core.kvstore.kv_meta import Tier
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.checkpoints import KVCheckpoints
from pdserve.engine.config import EngineConfig
from pdserve.engine.pd import DecodeSide
from pdserve.engine.worker_engine import build_engine_at
from pdserve.transfer import make_receiver

PROMPT = [(37 * j + 11) % 4000 + 10 for j in range(10)]
TOKENS = 24
BLOCK = 4


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _engine(model_dir, root, name: str):
    cfg = EngineConfig(block_size=BLOCK, num_kv_blocks=256, num_threads=1, max_num_batched_tokens=64,
                       kv_host_gb=0.01, kv_disk_dir=str(root) if root else None)
    return build_engine_at(model_dir, cfg, detokenize=False, worker=name, long_context=False)


def _run(engine, rid: str, until: int | None = None) -> list[int]:
    out: list[int] = []
    while engine.has_unfinished() and (until is None or len(out) < until):
        for o in engine.step():
            if o.request_id == rid:
                out = list(o.token_ids)
    return out


@pytest.fixture
def reference(tiny_llama_dir) -> list[int]:
    engine = _engine(tiny_llama_dir, None, "ref")
    engine.add_request(PROMPT, _params(TOKENS), request_id="r")
    return _run(engine, "r")


@pytest.fixture
def dead_worker(tiny_llama_dir, tmp_path):
    """A decode engine "d0" that produced 14 tokens of "r", its checkpoint reported, then stopped for good."""
    engine = _engine(tiny_llama_dir, tmp_path / "kv", "d0")
    engine.add_request(PROMPT, _params(TOKENS), request_id="r")
    out = _run(engine, "r", until=14)
    checkpoints = KVCheckpoints(engine, engine.kv_io.disk, every=8)
    deadline, due = time.monotonic() + 30, []
    while not due:  # the write-through to disk runs on the I/O thread
        assert time.monotonic() < deadline, "no checkpoint"
        engine.poll_kv()
        due = checkpoints.due()
        time.sleep(0.01)
    (rid, tokens), = due
    assert rid == "r" and tokens % BLOCK == 0 and 8 <= tokens <= len(PROMPT) + len(out)
    assert checkpoints.due() == []  # reported once until it grows by `every` again
    return engine, out, tokens


def test_decoded_blocks_reach_disk_in_runs_no_longer_than_a_checkpoint(tiny_llama_dir, tmp_path):
    """Decoded blocks are written through in runs (256 tokens by default); with checkpoints every 8 tokens a run
    is at most 8 tokens, so what is on disk trails the decode by about a checkpoint, not by a whole run."""
    engine = _engine(tiny_llama_dir, tmp_path / "kv", "d0")
    KVCheckpoints(engine, engine.kv_io.disk, every=8)
    assert engine.block_manager.offload_unit == 8 // BLOCK
    engine.add_request(PROMPT, _params(TOKENS), request_id="r")
    out = _run(engine, "r", until=14)  # 10 + 13 tokens computed: 5 full blocks, the 5th not yet a whole run
    hashes = engine.block_manager.registered_hashes("r")
    deadline, durable = time.monotonic() + 10, 0
    while durable < 4:  # the write-through to disk runs on the I/O thread
        assert time.monotonic() < deadline, f"{durable} of {len(hashes)} blocks on disk: a run never went down"
        engine.poll_kv()
        durable = engine.tiers.disk.ready_prefix(hashes)[0]
        time.sleep(0.01)
    assert len(out) == 14 and len(hashes) == 5


def _taker(tiny_llama_dir, tmp_path):
    engine = _engine(tiny_llama_dir, tmp_path / "kv", "d1")
    receiver = make_receiver("shm", f"ipc://{tmp_path}/kv-{uuid.uuid4().hex[:8]}")
    side = DecodeSide(engine, receiver, engine.executor.kv_pool.layers, 10.0)
    side.checkpoints = KVCheckpoints(engine, engine.kv_io.disk, every=8)
    return engine, side


def _reserve(engine, side, resumed: list[int], left: int, tokens: int):
    side.reserve("r", resumed, _params(left), "r#1", restore={"peer": "d0", "tokens": tokens})
    deadline, granted = time.monotonic() + 30, []
    while not granted:  # the adopted blocks are prefetched disk -> host first
        assert time.monotonic() < deadline, "never reserved"
        engine.poll_kv()
        granted = side.try_reserve()
        time.sleep(0.01)
    return granted


def test_a_restored_checkpoint_resumes_with_the_same_tokens(tiny_llama_dir, tmp_path, reference, dead_worker):
    _, out, tokens = dead_worker
    engine, side = _taker(tiny_llama_dir, tmp_path)
    resumed = PROMPT + out
    (grant,) = _reserve(engine, side, resumed, TOKENS - len(out), tokens)
    assert side.inbound.get("r#1") is None  # no prefill worker: the checkpoint's tail is computed here
    assert not grant.needs_prefill
    assert grant.first_block == tokens // BLOCK and side.stats.checkpoint_fallbacks == 0
    (_, outcome, req), = side.settle()
    assert outcome == "delivered" and req.num_computed_tokens == tokens  # the rest, computed by the next steps
    assert engine.tiers.stats.hit_tokens[Tier.DISK] >= tokens - BLOCK
    assert out + _run(engine, "r") == reference
    for _ in range(10):  # an offload's end starts a flush (host -> disk)
        if not engine.tiers.num_ops_in_flight:
            break
        engine.kv_io.drain()
        engine.poll_kv()
    assert engine.tiers.num_ops_in_flight == 0 and engine.block_manager.num_used_blocks == 0
    side.receiver.close()


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_damaged_checkpoint_goes_to_a_prefill_worker(tiny_llama_dir, tmp_path, dead_worker, damage):
    dead, out, tokens = dead_worker
    hashes = dead.block_manager.sequence_hashes((PROMPT + out)[:tokens])
    victim = dead.kv_io.disk.path(hashes[1])
    if damage == "missing":
        victim.unlink()
    else:
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0xFF
        victim.write_bytes(bytes(data))
    engine, side = _taker(tiny_llama_dir, tmp_path)
    (grant,) = _reserve(engine, side, PROMPT + out, TOKENS - len(out), tokens)
    assert side.inbound.get("r#1") is not None  # a prefill worker must send what the checkpoint lacks
    assert grant.needs_prefill and grant.first_block <= 1 and side.stats.checkpoint_fallbacks == 1
    if damage == "corrupt":
        assert engine.tiers.stats.corrupt[Tier.DISK] == 1  # found on read, dropped, never served
    side.abort("r")
    engine.abort(["r"])
    side.receiver.close()
