"""`--kv-cache-dtype` in the simulator: the codec's bytes size the KV pool and the PD link, its decode cost
lands on the attention's KV reads, and on a KV-bound cluster a smaller codec keeps more requests decoding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench.metrics import meets_slo
from pdserve.core.kvstore.kv_codecs import CODECS, residual_bytes_per_seq, token_bytes
from pdserve.sim.cli import main
from pdserve.sim.cluster import ClusterSpec, simulate
from pdserve.sim.hardware import get_gpu, get_model, kv_pool_blocks
from pdserve.sim.timemodel import (Coefficients, FittedTimeModel, RooflineTimeModel, StepShape, fitted_for_codec,
                                   make_time_model)
from pdserve.workloads import RequestSpec, Workload

GPU = get_gpu("h100")
ROOT = Path(__file__).resolve().parents[1]


def ratio(codec: str, model: str = "llama-3-8b") -> float:
    """Bytes of a token in auto over bytes in `codec`: how many more tokens the codec fits."""
    m = get_model(model)
    return token_bytes("auto", m.hd, m.dtype_bytes) / token_bytes(codec, m.hd, m.dtype_bytes)


def sim_cli(out: Path, *flags: str) -> dict:
    rc = main(["simulate", "--workload", "fixed:300,8", "--num-requests", "6", "--rate", "4", "--model", "llama-3-8b",
               "--gpu", "h100", "--output", str(out), "--no-progress", *flags])
    assert rc == 0
    return json.loads((out / "result.json").read_text())


def test_model_bytes_per_token_follow_the_codec():
    auto, int8, int4 = (get_model("llama-3-8b", c) for c in ("auto", "int8", "int4"))
    assert auto.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # bf16, as before the flag
    assert int8.kv_bytes_per_token == 2 * 32 * 8 * (128 + 4)  # codes + one fp32 scale per token and head
    assert int4.kv_bytes_per_token == 2 * 32 * 8 * (64 + 8)  # packed codes + scale and minimum
    assert get_model("llama-3-8b", "bf16").kv_bytes_per_token == auto.kv_bytes_per_token
    assert auto.weight_bytes == int8.weight_bytes  # the codec codes the KV only


@pytest.mark.parametrize("codec, approx", [("int8", 1.94), ("int4", 3.52)])
def test_pool_blocks_scale_by_the_token_bytes_ratio(tmp_path, capsys, codec, approx):
    base, coded = sim_cli(tmp_path / "auto"), sim_cli(tmp_path / codec, "--kv-cache-dtype", codec)
    assert base["cluster"]["kv_cache_dtype"] == "auto" and coded["cluster"]["kv_cache_dtype"] == codec
    assert coded["cluster"]["kv_bytes_per_token"] == get_model("llama-3-8b", codec).kv_bytes_per_token
    b, c = base["cluster"]["kv_pool_blocks"], coded["cluster"]["kv_pool_blocks"]
    model = get_model("llama-3-8b", codec)  # int4's residual windows (256 sequences' last blocks, fp16) come first
    free = GPU.mem_bytes * 0.85 - model.weight_bytes
    window = residual_bytes_per_seq(codec, 32, 8, 128, 16) * 256
    assert (window > 0) == (codec == "int4")
    assert c / b == pytest.approx(ratio(codec) * (1 - window / free), rel=1e-4)
    assert c / b == pytest.approx(approx, abs=0.01)
    assert c == kv_pool_blocks(model, GPU, 1, 16)
    assert {e["num_blocks"] for e in coded["runs"][0]["sim"]["engines"]} == {c}  # the engines got that pool
    assert f"KV cache {codec}: {coded['cluster']['kv_bytes_per_token']} bytes/token, {c} blocks" in \
        capsys.readouterr().out


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8_e4m3"])
def test_pd_link_bytes_per_request_scale_by_the_ratio(codec):
    wl = Workload([RequestSpec(0.2 * i, 320, 4) for i in range(5)], "fixed")
    sent = {}
    for c in ("auto", codec):
        m = get_model("llama-3-8b", c)
        run = simulate(wl, ClusterSpec(mode="pd", host_kv_gb=0), m, GPU, RooflineTimeModel(m, GPU, 1))
        assert all(r.ok for r in run.records)
        sent[c] = run.life.bytes_delivered / len(wl.requests)
    assert sent["auto"] == 320 * get_model("llama-3-8b").kv_bytes_per_token
    assert sent["auto"] / sent[codec] == pytest.approx(ratio(codec), rel=1e-9)


def test_unknown_dtype_is_a_one_line_cli_error():
    for cmd in (["simulate"], ["plan", "--gpus", "2", "--slo-ttft-ms", "1000"]):
        res = subprocess.run([sys.executable, "-m", "pdserve.sim.cli", *cmd, "--workload", "fixed:100,4",
                              "--num-requests", "2", "--model", "llama-3-8b", "--kv-cache-dtype", "int3",
                              "--no-progress"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert res.returncode == 2
        assert res.stderr.strip().splitlines() == [
            "error: unknown kv_cache_dtype 'int3'; choose from auto, fp16, bf16, fp8_e4m3, int8, int4"]
        assert "Traceback" not in res.stderr


def test_roofline_adds_dequant_to_kv_reads_only():
    auto, int8 = get_model("llama-3-8b"), get_model("llama-3-8b", "int8")
    tm = {m.kv_cache_dtype: RooflineTimeModel(m, GPU, 1, overhead_s=0.0) for m in (auto, int8)}
    bw = GPU.mem_bw * GPU.mbu
    shape = StepShape.decode(64, 64 * 4000)  # memory-bound decode
    read, written = shape.decode_context * int8.kv_bytes_per_token, 64 * int8.kv_bytes_per_token
    want = (int8.weight_bytes + read * (1 + CODECS["int8"].dequant_overhead) + written) / bw
    assert tm["int8"].step_time(shape) == pytest.approx(want, rel=1e-12)
    assert tm["int8"].step_time(shape) < tm["auto"].step_time(shape)  # half the bytes beat a 5% decode cost
    assert tm["int8"].decode_times(64, 64 * 4000, 50).tolist() == [
        tm["int8"].step_time(StepShape.decode(64, 64 * 4000 + 64 * i)) for i in range(1, 51)]


def test_fitted_model_scales_its_cached_kv_terms_only(tmp_path):
    fit = FittedTimeModel(Coefficients(0.01, 2e-5, 1e-9, 4e-9), Coefficients(0.008, 3e-7, 1e-4), {"model": "x"})
    int8 = get_model("llama-3-8b", "int8")
    scaled = fitted_for_codec(fit, int8)
    scale = (1 + CODECS["int8"].dequant_overhead) / ratio("int8")
    assert scaled.decode.b == pytest.approx(3e-7 * scale) and scaled.prefill.d == pytest.approx(4e-9 * scale)
    assert scaled.prefill.a == fit.prefill.a and (scaled.prefill.b, scaled.prefill.c) == (fit.prefill.b, fit.prefill.c)
    assert (scaled.decode.a, scaled.decode.c) == (fit.decode.a, fit.decode.c)
    assert scaled.meta["kv_codec_scaling"]["decode_context_scale"] == pytest.approx(scale)
    assert fitted_for_codec(fit, get_model("llama-3-8b")) is fit  # auto on auto: as measured
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({**json.loads(fit.to_json()), "kv_cache_dtype": "int8"}))
    assert make_time_model(f"fitted:{path}", int8, GPU, 1).decode == fit.decode  # measured with int8 already
    path.write_text(fit.to_json())  # measured with auto: the CLI scales it and says so
    out = sim_cli(tmp_path / "sim", "--kv-cache-dtype", "int8", "--time-model", f"fitted:{path}")
    assert out["cluster"]["time_model_kv_scaling"] == {"measured": "auto", "simulated": "int8",
                                                       "decode_context_scale": pytest.approx(scale),
                                                       "prefill_prefix_scale": pytest.approx(scale)}


def kv_bound_run(codec: str):
    """A burst of long prompts on one prefill and one decode engine of qwen2.5-32b on one H100 each: the
    weights leave ~9.4k tokens of bf16 KV, so the decode pool, not compute, bounds the batch."""
    m = get_model("qwen2.5-32b", codec)
    wl = Workload([RequestSpec(0.02 * i, 2000, 200) for i in range(40)], "burst")
    return simulate(wl, ClusterSpec(mode="pd", host_kv_gb=0), m, GPU, RooflineTimeModel(m, GPU, 1))


def peak_decoding(records) -> int:
    """Most requests decoding on the decode engine at once (second token to last)."""
    events = sorted([(r.token_times[1], 1) for r in records] + [(r.end_s, -1) for r in records])
    best = now = 0
    for _, d in events:
        now += d
        best = max(best, now)
    return best


def test_int8_keeps_more_requests_decoding_on_a_kv_bound_cluster():
    runs = {c: kv_bound_run(c) for c in ("auto", "int8")}
    for run in runs.values():
        assert all(r.ok for r in run.records)
    blocks_per_request = -(-2200 // 16)
    pools = {c: kv_pool_blocks(get_model("qwen2.5-32b", c), GPU, 1, 16) for c in runs}
    assert peak_decoding(runs["auto"].records) == pools["auto"] // blocks_per_request == 4
    assert peak_decoding(runs["int8"].records) == pools["int8"] // blocks_per_request == 8
    attained = {c: sum(meets_slo(r, 10000, 100) for r in run.records) for c, run in runs.items()}
    assert attained["int8"] >= 2 * attained["auto"] > 0
    assert runs["int8"].duration_s < 0.6 * runs["auto"].duration_s
