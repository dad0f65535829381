"""The KV codec gate (issue 40 item 6, `pdserve.engine.codec_gate`): `pdserve check-kv` and `pdserve serve`
refuse a deliberately broken codec (the test-only `broken_int8`, under PDSERVE_TEST_BROKEN_KV_CODEC=1) with one
line, and the shipped codecs pass on the default model. Real subprocesses, the embedded model, a fresh cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.core.kvstore import kv_codecs
from pdserve.engine import codec_gate
from pdserve.engine.codec_gate import GateResult, Thresholds
from pdserve.engine.config import EngineConfig
from pdserve.server.launch import ServeConfig

SHIPPED = [c for c in kv_codecs.CODECS if c not in ("auto", kv_codecs.BROKEN)]
KERNEL_FALLBACK = "pdserve CPU kernels not used"  # the broken codec has no kernel: counted, said on stderr


def run_cli(cache, *args: str, broken: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PDSERVE_CALIBRATION_CACHE": str(cache)}
    if broken:
        env[kv_codecs.TEST_CODEC_ENV] = "1"
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in proc.stderr, proc.stderr
    return [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith(KERNEL_FALLBACK)]


@pytest.mark.slow
def test_check_kv_refuses_a_broken_codec_in_one_line(tmp_path):
    proc = run_cli(tmp_path, "check-kv", "--kv-cache-dtype", kv_codecs.BROKEN)
    assert proc.returncode == 1, proc.stderr
    assert error_lines(proc) == []
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    assert lines[0].startswith(f"kv codec {kv_codecs.BROKEN} on ") and ": FAIL (perplexity +" in lines[0]
    assert "top-1 agreement" in lines[0] and "[thresholds: perplexity <= +4%, top-1 agreement >= 85%;" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("command", [["serve"], ["worker", "--role", "prefill", "--join", "tcp://127.0.0.1:9"]])
def test_serve_and_a_joining_worker_refuse_to_start_on_a_broken_codec(tmp_path, monkeypatch, command):
    monkeypatch.setenv("PDSERVE_DEPLOYMENT_SECRET", "ab" * 32)  # (the joining worker's; serve ignores it)
    proc = run_cli(tmp_path, *command, "--kv-cache-dtype", kv_codecs.BROKEN, timeout=180)  # (a gate that let it
    # through would serve, or wait for its gateway, until then)
    assert proc.returncode == 2, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: refusing to start: kv codec {kv_codecs.BROKEN} on ")
    assert ": FAIL (" in lines[0] and "--kv-codec-gate off" in lines[0]


@pytest.mark.slow
def test_check_kv_passes_a_shipped_codec(tmp_path):
    proc = run_cli(tmp_path, "check-kv", "--kv-cache-dtype", "int8", "--json", broken=False)
    assert proc.returncode == 0, proc.stderr
    (row,) = [json.loads(ln) for ln in proc.stdout.strip().splitlines()]
    assert row["passed"] and row["failures"] == [] and row["source"] == "measured"
    assert row["codec"] == "int8" and row["tokens"] == codec_gate.TOKENS
    assert abs(row["perplexity_change"]) < 0.01 and row["top1_agreement"] > 0.95


def test_unknown_codec_is_a_one_line_error_listing_the_codecs(tmp_path):
    for cmd in ("check-kv", "serve"):
        proc = run_cli(tmp_path, cmd, "--kv-cache-dtype", "int3", broken=False)
        assert proc.returncode == 2
        assert error_lines(proc) == [f"error: unknown kv_cache_dtype 'int3'; choose from {', '.join(kv_codecs.CODECS)}"]
    proc = run_cli(tmp_path, "serve", "--kv-codec-gate", "maybe", broken=False)
    assert proc.returncode == 2 and error_lines(proc) == ["error: --kv-codec-gate must be on or off, got 'maybe'"]


@pytest.mark.slow
def test_shipped_codecs_pass_on_the_default_model_and_are_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CALIBRATION_CACHE", str(tmp_path))
    results = codec_gate.check_codecs(EngineConfig(), SHIPPED)
    assert [r.codec for r in results] == SHIPPED
    for r in results:
        assert r.passed and r.source == "measured", r.line()
    again = codec_gate.check_codecs(EngineConfig(), SHIPPED)  # what `pdserve serve` reads at its next start
    assert [r.source for r in again] == ["cached"] * len(SHIPPED)
    assert [r.perplexity_coded for r in again] == [r.perplexity_coded for r in results]
    strict = codec_gate.check_codecs(EngineConfig(), ["int4"], Thresholds(max_perplexity_change=0.001))
    assert not strict[0].passed and strict[0].source == "cached"  # the verdict is the reader's thresholds'


def test_serve_gates_every_codec_it_would_use_unless_off():
    engine = EngineConfig(kv_cache_dtype="int8", kv_host_cache_dtype="fp8_e4m3", kv_disk_cache_dtype="int4")
    assert codec_gate.served_codecs(engine, ServeConfig(kv_wire_dtype="auto", decode_kv_cache_dtype="fp16")) == [
        "int8", "fp8_e4m3", "int4", "fp16"]
    assert codec_gate.served_codecs(EngineConfig(), ServeConfig()) == []
    assert codec_gate.gate_serve(engine, ServeConfig(kv_codec_gate="off")) == []  # measures nothing


@pytest.mark.parametrize("ppl, top1, failed", [(1.039, 0.86, []), (1.041, 0.86, ["perplexity"]),
                                               (1.0, 0.84, ["top-1"]), (2.0, 0.1, ["perplexity", "top-1"])])
def test_thresholds(ppl, top1, failed):
    r = GateResult("x", "m", "t", 512, 10.0, 10.0 * ppl, top1, 0.5, 1.0)
    assert [f.split()[0] for f in Thresholds().failures(r)] == failed
