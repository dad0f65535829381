"""`pdserve bench serve` / `bench compare` as a user runs them, against a live `pdserve serve`."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from serve_util import TRACES, Server


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", *args], capture_output=True, text=True,
                          timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr


@pytest.mark.parametrize("args,needle", [
    (["--endpoint", "http://127.0.0.1:9", "--workload", "fixed:8,4", "--num-requests", "2"], "cannot reach"),
    (["--endpoint", "http://127.0.0.1:9", "--workload", "mooncake:/no/such/trace.jsonl"], "/no/such/trace.jsonl"),
    (["--endpoint", "http://127.0.0.1:9", "--workload", "nope:1,2"], "nope"),
    (["--endpoint", "http://127.0.0.1:9", "--workload", "fixed:8,4"], "num_requests"),
    (["--endpoint", "http://127.0.0.1:9", "--workload", "fixed:8,4", "--num-requests", "2", "--rates", "1,x"],
     "--rates"),
])
def test_bad_input_is_one_line(args, needle):
    one_line_error(bench("serve", *args), needle)


@pytest.fixture(scope="module")
def server():
    s = Server("--mode", "colocated")
    yield s
    s.stop()


@pytest.mark.slow
def test_fixed_workload_report(server, tmp_path):
    out = tmp_path / "fixed"
    proc = bench("serve", "--endpoint", server.url, "--workload", "fixed:40,8", "--num-requests", "6",
                 "--rates", "2,4", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--output", str(out),
                 "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "TTFT p50" in proc.stdout and "goodput" in proc.stdout
    result = json.loads((out / "result.json").read_text())
    assert result["model"] == "SmolLM2-135M-Instruct" and result["goodput_req_s"] == 4
    for run in result["runs"]:
        s = run["summary"]
        assert s["num_ok"] == 6 and s["num_errors"] == 0 and s["total_output_tokens"] == 48
        assert s["total_prompt_tokens"] == 240  # exact prompt lengths, as the server counted them
        assert 0 < s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"] and s["slo"]["attainment"] == 1.0
        starts = sorted(r["start_s"] for r in run["requests"])
        assert starts[-1] > 0.5  # open loop: arrivals spread at the rate, not all at once
        assert run["kv"] is not None and run["kv"]["delivered"] == 0  # a colocated server delivers no KV
    for png in ("ttft_cdf.png", "tpot_cdf.png", "throughput.png", "attainment.png"):
        assert (out / png).stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.skipif(not TRACES.exists(), reason="no shared traces")
def test_mooncake_prefix_sharing_reaches_the_server(server, tmp_path):
    before = server.metric("pdserve_prefix_cache_hit_tokens_total")
    proc = bench("serve", "--endpoint", server.url, "--workload",
                 f"mooncake:{TRACES / 'mooncake_conversation_trace.jsonl'}", "--length-scale", "0.05",
                 "--time-scale", "1", "--max-requests", "14", "--max-input-len", "200", "--max-output-len", "4",
                 "--output",
                 str(tmp_path / "mc"), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "mc" / "result.json").read_text())
    assert result["runs"][0]["summary"]["num_ok"] == 14
    assert result["workload_description"]["time_scale"] == 1
    # Every request of this trace starts with hash block 0 (26 tokens at this scale). The first 10 arrive
    # together at t=0 (admitted in one step: nothing to hit yet); the last 4 arrive at t=3 s and must each
    # hit at least one cached 16-token KV block (worker stats reach the gateway every 0.25 s).
    deadline = time.monotonic() + 5
    while server.metric("pdserve_prefix_cache_hit_tokens_total") <= before and time.monotonic() < deadline:
        time.sleep(0.25)
    assert server.metric("pdserve_prefix_cache_hit_tokens_total") >= before + 4 * 16


@pytest.mark.slow
def test_endpoint_errors_are_counted_not_fatal(server, tmp_path):
    proc = bench("serve", "--endpoint", server.url, "--workload", "fixed:8,4", "--num-requests", "3",
                 "--model", "no-such-model", "--output", str(tmp_path / "err"), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "err" / "result.json").read_text())["runs"][0]["summary"]
    assert summary["num_errors"] == 3 and "HTTP 404" in summary["errors"][0]["message"]
    assert "3 x HTTP 404" in proc.stdout


@pytest.mark.slow
def test_compare(server, tmp_path):
    for name in ("a", "b"):
        proc = bench("serve", "--endpoint", server.url, "--workload", "fixed:16,4", "--num-requests", "2",
                     "--concurrency", "2", "--output", str(tmp_path / name), "--no-progress")
        assert proc.returncode == 0, proc.stderr
    proc = bench("compare", str(tmp_path / "a"), str(tmp_path / "b" / "result.json"), "--labels", "pd,co",
                 "--output", str(tmp_path / "cmp"))
    assert proc.returncode == 0, proc.stderr
    assert "pd" in proc.stdout and "co" in proc.stdout
    assert json.loads((tmp_path / "cmp" / "comparison.json").read_text())["labels"] == ["pd", "co"]
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 1000
    one_line_error(bench("compare", str(tmp_path / "missing")), "cannot read")
