"""Scheduled vs FIFO KV delivery in the simulator, with the KV links made the bottleneck (issue 14 (a)).

    .venv/bin/python benchmarks/bench_delivery.py [--link-gbps 10] [--max-requests 600] [--rates 1,2,3]

Runs `pdserve simulate` twice in one invocation, `--delivery scheduled` and `--delivery fifo`, on the same
workload: the Mooncake conversation trace (first N requests, prompts clipped to 8,000 tokens: llama-3-8b's
context), llama-3-8b on H100s, 2 prefill + 2 decode engines, KV links of `--link-gbps` per engine (the
H100 preset's is 400), tier mix priority 0.2 / default 0.6 / flex 0.2. Prints the four lifecycle metrics
(schedule predictability, effective link utilization, P99 inter-token jitter, wasted-transfer rate), TTFT
per tier and goodput (highest rate with >= 90% of requests within --slo-ttft-ms / --slo-tpot-ms).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

TRACE = "/work/shared/traces/mooncake_conversation_trace.jsonl"
TIERS = "priority=0.2,default=0.6,flex=0.2"


def simulate(delivery: str, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "pdserve.cli", "simulate", "--workload", f"mooncake:{args.trace}",
           "--max-requests", str(args.max_requests), "--max-input-len", "8000", "--max-output-len", "190",
           "--model", "llama-3-8b", "--gpu", "h100", "--prefill", "2", "--decode", "2",
           "--link-gbps", str(args.link_gbps), "--delivery", delivery, "--tier-mix", TIERS,
           "--rates", args.rates, "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms),
           "--no-progress", "--output", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "result.json").read_text())


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def report(results: dict[str, dict]) -> None:
    print("delivery   rate | predictable (final / at dispatch) | eff. link util | jitter p99 ms | wasted | "
          "TTFT p50/p99 ms: priority, default, flex | SLO attained")
    for delivery, res in results.items():
        for run in res["runs"]:
            life, summary = run["sim"]["lifecycle"], run["summary"]
            tiers = summary.get("per_tier", {})
            ttft = ", ".join(f"{tiers[t]['ttft_ms']['p50']:.0f}/{tiers[t]['ttft_ms']['p99']:.0f}"
                             if t in tiers and tiers[t]["ttft_ms"]["p50"] is not None else "-"
                             for t in ("priority", "default", "flex"))
            jitter = life["p99_inter_token_jitter_ms"]
            print(f"{delivery:9s} {run['rate']:5g} | {_pct(life['schedule_predictability'])} / "
                  f"{_pct(life['schedule_predictability_at_dispatch'])} | {_pct(life['effective_link_utilization'])} | "
                  f"{'-' if jitter is None else f'{jitter:.2f}'} | {_pct(life['wasted_transfer_rate'])} | {ttft} | "
                  f"{_pct(summary['slo']['attainment'])}")
        print(f"{delivery:9s} goodput: {res.get('goodput_req_s') or '-'} req/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--link-gbps", type=float, default=10.0)
    ap.add_argument("--max-requests", type=int, default=600)
    ap.add_argument("--rates", default="1,2,3", help="trace time scaled to these mean rates (req/s)")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {d: simulate(d, args, Path(tmp) / d) for d in ("scheduled", "fifo")}
    report(results)


if __name__ == "__main__":
    main()
