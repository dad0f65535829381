"""Bursts in the simulator as on the real server: the gateway takes requests in one at a time, and a decode
worker takes in delivered transfers one at a time, so an idle worker starts its step with the first message of
a burst alone (`pdserve.sim.conductor`: the k-th message of a burst `control_latency_s` after the one before).
Without a control latency a burst arrives together, as before."""

from __future__ import annotations

import json

import pytest

from pdserve.sim.cluster import ClusterSpec, simulate
from pdserve.sim.hardware import get_gpu, get_model
from pdserve.sim.timemodel import RooflineTimeModel
from pdserve.workloads import load_workload

MODEL, GPU = get_model("llama-3-8b"), get_gpu("h100")


def _run(tmp_path, rows, control_s: float):
    """Simulate a Mooncake trace of `rows` (timestamp ms, input, output tokens; no shared prefix), 1P1D."""
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": ts, "input_length": n, "output_length": out,
                                        "hash_ids": list(range(1000 * i, 1000 * i + -(-n // 512)))}) + "\n"
                            for i, (ts, n, out) in enumerate(rows)))
    spec = ClusterSpec(mode="pd", num_prefill=1, num_decode=1, num_instances=1, control_latency_s=control_s)
    return simulate(load_workload(f"mooncake:{path}"), spec, MODEL, GPU, RooflineTimeModel(MODEL, GPU, 1)).records


def test_a_burst_reaches_an_idle_prefill_worker_one_request_at_a_time(tmp_path):
    together = _run(tmp_path, [(0, 200, 4)] * 3, 0.0)
    assert len({r.first_token_s for r in together}) == 1  # one prefill step for the three
    apart = _run(tmp_path, [(0, 200, 4)] * 3, 0.005)
    assert [r.start_s for r in apart] == [0.0] * 3  # each request's clock starts when the client sends it
    first = [r.first_token_s for r in apart]
    # the first alone in the idle worker's step; the next two behind it, each at least one message later
    assert first == sorted(first) and first[1] - first[0] > 0.005 and first[2] - first[1] >= 0.005


def test_transfers_of_one_prefill_step_land_one_after_another(tmp_path):
    """A long prompt keeps the prefill worker busy while two short ones arrive: they share its next step. Their
    transfers land `control_latency_s` apart: the idle decode worker's first step takes the first alone and the
    second waits for the next step (as the real decode worker does), so its first token comes one decode step
    later; with no control latency both land together and share the step."""
    rows = [(0, 6000, 1), (2, 300, 4), (2, 300, 4)]
    _, b, c = _run(tmp_path, rows, 0.0)
    assert b.first_token_s == c.first_token_s and b.token_times == c.token_times
    _, b, c = _run(tmp_path, rows, 0.005)
    step = b.token_times[1] - b.token_times[0]
    assert c.first_token_s - b.first_token_s == pytest.approx(step)
