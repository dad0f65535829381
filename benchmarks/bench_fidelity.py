"""Simulator fidelity: the same scaled trace on the real `pdserve serve` and in `pdserve simulate` with the
time model fitted to this machine; relative error of median and P90 TTFT and TPOT (target <= 10%).

    .venv/bin/python benchmarks/bench_fidelity.py [--workload SPEC ...] [--rate 0.5] [--max-requests 40]
                                                 [--repeats 3]

This shared 2-core VM changes speed by tens of percent within minutes, so a profile taken once, minutes
before a run, can describe another machine than the one the run met. Hence, through the real command line:
  1. `pdserve profile --num-threads 1` (the workers' thread count in PD mode on 2 cores: one each) over the
     shapes this workload makes (prefill 16..512 tokens, decode batches 1..16 at 64 and 256 tokens), ~40 s,
     before the first run and after each run: P0, run 1, P1, run 2, P2, ...;
  2. each run: `pdserve serve` (1 prefill + 1 decode, shm); a calibration probe at idle (8 requests of 16
     prompt tokens and 1 output token, one at a time), then `pdserve bench serve` of the workload -> real/;
  3. run k is simulated with `pdserve profile --merge P(k-1) P(k)` (the machine around that run): `pdserve
     simulate --mode pd --prefill 1 --decode 1 --time-model fitted:... --control-latency-ms C` on the model's
     config.json (for KV sizes), the same KV pool size, block size and budgets -> sim/; C = the probe's
     median latency minus the fitted prefill time of 16 tokens, over the 4 gateway <-> worker messages on a
     PD request's way to its first token;
  4. the relative errors of each run and their median over runs -> bench_results/fidelity/fidelity.json,
     with the drift between consecutive profiles (how far the machine moved during each run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from serve_util import Server  # noqa: E402

OUT = ROOT / "bench_results" / "fidelity"
PDSERVE = [sys.executable, "-m", "pdserve.cli"]
TRACE = "/work/shared/traces/AzureLLMInferenceTrace_conv_2023.csv"


def run(*args: str) -> None:
    print("$ pdserve", " ".join(args), flush=True)
    subprocess.run([*PDSERVE, *args], check=True)


PROBE_TOKENS, PROBE_REQUESTS, PD_HOPS = 16, 8, 4


def probe_latencies(url: str) -> list[float]:
    """Latencies of PROBE_REQUESTS idle requests of PROBE_TOKENS prompt tokens and one output token."""
    import random
    import time

    import httpx
    rng = random.Random(0)
    latencies = []
    for _ in range(PROBE_REQUESTS):
        prompt = [rng.randrange(100, 30000) for _ in range(PROBE_TOKENS)]
        start = time.perf_counter()
        httpx.post(url + "/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": prompt,
                                                  "max_tokens": 1, "temperature": 0}, timeout=60).raise_for_status()
        latencies.append(time.perf_counter() - start)
    return latencies


def control_latency_ms(latencies: list[float], fit: Path) -> float:
    """Per-message control-plane latency: the probe's median minus the fitted prefill time of its prompt."""
    import statistics
    pre = json.loads(fit.read_text())["prefill"]
    compute = pre["a"] + pre["b"] * PROBE_TOKENS + pre["c"] * PROBE_TOKENS ** 2
    return max(statistics.median(latencies) - compute, 0.0) / PD_HOPS * 1000


PROFILE_SHAPES = ["--prefill-tokens", "16,32,64,128,256,512", "--decode-batches", "1,2,4,8,16",
                  "--decode-contexts", "64,256"]
METRICS = [(m, q) for m in ("ttft_ms", "tpot_ms") for q in ("p50", "p90")]


def drift(before: Path, after: Path) -> dict:
    """How much slower (+) the machine was at the second profile than at the first, per step kind: the
    median ratio of the two profiles' timings of the same shapes."""
    import statistics
    out = {}
    a, b = (json.loads(p.read_text())["samples"] for p in (before, after))
    for kind in ("prefill", "decode"):
        ratios = [y["seconds"] / x["seconds"] for x, y in zip(a, b) if x["kind"] == kind]
        out[kind] = statistics.median(ratios) - 1
    return out


