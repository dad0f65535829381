"""How much of a fidelity run's TTFT error is the order of tied arrivals (issue 42, docs/benchmarks.md "Simulator
speed and fidelity"): requests of a trace with the same timestamp reach the real server in a race, and the first
runs alone in a prefill step; the twin takes them in trace order.

    .venv/bin/python benchmarks/fidelity_tied_order.py --run bench_results/fidelity_mc37 --k 3 \
        --trace bench_results/conversations.jsonl --control-latency-ms 3.749 --model CONFIG.json \
        [--length-scale 0.03125] [--num-kv-blocks 256] [--kv-host-gb 0.5]

Reorders each group of tied requests of `--trace` (its first `len(real<k>)` lines) into the order the real run k
gave them their first token, simulates that trace with run k's server fit (`server_fit<k>.json`, the in-sample
fit) as bench_fidelity.py's "server fit" column does, and prints TTFT p50 / p90 of the real run, of bench_fidelity's
simulation in trace order (`sim<k>_server/`) and of the reordered one. `--control-latency-ms`: from the
fidelity run's `pdserve simulate ... sim<k>_server` line of bench_fidelity.py's output, as is `--model`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np


def requests(result_dir: Path) -> list[dict]:
    return json.loads((result_dir / "result.json").read_text())["runs"][0]["requests"]


def ttft(result_dir: Path) -> tuple[float, float]:
    t = [(r["first_token_s"] - r["start_s"]) * 1e3 for r in requests(result_dir) if r["first_token_s"]]
    return float(np.percentile(t, 50)), float(np.percentile(t, 90))


def real_order(lines: list[dict], real: list[dict]) -> list[int]:
    """Trace indices with each group of equal timestamps sorted by the real run's first-token time."""
    order = []
    for _, group in itertools.groupby(range(len(lines)), key=lambda i: lines[i]["timestamp"]):
        order += sorted(group, key=lambda i: real[i]["first_token_s"])
    return order


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True, help="a bench_fidelity.py --output directory")
    ap.add_argument("--k", type=int, default=1, help="which run of it")
    ap.add_argument("--trace", type=Path, required=True, help="the mooncake-format trace the run replayed")
    ap.add_argument("--length-scale", default="0.03125")
    ap.add_argument("--num-kv-blocks", default="256")
    ap.add_argument("--kv-host-gb", default="0.5")
    ap.add_argument("--control-latency-ms", type=float, required=True,
                    help="run k's served control latency (what bench_fidelity.py gave sim<k>_server)")
    ap.add_argument("--model", required=True, help="the config.json bench_fidelity.py simulated (its log names it)")
    args = ap.parse_args()
    real = requests(args.run / f"real{args.k}")
    lines = [json.loads(x) for x in args.trace.read_text().splitlines()][:len(real)]
    reordered = args.run / f"trace_real_order{args.k}.jsonl"
    reordered.write_text("".join(json.dumps(lines[i]) + "\n" for i in real_order(lines, real)))
    out = args.run / f"sim{args.k}_server_real_order"
    subprocess.run([sys.executable, "-m", "pdserve.cli", "simulate", "--workload", f"mooncake:{reordered}",
                    "--length-scale", args.length_scale, "--rate", "0.5", "--max-requests", str(len(real)),
                    "--seed", "0", "--model", args.model, "--gpu", "l40s", "--time-model",
                    f"fitted:{args.run / f'server_fit{args.k}.json'}", "--mode", "pd", "--prefill", "1",
                    "--decode", "1", "--block-size", "16", "--num-kv-blocks", args.num_kv_blocks,
                    "--prefill-budget", "2048", "--decode-budget", "2048", "--control-latency-ms",
                    str(args.control_latency_ms), "--delivery", "scheduled", "--kv-host-gb", args.kv_host_gb,
                    "--output", str(out), "--no-progress"], check=True, capture_output=True)
    for name, d in (("real", args.run / f"real{args.k}"), ("twin, trace order", args.run / f"sim{args.k}_server"),
                    ("twin, the real run's order", out)):
        p50, p90 = ttft(d)
        print(f"{name:<28} TTFT p50 {p50:7.0f} ms   p90 {p90:7.0f} ms")


if __name__ == "__main__":
    main()
