"""The shared KV pool in the simulator (`--kv-remote-pool-gb`): one `SimKVPool` under every engine, driven by each
engine's real `TieredKV` remote code (RemoteBook, probe / fetch / publish operations) through `SimTierIO`.

A synthetic multi-turn workload (each turn extends the conversation's previous one) on 2 prefill + 1 decode
engines routed least-loaded: a later turn often lands on the other prefill engine, whose own tiers miss its
prefix. With the pool it finds the prefix there: the prefill engines compute fewer prompt tokens, the cluster's
prefix hit ratio rises, on the same seed and workload.
"""

from __future__ import annotations

import json

import pytest

from pdserve.core.kvstore.kv_remote import ABSENT, RemoteBook
from pdserve.core.kvstore.kv_tiers import KVOp, TieredKV
from pdserve.errors import InvalidRequestError
from pdserve.sim.cli import main
from pdserve.sim.cluster import ClusterSpec, simulate
from pdserve.sim.hardware import get_gpu, get_model
from pdserve.sim.kv_pool import MISSING, SimKVPool
from pdserve.sim.report import sim_metrics
from pdserve.sim.tier_io import SimTierIO, TierSpec
from pdserve.sim.timemodel import RooflineTimeModel
from pdserve.workloads import RequestSpec, Workload

MODEL, GPU = get_model("llama-3-8b"), get_gpu("h100")
TURN = 1536  # tokens each turn adds (one workload hash block; 4 turns fit llama-3-8b's 8k context)


def conversations(n_conv=12, turns=4, gap_s=1.0, stagger_s=0.07, output_len=16) -> Workload:
    """Turn t of conversation c: blocks (c, 0) .. (c, t) of TURN tokens each, so it extends turn t - 1."""
    reqs = [RequestSpec(t * gap_s + c * stagger_s, (t + 1) * TURN, output_len,
                        tuple(1000 * c + k for k in range(t + 1))) for t in range(turns) for c in range(n_conv)]
    return Workload(sorted(reqs, key=lambda r: r.arrival_s), "multi-turn")


def run(pool_gb: float, **kw):
    spec = ClusterSpec(**{"mode": "pd", "num_prefill": 2, "num_decode": 1, "routing": "least-loaded",
                          "host_kv_gb": 4.0, "block_size": 16, "kv_remote_pool_gb": pool_gb, "seed": 0, **kw})
    return simulate(conversations(), spec, MODEL, GPU, RooflineTimeModel(MODEL, GPU, 1), block_tokens=TURN)


def prefill_computed(run_) -> int:
    """Prompt tokens the prefill engines computed (their prompts less every prefix hit, stage passes included)."""
    kv = sim_metrics(run_, 3, 1.0)["kv"]["prefill"]
    return kv["prompt_tokens"] - sum(kv["hit_tokens"].values())


def hit_ratio(run_) -> float:
    """The cluster's prefix hit ratio: prompt tokens of the requests not computed by a prefill engine."""
    prompts = sum(r.prompt_tokens for r in run_.records)
    return 1 - prefill_computed(run_) / prompts


# ---- the pool and the I/O runner on simulated time ---------------------------------------------------------
def test_pool_holds_what_was_published_from_its_end_and_evicts_least_recently_used():
    pool = SimKVPool(capacity_blocks=3, bw=1000.0, rtt_s=0.01, block_bytes=100)
    pool.publish((1, 2), visible_at_s=1.0)
    assert pool.probe((1, 2, 3), at_s=0.5) == {1: ABSENT, 2: ABSENT, 3: ABSENT}  # not written yet
    assert pool.probe((1, 2, 3), at_s=1.0) == {3: ABSENT}
    assert pool.fetch((1,), at_s=1.0) == {}  # a read is a use: 2 is now the least recently used
    pool.publish((3, 4), visible_at_s=2.0)
    assert pool.fetch((2, 1, 4), at_s=2.0) == {2: MISSING}  # evicted: a miss for the reader, not an error
    assert (pool.evicted, pool.fetched, pool.fetch_missing, pool.peak_blocks) == (1, 3, 1, 3)


def test_sim_tier_io_runs_the_pool_operations_on_their_links():
    now = [0.0]
    pool = SimKVPool(capacity_blocks=8, bw=100.0, rtt_s=0.5, block_bytes=100)
    spec = TierSpec(8, 0, 100, host_link_bw=1000.0, disk_read_bw=1.0, disk_write_bw=1.0)
    a, b = SimTierIO(spec, lambda: now[0], pool), SimTierIO(spec, lambda: now[0], pool)
    assert a.capacity.remote and not SimTierIO(spec, lambda: now[0]).capacity.remote
    a.submit([KVOp(0, "publish", (7, 8), src=(0, 1))])
    a.start(0.0)  # 200 B at 100 B/s + the round trip -> ends at 2.5, held from then on
    b.submit([KVOp(0, "probe", (7, 8, 9)), KVOp(1, "fetch", (7,), dst=(3,))])
    b.start(1.0)  # probe: a round trip, ends 1.5 (before the publish ends); fetch queues behind it: 1.5 + 1 + 0.5
    now[0] = 3.0
    assert b.poll() == [(0, {7: ABSENT, 8: ABSENT, 9: ABSENT}), (1, {})]
    assert a.poll() == [(0, {})]
    assert b.stats(3.0)["busy_s"]["remote_read"] == pytest.approx(2.0)
    assert a.stats(3.0)["bytes"]["remote_write"] == 200 and b.stats(3.0)["bytes"]["remote_read"] == 100


