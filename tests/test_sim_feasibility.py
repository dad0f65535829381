"""`pdserve plan` / `simulate` say up front what share of a workload no deployment can serve and why
(`pdserve.sim.feasibility`): prompts over the model's context, SLOs below the hardware's floors; the best
attainment possible; and in a 'no deployment' verdict, what would change it. Simulator only, a few seconds."""

from __future__ import annotations

import json
import math

import pytest

from pdserve.bench.metrics import RequestRecord
from pdserve.sim.cli import main
from pdserve.sim.feasibility import cached_bounds, decode_floor_s, feasibility, prefill_floor_s
from pdserve.sim.hardware import get_gpu, get_model
from pdserve.sim.timemodel import RooflineTimeModel
from pdserve.workloads.spec import RequestSpec, Workload

PLAN = ["plan", "--model", "llama-3-8b", "--gpu", "a100", "--gpus", "2", "--tp-options", "1", "--no-progress"]


def _trace(tmp_path, rows: list[tuple[int, int]], gap_ms: int = 200, hash_ids=None) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i * gap_ms, "input_length": n_in, "output_length": n_out,
                                        **({"hash_ids": hash_ids[i]} if hash_ids else {})}) + "\n"
                            for i, (n_in, n_out) in enumerate(rows)))
    return f"mooncake:{path}"


def _plan(capsys, tmp_path, *flags: str) -> tuple[int, str, dict]:
    out_dir = tmp_path / f"plan{len(list(tmp_path.iterdir()))}"
    rc = main([*PLAN, *flags, "--output", str(out_dir)])
    out = capsys.readouterr().out
    return rc, out, json.loads((out_dir / "plan.json").read_text())


def test_share_over_the_context_bounds_the_plan_and_max_input_len_changes_the_verdict(capsys, tmp_path):
    # 5 of 20 prompts at or over llama-3-8b's 8,192-token context (one of them exactly at it: no room for output,
    # as the scheduler's rule says), at a load one 1P1D serves easily
    workload = _trace(tmp_path, [(8192 if i == 0 else 9000 if i % 4 == 0 else 1000, 20) for i in range(20)])
    rc, out, doc = _plan(capsys, tmp_path, "--workload", workload, "--slo-ttft-ms", "2000")
    assert rc == 1
    # said up front, before the search, with the reason and the share
    head = out.split("role planner")[0]
    assert "best SLO attainment possible: 75.0% (5 requests no deployment can serve)" in head, out
    assert "5 of 20 (25.0%) requests have prompts at or over llama-3-8b's 8,192-token context" in head, out
    feas = doc["feasibility"]
    assert (feas["over_context"], feas["ttft_floor"], feas["tpot_floor"]) == (5, 0, 0)
    assert feas["best_attainment"] == 1 - 5 / 20
    best = max(c["attainment"] for c in doc["candidates"])
    assert best <= feas["best_attainment"]  # no simulated deployment beats the bound
    # the verdict: reached vs possible, and what would change it
    assert f"the best reached {best:.1%} (pd tp1 1P1D), of 75.0% possible" in out, out
    assert "even a perfect deployment serves at most 75.0% < 90%" in out
    assert "a model with a longer context (presets holding 9,000 tokens: llama-3-70b" in out
    assert "--max-input-len 8172 to clip them" in out
    assert "limited by load" not in out  # every servable request was served: more GPUs would not help
    assert doc["verdict"][0].startswith("no deployment within 2 GPUs")

    rc, out, doc = _plan(capsys, tmp_path, "--workload", workload, "--slo-ttft-ms", "2000", "--max-input-len", "8172")
    assert rc == 0, out
    assert "--max-input-len 8172: 5 prompts clipped to it" in out
    assert "best SLO attainment possible: 100.0%" in out
    assert doc["feasibility"]["unservable"] == 0 and doc["feasibility"]["clipped_input"] == 5
    assert "cheapest deployment meeting the SLOs: pd tp1 1P1D (2 GPUs)" in out


def test_tpot_slo_below_the_decode_floor_is_named(capsys, tmp_path):
    # llama-3-8b on an A100 decodes one sequence in ~10 ms a step: a 5 ms TPOT is out of reach for every
    # request that decodes two tokens or more; those asking for one token have no TPOT and stay servable
    workload = _trace(tmp_path, [(1000, 20 if i % 2 else 1) for i in range(10)])
    rc, out, doc = _plan(capsys, tmp_path, "--workload", workload, "--slo-tpot-ms", "5")
    assert rc == 1
    feas = doc["feasibility"]
    assert (feas["over_context"], feas["tpot_floor"], feas["best_attainment"]) == (0, 5, 0.5)
    tm = RooflineTimeModel(get_model("llama-3-8b"), get_gpu("a100"), 1)
    floor_ms = decode_floor_s(tm, 1000, 20, 8192) * 1000
    assert feas["tpot_floor_ms"] == pytest.approx(floor_ms) and 5 < floor_ms < 50
    assert (f"5 of 10 (50.0%) need a TPOT under 5 ms, below their own decode steps at batch 1 on the fastest TP "
            f"tried (1): floors up to {floor_ms:.1f} ms") in out, out
    assert f"the 5 below the decode floor: --slo-tpot-ms {math.ceil(floor_ms * 10) / 10:g} or more" in out
    # and the SLO it quotes is enough: asked for, no request is out of reach
    rc, out, doc = _plan(capsys, tmp_path, "--workload", workload, "--slo-tpot-ms", f"{floor_ms + 0.05:.2f}")
    assert doc["feasibility"]["tpot_floor"] == 0


