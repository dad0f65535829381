"""Simulator fidelity: the same scaled trace on the real `pdserve serve` and in `pdserve simulate` with the
time model fitted to this machine; relative error of median and P90 TTFT and TPOT (target <= 10%).

    .venv/bin/python benchmarks/bench_fidelity.py [--workload SPEC ...] [--rate 0.5] [--max-requests 40]

Steps, all through the real command line:
  1. `pdserve profile --num-threads 1 --output bench_results/fidelity/fit.json` (the workers' thread count
     in PD mode on 2 cores: one each);
  2. `pdserve serve` (1 prefill + 1 decode, shm); first a calibration probe at idle: 8 requests of 16
     prompt tokens and 1 output token, one at a time; their median latency minus the fitted prefill time
     of 16 tokens, over the 4 gateway <-> worker messages on a PD request's way to its first token, is the
     control-plane latency per message; then `pdserve bench serve` of the workload -> real/;
  3. `pdserve simulate --mode pd --prefill 1 --decode 1 --time-model fitted:fit.json
     --control-latency-ms <probe>` on the model's config.json (for KV sizes), the same KV pool size, block
     size and budgets -> sim/;
  4. the table of relative errors, written to bench_results/fidelity/fidelity.json.
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


def control_latency_ms(url: str, fit: Path) -> tuple[float, list[float]]:
    """Per-message control-plane latency of the idle real system (see the module docstring)."""
    import random
    import statistics
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
    pre = json.loads(fit.read_text())["prefill"]
    compute = pre["a"] + pre["b"] * PROBE_TOKENS + pre["c"] * PROBE_TOKENS ** 2
    return max(statistics.median(latencies) - compute, 0.0) / PD_HOPS * 1000, latencies


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default=f"azure:{TRACE}")
    ap.add_argument("--length-scale", default="0.1")
    ap.add_argument("--rate", default="0.5")
    ap.add_argument("--max-requests", default="40")
    ap.add_argument("--skip-profile", action="store_true", help="reuse bench_results/fidelity/fit.json")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    fit = OUT / "fit.json"
    if not args.skip_profile:
        run("profile", "--num-threads", "1", "--output", str(fit))
    workload = ["--workload", args.workload, "--length-scale", args.length_scale, "--rate", args.rate,
                "--max-requests", args.max_requests, "--seed", "0"]
    server = Server("--num-threads", "1")
    try:
        blocks = int(server.metric("pdserve_kv_blocks_total", worker="decode-0"))
        control_ms, probe = control_latency_ms(server.url, fit)
        print(f"control-plane latency per message: {control_ms:.2f} ms (probe latencies "
              f"{', '.join(f'{x * 1000:.0f}' for x in probe)} ms)", flush=True)
        run("bench", "serve", "--endpoint", server.url, *workload, "--output", str(OUT / "real"), "--no-progress")
    finally:
        server.stop()
    from pdserve.model.loader import resolve_model_dir
    config = resolve_model_dir(None) / "config.json"
    run("simulate", *workload, "--model", str(config), "--gpu", "l40s", "--time-model", f"fitted:{fit}",
        "--mode", "pd", "--prefill", "1", "--decode", "1", "--block-size", "16", "--num-kv-blocks", str(blocks),
        "--prefill-budget", "2048", "--decode-budget", "2048", "--control-latency-ms", f"{control_ms:.3f}",
        "--output", str(OUT / "sim"), "--no-progress")
    real = json.loads((OUT / "real" / "result.json").read_text())["runs"][0]["summary"]
    sim = json.loads((OUT / "sim" / "result.json").read_text())["runs"][0]["summary"]
    rows = {}
    print(f"\n{'metric':<12}{'real ms':>10}{'sim ms':>10}{'rel. error':>12}")
    for metric in ("ttft_ms", "tpot_ms"):
        for q in ("p50", "p90"):
            r, s = real[metric][q], sim[metric][q]
            err = abs(s - r) / r
            rows[f"{metric}.{q}"] = {"real": r, "sim": s, "rel_error": err}
            print(f"{metric[:-3] + ' ' + q:<12}{r:>10.1f}{s:>10.1f}{err:>12.1%}")
    (OUT / "fidelity.json").write_text(json.dumps({"args": vars(args), "control_latency_ms": control_ms,
                                                   "probe_s": probe, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