# ---- the cluster ----------------------------------------------------------------------------------------------
def test_the_pool_raises_the_cross_engine_prefix_hit_ratio(monkeypatch):
    done: dict[str, int] = {}
    for kind in ("probe", "fetch", "publish"):  # the real TieredKV's completions are what the sim's ops reach
        real = getattr(TieredKV, f"_done_{kind}")

        def counted(self, h, failed, _real=real, _kind=kind):
            done[_kind] = done.get(_kind, 0) + 1
            return _real(self, h, failed)
        monkeypatch.setattr(TieredKV, f"_done_{kind}", counted)
    plain = run(0.0)
    assert not done  # no pool: no pool operation
    pooled = run(8.0)
    assert all(r.ok for r in plain.records + pooled.records)
    assert plain.kv_pool is None and "remote" not in plain.engines[0]["kv_tiers"]["hit_tokens"]
    # the same TieredKV remote code ran: the pool's operations went through its completions
    assert done["probe"] > 0 and done["fetch"] > 0 and done["publish"] > 0
    engine_io = [e["kv_tiers"]["io"]["ops"] for e in pooled.engines]
    assert sum(ops.get("fetch", 0) for ops in engine_io) > 0
    remote = sum(e["kv_tiers"]["hit_tokens"]["remote"] for e in pooled.engines if e["role"] == "prefill")
    assert remote >= 12 * TURN  # later turns routed to the other prefill engine found their prefix in the pool
    assert pooled.kv_pool["fetched_blocks"] > 0 and pooled.kv_pool["published_blocks"] > 0
    assert prefill_computed(pooled) < 0.8 * prefill_computed(plain)
    assert hit_ratio(pooled) > hit_ratio(plain) + 0.1, (hit_ratio(plain), hit_ratio(pooled))


def test_a_pool_of_one_block_holds_almost_nothing():
    """Capacity is modelled: a pool too small for a prefix gives (almost) no hits."""
    assert hit_ratio(run(1e-6)) < hit_ratio(run(8.0)) - 0.1


def test_cli_flags_reach_the_pool_and_the_report(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = main(["simulate", "--workload", "fixed:600,4", "--num-requests", "6", "--rate", "4", "--model",
               "llama-3-8b", "--gpu", "h100", "--mode", "colocated", "--kv-host-gb", "1", "--kv-remote-pool-gb", "2",
               "--kv-remote-gbps", "80", "--kv-remote-rtt-us", "50", "--output", str(out), "--no-progress"])
    assert rc == 0
    assert "pool" in capsys.readouterr().out  # (the KV tiers table's pool columns)
    res = json.loads((out / "result.json").read_text())
    assert res["cluster"]["kv_remote_pool_gb"] == 2 and res["cluster"]["kv_remote_gbps"] == 80
    sim = res["runs"][0]["sim"]
    assert sim["kv_pool"]["capacity_bytes"] == 2 * 2**30 and sim["kv_pool"]["link_bw"] == 10e9
    assert sim["kv_pool"]["rtt_s"] == pytest.approx(50e-6) and sim["kv_pool"]["published_blocks"] > 0
    assert "remote" in sim["kv"]["colocated"]["hit_tokens"]
    assert sim["engines"][0]["kv_tiers"]["io"]["bandwidth"]["remote_write"] == 10e9
    assert set(sim["engines"][0]["kv_tiers"]["remote"]) == {"skipped_blocks", "slow_probes"}  # the tier code's


@pytest.mark.parametrize("flags, says", [
    (["--kv-remote-pool-gb", "-1"], "kv_remote_pool_gb must be >= 0"),
    (["--kv-remote-pool-gb", "nan"], "kv_remote_pool_gb must be >= 0"),
    (["--kv-remote-pool-gb", "1", "--kv-remote-gbps", "0"], "kv_remote_gbps must be positive"),
    (["--kv-remote-pool-gb", "1", "--kv-remote-rtt-us", "-5"], "kv_remote_rtt_us must be >= 0"),
    (["--kv-remote-pool-gb", "1", "--kv-host-gb", "0"], "needs a host tier"),
])
def test_bad_pool_flags_fail_in_one_line(flags, says, capsys):
    for command in (["simulate"], ["plan", "--gpus", "2"]):
        rc = main([*command, "--workload", "fixed:100,4", "--num-requests", "2", "--model", "llama-3-8b",
                   "--no-progress", *flags])
        err = capsys.readouterr().err
        assert rc == 2 and says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    with pytest.raises(InvalidRequestError):
        ClusterSpec(kv_remote_pool_gb=-1.0)


def test_the_remote_book_is_the_core_one():
    spec = ClusterSpec(mode="colocated", host_kv_gb=1.0, kv_remote_pool_gb=1.0, num_kv_blocks=64)
    from pdserve.sim.cluster import build
    _, _, engines = build(spec, MODEL, GPU, RooflineTimeModel(MODEL, GPU, 1))
    assert isinstance(engines[0].tiers, TieredKV) and isinstance(engines[0].tiers.remote, RemoteBook)
    assert engines[0].kv_io.pool is not None
