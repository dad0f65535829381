"""Time models, the link model and the CLI of the simulator."""

from __future__ import annotations

import json
import re

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.sim.cli import main
from pdserve.sim.events import EventLoop
from pdserve.sim.hardware import get_gpu, get_model, kv_pool_blocks, model_from_hf_config
from pdserve.sim.link import LinkModel
from pdserve.sim.plan import candidates
from pdserve.sim.timemodel import (Coefficients, FittedTimeModel, RooflineTimeModel, StepShape, fit_time_model,
                                   make_time_model)


def test_roofline_decode_is_memory_bound_and_prefill_compute_bound():
    m, g = get_model("llama-3-70b"), get_gpu("h100")
    tm = RooflineTimeModel(m, g, tp=4, overhead_s=0.0)
    weights_s = m.weight_bytes / (4 * g.mem_bw * g.mbu)
    assert tm.step_time(StepShape.decode(1, 100)) == pytest.approx(weights_s, rel=0.12)  # + all-reduce latency
    n = 8192
    prefill = tm.step_time(StepShape(n, n * n, n * (n + 1) // 2, n, 0, 0, 1))
    assert prefill > 2 * m.num_params * n / (4 * g.bf16_flops * g.mfu)
    assert RooflineTimeModel(m, g, tp=8).step_time(StepShape.decode(8, 8000)) < tm.step_time(StepShape.decode(8, 8000))


def test_gpu_and_model_tables():
    assert {"a100-80g", "a800", "h100", "h200", "l40s"} <= {get_gpu(n).name for n in
                                                           ("a100-80g", "a800", "h100", "h200", "l40s")}
    for name in ("llama-3-8b", "llama-2-70b", "llama-3-70b", "qwen2.5-7b", "qwen2.5-32b"):
        assert get_model(name).num_params > 5e9
    assert 68e9 < get_model("llama-3-70b").num_params < 72e9
    assert get_model("llama-3-70b").kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    tiny = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
            "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}
    hf = model_from_hf_config(tiny)
    assert hf.num_kv_heads == 4 and hf.kv_bytes_per_token == 2 * 2 * 4 * 16 * 2  # bf16 unless the config says
    fp32 = model_from_hf_config({**tiny, "torch_dtype": "float32"})
    assert fp32.kv_bytes_per_token == 2 * hf.kv_bytes_per_token  # the embedded model's KV, fp32 on CPU
    with pytest.raises(InvalidRequestError, match="does not fit on 1 x h100; raise --tp") as e:
        kv_pool_blocks(get_model("llama-3-70b"), get_gpu("h100"), 1, 16)
    assert e.value.param == "tp"


def test_fit_recovers_distserve_coefficients(tmp_path):
    true = FittedTimeModel(Coefficients(0.01, 2e-5, 1e-9), Coefficients(0.008, 3e-7, 1e-4))
    shapes = [StepShape(n, n * n, 0, 0, 0, 0, 1) for n in (64, 256, 1000, 2048, 4096)]
    shapes += [StepShape.decode(b, b * c) for b, c in ((1, 500), (8, 2000), (32, 1000), (64, 4000))]
    fitted = fit_time_model([(s, true.step_time(s)) for s in shapes], {"model": "x"})
    for s in shapes:
        assert fitted.step_time(s) == pytest.approx(true.step_time(s), rel=1e-6)
    path = tmp_path / "fit.json"
    path.write_text(fitted.to_json())
    loaded = make_time_model(f"fitted:{path}", get_model("llama-3-8b"), get_gpu("h100"), 1)
    assert loaded.step_time(shapes[2]) == pytest.approx(true.step_time(shapes[2]), rel=1e-6)
    assert json.loads(path.read_text())["prefill"]["a"] == pytest.approx(0.01)


def test_link_shares_bandwidth_between_flows():
    loop = EventLoop()
    links = LinkModel(loop, latency_s=0.001)
    a, b, d = links.link("p0", 100.0), links.link("p1", 100.0), links.link("d0", 100.0)
    done = {}
    links.start((a, d), 100.0, 0.0, lambda: done.setdefault("x", loop.now))
    links.start((b, d), 100.0, 0.0, lambda: done.setdefault("y", loop.now))
    loop.run()
    assert done["x"] == pytest.approx(2.001) and done["y"] == pytest.approx(2.001)  # d0 is shared
    loop2 = EventLoop()
    links2 = LinkModel(loop2, latency_s=0.0)
    p = links2.link("p", 100.0)
    links2.start((p,), 100.0, 5.0, lambda: done.setdefault("capped", loop2.now))  # produced over 5 s
    loop2.run()
    assert done["capped"] == pytest.approx(5.0)
    assert links2.stats(10.0)["p"]["utilization"] == pytest.approx(0.1)


def test_simulate_cli_writes_result(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = main(["simulate", "--workload", "fixed:300,20", "--num-requests", "12", "--rates", "2,8",
               "--model", "llama-3-8b", "--gpu", "h100", "--prefill", "1", "--decode", "1",
               "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--output", str(out), "--no-progress"])
    assert rc == 0
    res = json.loads((out / "result.json").read_text())
    run = res["runs"][0]
    assert run["summary"]["num_ok"] == 12 and run["summary"]["total_output_tokens"] == 12 * 20
    for run in res["runs"]:
        check_lifecycle(run, "llama-3-8b", 12, 300)
    assert run["sim"]["cost"]["usd_per_1k_output_tokens"] > 0
    assert (out / "ttft_cdf.png").exists() and (out / "kv_usage.png").exists()
    assert "predictable" in capsys.readouterr().out


def check_lifecycle(run: dict, model: str, num_requests: int, prompt_len: int) -> None:
    """What must hold of the lifecycle metrics of a 1P1D run whose every request succeeded on an idle link."""
    life, transfer = run["sim"]["lifecycle"], run["sim"]["transfer"]
    assert life["transfers"] == num_requests and life["transfer_failures"] == 0 and life["aborted"] == 0
    # every prompt block went over the link once, and all of it was used
    blocks = -(-prompt_len // 16)
    assert transfer["bytes_delivered"] == num_requests * blocks * 16 * get_model(model).kv_bytes_per_token
    assert life["wasted_transfer_rate"] == 0
    for link in transfer["links"].values():  # no link carries faster than its bandwidth
        assert link["bytes"] == transfer["bytes_delivered"]
        assert link["busy_s"] >= link["bytes"] / link["bandwidth"]
    assert life["link_busy_s"] == pytest.approx(sum(v["busy_s"] for v in transfer["links"].values()))
    assert 0 < life["link_utilization_while_busy"] <= 1
    for key in ("schedule_predictability", "schedule_predictability_at_prefilled",
                "schedule_predictability_at_dispatch"):
        assert 0 <= life[key] <= 1, key
    errors = life["prediction_abs_error_ms"]
    assert 0 <= errors["p50"] <= errors["p90"]
    if errors["p90"] <= life["predictability_tolerance_ms"]:  # 90% of the blocks landed within the tolerance
        assert life["schedule_predictability"] >= 0.9
    # every request decoded 20 tokens: a gap's deviation from its request's mean is below the slowest gap
    jitter = life["p99_inter_token_jitter_ms"]
    assert 0 <= jitter < run["summary"]["itl_ms"]["p99"]


def test_plan_candidates_cheapest_first_and_plan_runs(capsys):
    import argparse
    args = argparse.Namespace(model="llama-3-70b", gpu="h100", tp_options="1,2,4", gpus=8, block_size=16,
                              include_colocated=False)
    cands = candidates(args)
    assert all(tp >= 2 for _, tp, _, _ in cands)  # 70B does not fit one H100
    costs = [(p + d) * tp for _, tp, p, d in cands]
    assert costs == sorted(costs) and max(costs) <= 8
    # prompts arriving faster than one prefill engine computes them: the cheapest candidate (1P1D) misses the
    # TTFT SLO by far, the next one simulated (the planner's 2P1D of 3 engines) meets it
    rc = main(["plan", "--workload", "fixed:2000,10", "--num-requests", "40", "--rate", "30", "--model",
               "llama-3-8b", "--gpu", "h100", "--gpus", "4", "--tp-options", "1", "--slo-ttft-ms", "200",
               "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    verdicts = re.findall(r"│\s*pd\s*│\s*1\s*│\s*(\d)\s*│\s*(\d)\s*│\s*\d\s*│\s*([\d.]+)%\s*│\s*(MEETS|misses)", out)
    assert [(p, d, v) for p, d, _, v in verdicts] == [("1", "1", "misses"), ("2", "1", "MEETS")], out
    assert float(verdicts[0][2]) < 50 and float(verdicts[1][2]) >= 90
    assert "cheapest deployment meeting the SLOs: pd tp1 2P1D (3 GPUs)" in out
    assert "role planner's split of 2 engines at TP 1: 1P1D" in out  # (the role switcher's model, printed first)


def test_vectorized_decode_times_are_bit_identical_to_step_time():
    models = [RooflineTimeModel(get_model("llama-3-70b"), get_gpu("h100"), tp) for tp in (1, 4)]
    models.append(FittedTimeModel(Coefficients(0.01, 2e-4, 3e-8), Coefficients(0.02, 1.3e-6, 5.1e-4)))
    for tm in models:
        for n, ctx in ((1, 0), (7, 12345), (64, 10 ** 6)):
            want = [tm.step_time(StepShape.decode(n, ctx + n * i)) for i in range(1, 300)]
            assert tm.decode_times(n, ctx, 299).tolist() == want


def test_fitted_wake_up_table_interpolates_and_round_trips(tmp_path):
    tm = FittedTimeModel(Coefficients(0.01, 2e-5, 0), Coefficients(0.008, 3e-7, 1e-4), wake=[(8.0, 0.3), (2.0, 0.1)])
    assert tm.wake_time(0) == 0 and tm.wake_time(-1) == 0
    assert tm.wake_time(1.0) == pytest.approx(0.05)  # from (0, 0) to (2, 0.1)
    assert tm.wake_time(5.0) == pytest.approx(0.2)
    assert tm.wake_time(100.0) == pytest.approx(0.3)  # held beyond the longest measured gap
    path = tmp_path / "fit.json"
    path.write_text(tm.to_json())
    loaded = make_time_model(f"fitted:{path}", get_model("llama-3-8b"), get_gpu("h100"), 1)
    assert loaded.wake_time(5.0) == pytest.approx(0.2)
    assert loaded.wake_time(5.0, decode=True) == pytest.approx(0.2)  # no decode table: the same one
    assert FittedTimeModel(tm.prefill, tm.decode).wake_time(5.0) == 0  # no table: no wake-up cost
    split = FittedTimeModel(tm.prefill, tm.decode, wake=tm.wake, wake_decode=[(2.0, 0.02)])
    path.write_text(split.to_json())
    loaded = make_time_model(f"fitted:{path}", get_model("llama-3-8b"), get_gpu("h100"), 1)
    assert loaded.wake_time(1.0, decode=True) == pytest.approx(0.01) and loaded.wake_time(1.0) == pytest.approx(0.05)
    assert RooflineTimeModel(get_model("llama-3-8b"), get_gpu("h100")).wake_time(5.0) == 0
    path.write_text(json.dumps({**json.loads(tm.to_json()), "wake": [[2.0, -0.1]]}))
    with pytest.raises(InvalidRequestError, match="wake"):
        make_time_model(f"fitted:{path}", get_model("llama-3-8b"), get_gpu("h100"), 1)


def test_a_woken_decode_step_consumes_its_kv_when_it_begins(tmp_path):
    """A real decode worker times a step that woke it from the step's start (the wake-up is its slow first
    layers), and reports the KV it reads as consumed then: the simulator does the same, so however long the
    wake-up, the consumption predictions stay on time (they were off by each wake-up before)."""
    fit = tmp_path / "fit.json"
    fit.write_text(FittedTimeModel(Coefficients(0.01, 2e-5, 0), Coefficients(0.008, 3e-7, 1e-4),
                                   wake=[(1.0, 0.0)], wake_decode=[(1.0, 0.0), (3.0, 0.06)]).to_json())
    out = tmp_path / "sim"
    assert main(["simulate", "--workload", "fixed:64,4", "--num-requests", "40", "--rates", "0.5", "--model",
                 "llama-3-8b", "--gpu", "h100", "--time-model", f"fitted:{fit}", "--prefill", "1", "--decode", "1",
                 "--output", str(out), "--no-progress"]) == 0
    life = json.loads((out / "result.json").read_text())["runs"][0]["sim"]["lifecycle"]
    assert life["transfers"] == 40 and life["schedule_predictability"] >= 0.95, life