def test_ttft_slo_below_the_prefill_floor_is_named_and_simulate_keeps_it_in_its_json(capsys, tmp_path):
    workload = _trace(tmp_path, [(4000 if i < 3 else 200, 4) for i in range(12)])
    out_dir = tmp_path / "sim"
    assert main(["simulate", "--workload", workload, "--model", "llama-3-8b", "--gpu", "a100", "--slo-ttft-ms",
                 "100", "--no-progress", "--output", str(out_dir)]) == 0
    out = capsys.readouterr().out
    feas = json.loads((out_dir / "result.json").read_text())["feasibility"]
    assert (feas["ttft_floor"], feas["best_attainment"]) == (3, 0.75)
    assert "3 of 12 (25.0%) need a TTFT under 100 ms, below their prompt's own prefill" in out, out
    assert "best SLO attainment possible: 75.0%" in out.split("\n")[0]
    assert "SLO attainment: " in out and "of 75.0% possible" in out


def test_the_floor_is_the_fastest_tp_tried():
    workload = Workload([RequestSpec(0, 4000, 4)] * 3 + [RequestSpec(0, 200, 4)] * 9, "t")
    model = get_model("llama-3-8b")
    tms = {tp: RooflineTimeModel(model, get_gpu("a100"), tp) for tp in (1, 2)}
    floors = [prefill_floor_s(tms[tp], 4000, 0, 8192) * 1000 for tp in (1, 2)]
    assert floors[1] < floors[0]
    slo = (floors[0] + floors[1]) / 2  # within reach at TP 2 only
    assert feasibility(workload, model, {1: tms[1]}, 8192, slo, None).ttft_floor == 3
    both = feasibility(workload, model, tms, 8192, slo, None)
    assert both.ttft_floor == 0 and both.tps == (1, 2)


def test_the_floors_are_never_beaten_by_the_simulator(tmp_path):
    """Each simulated request's TTFT and TPOT is at least its floor: conversation turns that extend an earlier
    turn's prefix (a prefix hit: a floor from the whole prompt would be beaten) and fresh prompts, on 1P1D."""
    rows, hashes = [], []
    for conv in range(4):
        for turn in range(3):
            n = 512 * (turn + 2) + 100
            rows.append((n, 2000 if conv == 0 else 8))  # (long outputs: the mean decode step, not the first)
            hashes.append([1000 * conv + b for b in range(turn + 3)])
    order = sorted(range(len(rows)), key=lambda i: (i % 3, i))  # turn 1 of every conversation, then turn 2, ...
    rows, hashes = [rows[i] for i in order], [hashes[i] for i in order]
    out_dir = tmp_path / "sim"
    workload = _trace(tmp_path, rows, gap_ms=25000, hash_ids=hashes)
    assert main(["simulate", "--workload", workload, "--model", "llama-3-8b", "--gpu", "a100", "--no-progress",
                 "--prefill-budget", "512", "--output", str(out_dir)]) == 0
    records = [RequestRecord(**r) for r in json.loads((out_dir / "result.json").read_text())["runs"][0]["requests"]]
    tm = RooflineTimeModel(get_model("llama-3-8b"), get_gpu("a100"), 1)
    specs = [RequestSpec(i, n, o, tuple(h)) for i, ((n, o), h) in enumerate(zip(rows, hashes))]
    cached = cached_bounds(Workload(specs, "t"), 512)
    assert cached[:4] == [0] * 4 and all(c > 0 for c in cached[4:])  # later turns extend earlier ones
    hits = 0
    for rec, spec, c in zip(records, specs, cached):
        assert rec.ok
        floor = prefill_floor_s(tm, spec.input_len, c, 512)
        assert rec.ttft_s >= floor - 1e-9, (spec, c, rec.ttft_s, floor)
        if c == 0:  # a lone prompt with nothing cached: the floor is its TTFT but for the control messages
            assert rec.ttft_s <= floor * 1.01 + 1e-3, (spec, rec.ttft_s, floor)
        hits += c > 0 and rec.ttft_s < prefill_floor_s(tm, spec.input_len, 0, 512)
        assert rec.tpot_s == pytest.approx(decode_floor_s(tm, spec.input_len, spec.output_len, 8192), rel=2e-3)
    assert hits  # (the cache did serve some turns faster than their whole prompt's prefill)


def test_a_verdict_limited_by_load_says_so(capsys, tmp_path):
    # prompts arriving faster than one prefill engine computes them: every request is within reach, 1P1D
    # (the only candidate on 2 GPUs) misses most of them
    rc, out, doc = _plan(capsys, tmp_path, "--workload", "fixed:2000,10", "--num-requests", "40", "--rate", "30",
                         "--slo-ttft-ms", "200")
    assert rc == 1 and doc["feasibility"]["best_attainment"] == 1.0
    best = doc["candidates"][0]["attainment"]
    assert best < 0.5
    assert f"the best reached {best:.1%} (pd tp1 1P1D), of 100.0% possible" in out
    assert f"{1 - best:.1%} of the workload is within reach but was missed: limited by load (more GPUs than --gpus 2" \
        in out
    assert "even a perfect deployment" not in out


def test_cached_bounds_follow_whole_shared_prefixes():
    specs = [RequestSpec(0, 1536, 1, (0, 1, 2)), RequestSpec(1, 1536, 1, (0, 1, 3)), RequestSpec(2, 512, 1, (4,)),
             RequestSpec(3, 2000, 1, (0, 1, 2, 5)), RequestSpec(4, 1536, 1, (9, 1, 2)),
             RequestSpec(5, 1024, 1, (0, 1))]
    # the whole prompt cached still leaves its last token to compute
    assert cached_bounds(Workload(specs, "t"), 512) == [0, 1024, 0, 1536, 0, 1023]
