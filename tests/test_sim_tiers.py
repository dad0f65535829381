"""KV tiers in the simulator: the real `TieredKV` (host, disk) driven by simulated time through `SimTierIO`.

A synthetic multi-turn workload (each turn's prompt extends the conversation's previous one, conversations
interleaved) on a device pool too small to keep the conversations: a host tier turns later turns' prefixes
into host hits, which load faster than they recompute; a disk tier below a tiny host serves them from disk.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.core.kvstore.kv_tiers import KVLoad, KVOp
from pdserve.errors import InvalidRequestError
from pdserve.sim.cli import main
from pdserve.sim.cluster import ClusterSpec, engine_tiers, simulate
from pdserve.sim.hardware import GB, GPUS, get_gpu, get_model
from pdserve.sim.report import sim_metrics
from pdserve.sim.tier_io import GIB, SimTierIO, TierSpec, tier_spec
from pdserve.sim.timemodel import RooflineTimeModel
from pdserve.workloads import RequestSpec, Workload

MODEL, GPU = get_model("llama-3-8b"), get_gpu("h100")
BLOCK_BYTES = MODEL.kv_bytes_per_token * 16  # 2 MiB
TURN = 256  # tokens each turn adds (one workload hash block)
SMALL_HOST = 128 * BLOCK_BYTES / GIB  # a third of the conversations' blocks: most hits come from disk


def conversations(n_conv=6, turns=4, gap_s=0.5, stagger_s=0.05, output_len=8) -> Workload:
    """Turn t of conversation c: blocks (c, 0) .. (c, t) of TURN tokens each, so it extends turn t - 1."""
    reqs = [RequestSpec(t * gap_s + c * stagger_s, (t + 1) * TURN, output_len,
                        tuple(1000 * c + k for k in range(t + 1))) for t in range(turns) for c in range(n_conv)]
    return Workload(sorted(reqs, key=lambda r: r.arrival_s), "multi-turn")


def one_at_a_time(n_conv=5, turns=3, gap_s=1.0) -> Workload:
    """The same shape, each request alone in the cluster: a request whose prefix is on disk waits for the
    prefetch with nothing else to run."""
    reqs = [RequestSpec(i * gap_s, (t + 1) * TURN, 4, tuple(1000 * c + k for k in range(t + 1)))
            for i, (t, c) in enumerate((t, c) for t in range(turns) for c in range(n_conv))]
    return Workload(reqs, "one-at-a-time")


def run(wl: Workload, **kw):
    spec = ClusterSpec(**{"mode": "colocated", "num_kv_blocks": 96, "block_size": 16, **kw})
    return simulate(wl, spec, MODEL, GPU, RooflineTimeModel(MODEL, GPU, 1), block_tokens=TURN)


def kv(run_) -> dict:
    return sim_metrics(run_, 1, 1.0)["kv"]


def later_turn_ttft(run_) -> float:
    later = [r.first_token_s - r.start_s for r in run_.records if r.prompt_tokens > TURN]
    return sum(later) / len(later)


def _records(run_):
    return [(r.start_s, r.first_token_s, r.token_times, r.end_s, r.output_tokens, r.error) for r in run_.records]


# ---- the I/O runner on simulated time --------------------------------------------------------------------
def test_sim_tier_io_queues_each_link_and_completes_on_the_clock():
    now = [0.0]
    io = SimTierIO(TierSpec(8, 8, 100, host_link_bw=1000.0, disk_read_bw=100.0, disk_write_bw=50.0), lambda: now[0])
    assert io.restored() == [] and io.capacity.host_blocks == 8 and io.capacity.block_bytes == 100
    io.submit([KVOp(0, "offload", (1, 2), (0, 1), (0, 1)), KVOp(1, "offload", (3,), (2,), (2,)),
               KVOp(2, "flush", (1,), (0,)), KVOp(3, "prefetch", (9,), dst=(3,)), KVOp(4, "delete", (7,))])
    assert io.next_done_s() is None  # nothing starts before its step ends
    io.start(1.0)
    # offload 0: 200 B at 1000 B/s -> 1.2; offload 1 queues behind it -> 1.3; flush 100 B at 50 -> 3.0;
    # prefetch 100 B at 100 -> 2.0; delete: no time
    assert io.next_done_s() == 1.0
    now[0] = 1.0
    assert io.poll() == [(4, {})]
    now[0] = 1.25
    assert io.poll() == [(0, {})]
    now[0] = 10.0
    assert [op for op, _ in io.poll()] == [1, 3, 2]
    assert io.poll() == [] and io.next_done_s() is None
    assert io.busy_s["host_link"] == pytest.approx(0.3) and io.queued_s["host_link"] == pytest.approx(0.2)
    assert io.ops == {"offload": 2, "flush": 1, "prefetch": 1, "delete": 1}
    assert io.load([KVLoad(0, 1), KVLoad(1, 2)]) == pytest.approx(0.2)  # host -> device, inside the step
    assert io.loaded_blocks == 2 and io.load([]) == 0.0


def test_tiers_are_sized_like_the_real_worker_and_from_the_gpu_presets():
    spec = tier_spec(1.0, 2.0, BLOCK_BYTES, 1.0, 1.0, 1.0)
    assert spec.host_blocks == GIB // BLOCK_BYTES
    assert spec.disk_blocks == 2 * GIB // (BLOCK_BYTES + 64)  # each file: one block + the 64-byte header
    assert tier_spec(0, 0, BLOCK_BYTES, 1, 1, 1) is None
    for gpu in GPUS.values():
        assert gpu.host_link_bw >= 20 * GB and gpu.disk_read_bw > gpu.disk_write_bw > 0
    assert get_gpu("h100").host_link_bw > get_gpu("a100").host_link_bw  # PCIe Gen5 vs Gen4
    tiers = engine_tiers(ClusterSpec(tp=2, host_kv_gb=4, disk_kv_gb=8, disk_read_gb_s=10.0), GPU, MODEL)
    assert tiers.host_link_bw == 2 * GPU.host_link_bw and tiers.disk_read_bw == 2 * 10 * GB
    assert tiers.block_bytes == tiers.disk_block_bytes == BLOCK_BYTES  # default: every tier in the pool's codec
    assert engine_tiers(ClusterSpec(host_kv_gb=0), GPU, MODEL) is None
    with pytest.raises(InvalidRequestError, match="host tier"):
        ClusterSpec(host_kv_gb=0, disk_kv_gb=1)
    with pytest.raises(InvalidRequestError, match="eviction"):
        ClusterSpec(kv_eviction_policy="fifo")


# ---- the simulated cluster --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["colocated", "pd"])
def test_host_tier_serves_later_turns_and_cuts_their_ttft(mode):
    device_only, hosted = run(conversations(), mode=mode, host_kv_gb=0), run(conversations(), mode=mode, host_kv_gb=1)
    assert all(r.ok for r in device_only.records + hosted.records)
    assert all(v["hit_tokens"]["host"] == 0 for v in kv(device_only).values())
    for role, v in kv(hosted).items():
        assert v["hit_tokens"]["host"] > 0, role
        assert v["bytes_in"]["host"] > 0 and v["bytes_out"]["host"] >= v["hit_tokens"]["host"] // 16 * BLOCK_BYTES
        assert v["host_peak_bytes"] > 0 and v["link_busy_fraction"]["host_link"] > 0 and v["load_s"] > 0
        assert v["hit_tokens"]["disk"] == 0
    assert later_turn_ttft(hosted) < 0.8 * later_turn_ttft(device_only)
    (engine,) = [e for e in hosted.engines if e["role"] != "prefill"]
    assert engine["kv_tiers"]["capacity_blocks"]["host"] == GIB // BLOCK_BYTES
    assert engine["kv_tiers"]["io"]["ops"]["offload"] > 0


@pytest.mark.parametrize("mode", ["colocated", "pd"])
def test_disk_tier_below_a_small_host_gives_disk_hits(mode):
    r = run(conversations(), mode=mode, host_kv_gb=SMALL_HOST, disk_kv_gb=1)
    assert all(x.ok for x in r.records)
    for role, v in kv(r).items():
        assert v["hit_tokens"]["disk"] > v["hit_tokens"]["host"], role
        assert v["bytes_in"]["disk"] > 0 and v["bytes_out"]["disk"] >= v["hit_tokens"]["disk"] // 16 * BLOCK_BYTES
        assert v["link_busy_fraction"]["disk_read"] > 0 and v["link_busy_fraction"]["disk_write"] > 0
        assert v["host_peak_bytes"] <= 128 * BLOCK_BYTES


@pytest.mark.parametrize("mode", ["colocated", "pd"])
def test_a_request_waiting_for_a_disk_prefetch_is_woken_when_it_lands(mode):
    """Alone in the cluster, a request whose prefix is on disk waits for the prefetch; only the prefetch's
    end can wake its engine. Every request finishes, and the later turns hit disk."""
    r = run(one_at_a_time(), mode=mode, host_kv_gb=40 * BLOCK_BYTES / GIB, disk_kv_gb=1, num_kv_blocks=64)
    assert [x.error for x in r.records] == [None] * len(r.records)
    assert all(v["hit_tokens"]["disk"] > 0 for v in kv(r).values())
    assert max(x.first_token_s - x.start_s for x in r.records) < 0.1  # not left until the next arrival (1 s)


def test_waiting_lookups_on_a_small_host_do_not_evict_each_other_forever():
    """PD, a 64-block host: on the decode worker a preempted request (recomputing locally) and the head
    reservation both wait for disk prefetches that evict each other's host blocks. The workload's last request
    arrives at 1.75 s; by 10 s every request should have finished."""
    wl = conversations(output_len=64)
    spec = ClusterSpec(mode="pd", num_kv_blocks=96, block_size=16, host_kv_gb=64 * BLOCK_BYTES / GIB, disk_kv_gb=1)
    r = simulate(wl, spec, MODEL, GPU, RooflineTimeModel(MODEL, GPU, 1), block_tokens=TURN, until_s=10.0)
    assert [x.error for x in r.records] == [None] * len(wl)


def test_same_seed_same_report():
    reports = []
    for _ in range(2):
        r = run(conversations(), mode="pd", host_kv_gb=SMALL_HOST, disk_kv_gb=1, seed=3)
        m = sim_metrics(r, 2, 1.0)
        m.pop("simulator")  # wall-clock time
        reports.append((_records(r), json.dumps(m, sort_keys=True, default=str)))
    assert reports[0] == reports[1]


@pytest.mark.parametrize("mode,kw", [("colocated", {"host_kv_gb": 1}), ("pd", {"host_kv_gb": 1}),
                                     ("colocated", {"host_kv_gb": SMALL_HOST, "disk_kv_gb": 1}),
                                     ("pd", {"host_kv_gb": SMALL_HOST, "disk_kv_gb": 1})])
def test_fast_forward_equals_stepping_with_tiers(mode, kw):
    wl = conversations(output_len=64)  # long enough decodes to fast-forward
    step, ff = (run(wl, mode=mode, fast_forward=f, **kw) for f in (False, True))
    assert _records(step) == _records(ff)
    def strip(engines):  # busy time is summed per window when fast-forwarding: equal up to rounding
        return [{k: v for k, v in e.items() if k not in ("fast_forward_steps", "busy_fraction")} for e in engines]
    assert strip(step.engines) == strip(ff.engines)  # tier hits, bytes, peaks, link use, lifecycle stages too
    assert [e["busy_fraction"] for e in step.engines] == pytest.approx([e["busy_fraction"] for e in ff.engines])
    assert sum(e["fast_forward_steps"] for e in ff.engines) > 0


def test_eviction_policy_and_cli_flags_reach_the_report(tmp_path):
    out = tmp_path / "sim"
    rc = main(["simulate", "--workload", "fixed:300,8", "--num-requests", "6", "--rate", "4", "--model", "llama-3-8b",
               "--gpu", "h100", "--mode", "colocated", "--host-kv-gb", "0.5", "--disk-kv-gb", "1",
               "--kv-eviction-policy", "heat", "--host-link-gb-s", "20", "--disk-read-gb-s", "5",
               "--output", str(out), "--no-progress"])
    assert rc == 0
    res = json.loads((out / "result.json").read_text())
    assert res["cluster"]["disk_kv_gb"] == 1 and res["cluster"]["kv_eviction_policy"] == "heat"
    v = res["runs"][0]["sim"]["kv"]["colocated"]
    assert set(v["hit_tokens"]) == set(v["bytes_in"]) == set(v["bytes_out"]) == {"device", "host", "disk"}
    assert v["host_capacity_bytes"] == int(0.5 * GIB) // BLOCK_BYTES * BLOCK_BYTES and v["disk_capacity_bytes"] > 0
    assert v["bytes_in"]["host"] > 0  # every full block is copied down
    io = res["runs"][0]["sim"]["engines"][0]["kv_tiers"]["io"]
    assert io["bandwidth"]["host_link"] == 20 * GB and io["bandwidth"]["disk_read"] == 5 * GB
    rc = main(["simulate", "--workload", "fixed:300,8", "--num-requests", "2", "--model", "llama-3-8b",
               "--host-kv-gb", "0", "--disk-kv-gb", "1", "--no-progress"])
    assert rc == 2  # a disk tier needs a host tier


def test_a_simulation_with_tiers_never_loads_torch():
    code = ("import sys\n"
            "from tests.test_sim_tiers import conversations, run\n"
            "r = run(conversations(n_conv=2, turns=2), host_kv_gb=0.1, disk_kv_gb=0.5)\n"
            "assert all(x.ok for x in r.records)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    from pathlib import Path
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_a_compact_tier_codec_holds_more_blocks_and_moves_fewer_bytes():
    """--kv-host-cache-dtype / --kv-disk-cache-dtype: each tier is sized in blocks of its own codec, as the
    real worker's (`kv_codecs.tier_codecs`, `tier_blocks`), and its links carry that codec's bytes."""
    from pdserve.core.kvstore import kv_codecs
    int8_bytes = 16 * kv_codecs.kv_bytes_per_token("int8", MODEL.num_layers, MODEL.num_kv_heads, MODEL.hd,
                                                   MODEL.dtype_bytes)
    pool = engine_tiers(ClusterSpec(host_kv_gb=4, disk_kv_gb=8), GPU, MODEL)
    host8 = engine_tiers(ClusterSpec(host_kv_gb=4, disk_kv_gb=8, kv_host_cache_dtype="int8"), GPU, MODEL)
    assert host8.block_bytes == host8.disk_block_bytes == int8_bytes  # the disk follows the host by default
    assert host8.host_blocks == 4 * GIB // int8_bytes and host8.host_blocks > 1.9 * pool.host_blocks
    assert host8.disk_blocks == 8 * GIB // (int8_bytes + 64)
    disk8 = engine_tiers(ClusterSpec(host_kv_gb=4, disk_kv_gb=8, kv_disk_cache_dtype="int8"), GPU, MODEL)
    assert (disk8.host_blocks, disk8.block_bytes) == (pool.host_blocks, BLOCK_BYTES)
    assert disk8.disk_blocks == host8.disk_blocks
    for tiers, host_bytes in ((host8, int8_bytes), (disk8, BLOCK_BYTES)):
        io = SimTierIO(tiers, lambda: 0.0)
        io.submit([KVOp(1, "offload", (1, 2)), KVOp(2, "flush", (1,)), KVOp(3, "prefetch", (1, 2, 3))])
        io.start(0.0)
        assert io.bytes["host_link"] == 2 * host_bytes and io.load([KVLoad(0, 1)]) == host_bytes / tiers.host_link_bw
        assert io.bytes["disk_write"] == int8_bytes and io.bytes["disk_read"] == 3 * int8_bytes


def test_a_tier_codec_that_does_not_exist_is_one_line_on_the_cli():
    for flag in ("--kv-host-cache-dtype", "--kv-disk-cache-dtype"):
        proc = subprocess.run([sys.executable, "-m", "pdserve.sim.cli", "simulate", "--workload", "fixed:100,4",
                               "--num-requests", "2", "--model", "llama-3-8b", flag, "int3", "--no-progress"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2
        param = flag[2:].replace("-", "_")
        assert proc.stderr.strip().splitlines() == [
            f"error: unknown {param} 'int3'; choose from auto, fp16, bf16, fp8_e4m3, int8, int4"], proc.stderr