def real_run(k: int, workload: list[str]) -> tuple[int, list[float]]:
    """Serve and replay the workload once; the KV pool size and the idle probe's latencies."""
    server = Server("--num-threads", "1")
    try:
        blocks = int(server.metric("pdserve_kv_blocks_total", worker="decode-0"))
        probe = probe_latencies(server.url)
        run("bench", "serve", "--endpoint", server.url, *workload, "--output", str(OUT / f"real{k}"),
            "--no-progress")
    finally:
        server.stop()
    return blocks, probe


def simulate(k: int, workload: list[str], fit: Path, blocks: int, control_ms: float) -> None:
    from pdserve.model.loader import resolve_model_dir
    config = resolve_model_dir(None) / "config.json"
    run("simulate", *workload, "--model", str(config), "--gpu", "l40s", "--time-model", f"fitted:{fit}",
        "--mode", "pd", "--prefill", "1", "--decode", "1", "--block-size", "16", "--num-kv-blocks", str(blocks),
        "--prefill-budget", "2048", "--decode-budget", "2048", "--control-latency-ms", f"{control_ms:.3f}",
        "--output", str(OUT / f"sim{k}"), "--no-progress")


def errors(k: int) -> dict:
    real = json.loads((OUT / f"real{k}" / "result.json").read_text())["runs"][0]["summary"]
    sim = json.loads((OUT / f"sim{k}" / "result.json").read_text())["runs"][0]["summary"]
    return {f"{m}.{q}": {"real": real[m][q], "sim": sim[m][q], "rel_error": abs(sim[m][q] - real[m][q]) / real[m][q]}
            for m, q in METRICS}


def main() -> int:
    import statistics
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default=f"azure:{TRACE}")
    ap.add_argument("--length-scale", default="0.1")
    ap.add_argument("--rate", default="0.5")
    ap.add_argument("--max-requests", default="40")
    ap.add_argument("--repeats", type=int, default=3, help="real runs, each between two profiles")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    workload = ["--workload", args.workload, "--length-scale", args.length_scale, "--rate", args.rate,
                "--max-requests", args.max_requests, "--seed", "0"]
    profiles = [OUT / f"profile{k}.json" for k in range(args.repeats + 1)]
    run("profile", "--num-threads", "1", *PROFILE_SHAPES, "--output", str(profiles[0]))
    runs = []
    for k in range(1, args.repeats + 1):
        blocks, probe = real_run(k, workload)
        run("profile", "--num-threads", "1", *PROFILE_SHAPES, "--output", str(profiles[k]))
        fit = OUT / f"fit{k}.json"
        run("profile", "--merge", str(profiles[k - 1]), str(profiles[k]), "--output", str(fit))
        control_ms = control_latency_ms(probe, fit)
        simulate(k, workload, fit, blocks, control_ms)
        runs.append({"control_latency_ms": control_ms, "probe_s": probe,
                     "drift": drift(profiles[k - 1], profiles[k]), "rows": errors(k)})
        print_run(k, runs[-1])
    median = {key: statistics.median(r["rows"][key]["rel_error"] for r in runs) for key in runs[0]["rows"]}
    print("\nmedian relative error over runs: " + ", ".join(f"{key} {e:.1%}" for key, e in median.items()))
    (OUT / "fidelity.json").write_text(json.dumps({"args": vars(args), "runs": runs,
                                                   "median_rel_error": median}, indent=1))
    return 0


def print_run(k: int, r: dict) -> None:
    d = r["drift"]
    print(f"\nrun {k}: control-plane latency {r['control_latency_ms']:.2f} ms/message; machine drift over the run: "
          f"prefill {d['prefill']:+.0%}, decode {d['decode']:+.0%}")
    print(f"{'metric':<12}{'real ms':>10}{'sim ms':>10}{'rel. error':>12}")
    for key, row in r["rows"].items():
        name = key.replace("_ms", "").replace(".", " ")
        print(f"{name:<12}{row['real']:>10.1f}{row['sim']:>10.1f}{row['rel_error']:>12.1%}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
