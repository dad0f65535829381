"""Scheduled vs FIFO KV delivery with the KV links made the bottleneck (issue 14 (a) and (b)).

    .venv/bin/python benchmarks/bench_delivery.py --part sim [--link-gbps 10] [--max-requests 600] [--rates 1,2,3]
    .venv/bin/python benchmarks/bench_delivery.py --part serve [--serve-link-gbps 0.032] [--transports shm,tcp]

`--part sim` runs `pdserve simulate` once per `--modes` entry in one invocation (default: `--delivery scheduled`,
the same with `--decode-cadence steady`, and `--delivery fifo`, today's baseline), on the same workload: the Mooncake conversation trace (first N requests, prompts clipped to 8,000 tokens: llama-3-8b's
context), llama-3-8b on H100s, 2 prefill + 2 decode engines, KV links of `--link-gbps` per engine (the
H100 preset's is 400), tier mix priority 0.2 / default 0.6 / flex 0.2 (`--tier-mix`, `none`: untagged). Prints the four lifecycle metrics
(schedule predictability, effective link utilization, P99 inter-token jitter, wasted-transfer rate), TTFT
per tier and goodput (highest rate with >= 90% of requests within --slo-ttft-ms / --slo-tpot-ms).

`--part serve` starts the real `pdserve serve` (1 prefill + 1 decode worker, SmolLM2-135M) once per transport
and mode, one after another, each link throttled to `--serve-link-gbps`, and replays the Azure 2023
conversation trace on it with `pdserve bench serve` (first 40 requests, lengths x 0.3, inputs <= 1,024,
outputs <= 32, 1 req/s, the same tier mix): long prompts interfere with short ones on the link. Prints the
four lifecycle metrics as `bench serve` measured them from /metrics, TTFT and TPOT per tier.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

TRACE = "/work/shared/traces/mooncake_conversation_trace.jsonl"
AZURE = "/work/shared/traces/AzureLLMInferenceTrace_conv_2023.csv"
TIER_MIX = "priority=0.2,default=0.6,flex=0.2"


def _mode(mode: str) -> tuple[str, str]:
    """"scheduled+steady" -> ("scheduled", "steady"): the delivery order and the decode cadence."""
    delivery, _, cadence = mode.partition("+")
    return delivery, cadence or "off"


def simulate(mode: str, args, out: Path) -> dict:
    delivery, cadence = _mode(mode)
    cmd = [sys.executable, "-m", "pdserve.cli", "simulate", "--workload", f"mooncake:{args.trace}",
           "--max-requests", str(args.max_requests), "--max-input-len", "8000", "--max-output-len", "190",
           "--model", "llama-3-8b", "--gpu", "h100", "--prefill", "2", "--decode", "2",
           "--link-gbps", str(args.link_gbps), "--delivery", delivery, "--decode-cadence", cadence,
           *(["--tier-mix", args.tier_mix] if args.tier_mix != "none" else []), "--rates", args.rates, "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms),
           "--no-progress", "--output", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "result.json").read_text())


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def report(results: dict[str, dict]) -> None:
    print("delivery   rate | predictable (final / at prefilled / at dispatch) | eff. link util | jitter p99 ms | wasted | "
          "TTFT p50/p99 ms: priority, default, flex | TPOT mean/p99 ms | SLO attained")
    for delivery, res in results.items():
        for run in res["runs"]:
            life, summary = run["sim"]["lifecycle"], run["summary"]
            tiers = summary.get("per_tier", {})
            ttft = ", ".join(f"{tiers[t]['ttft_ms']['p50']:.0f}/{tiers[t]['ttft_ms']['p99']:.0f}"
                             if t in tiers and tiers[t]["ttft_ms"]["p50"] is not None else "-"
                             for t in ("priority", "default", "flex"))
            jitter = life["p99_inter_token_jitter_ms"]
            tpot = summary["tpot_ms"]
            print(f"{delivery:16s} {run['rate']:5g} | {_pct(life['schedule_predictability'])} / "
                  f"{_pct(life.get('schedule_predictability_at_prefilled'))} / "
                  f"{_pct(life['schedule_predictability_at_dispatch'])} | {_pct(life['effective_link_utilization'])} | "
                  f"{'-' if jitter is None else f'{jitter:.2f}'} | {_pct(life['wasted_transfer_rate'])} | {ttft} | "
                  f"{tpot['mean']:.2f}/{tpot['p99']:.2f} | {_pct(summary['slo']['attainment'])}")
        print(f"{delivery:16s} goodput: {res.get('goodput_req_s') or '-'} req/s")


def serve_run(transport: str, mode: str, args, out: Path) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from serve_util import Server
    delivery, cadence = _mode(mode)
    server = Server("--transport", transport, "--delivery", delivery, "--decode-cadence", cadence,
                    "--link-gbps", str(args.serve_link_gbps))
    try:
        subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "serve", "--endpoint", server.url,
                        "--workload", f"azure:{args.azure}", "--max-requests", "40", "--length-scale", "0.3",
                        "--max-input-len", "1024", "--max-output-len", "32", "--rate", "1",
                        *(["--tier-mix", args.tier_mix] if args.tier_mix != "none" else []),
                        "--no-progress", "--output", str(out)], check=True, stdout=subprocess.DEVNULL)
    finally:
        server.stop()
    return json.loads((out / "result.json").read_text())


def report_serve(results: dict[tuple[str, str], dict]) -> None:
    print("transport delivery | predictable (final / at prefilled / at dispatch) | eff. link util | jitter p99 ms | wasted | "
          "TTFT p50/p99 ms: priority, default, flex | TPOT p50/p99 ms: priority, default, flex | errors")
    for (transport, delivery), res in results.items():
        run = res["runs"][0]
        kv, summary = run["kv"], run["summary"]
        tiers = summary.get("per_tier", {})

        def cell(metric: str) -> str:
            return ", ".join(f"{tiers[t][metric]['p50']:.0f}/{tiers[t][metric]['p99']:.0f}"
                             if t in tiers and tiers[t][metric]["p50"] is not None else "-"
                             for t in ("priority", "default", "flex"))
        eff = ", ".join(f"{v:.1%}" for v in kv["link_effective_utilization"].values()) or "-"
        jitter = kv["p99_inter_token_jitter_ms"]
        print(f"{transport:9s} {delivery:16s} | {_pct(kv['schedule_predictability'])} / "
              f"{_pct(kv.get('schedule_predictability_at_prefilled'))} / "
              f"{_pct(kv['schedule_predictability_at_dispatch'])} | {eff} | "
              f"{'-' if jitter is None else f'{jitter:.1f}'} | {_pct(kv['wasted_rate'])} | {cell('ttft_ms')} | "
              f"{cell('tpot_ms')} | {summary['num_errors']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--link-gbps", type=float, default=10.0)
    ap.add_argument("--max-requests", type=int, default=600)
    ap.add_argument("--rates", default="1,2,3", help="trace time scaled to these mean rates (req/s)")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    ap.add_argument("--part", default="sim", choices=["sim", "serve"])
    ap.add_argument("--tier-mix", default=TIER_MIX, help="service tier mix of the requests, or none")
    ap.add_argument("--azure", default=AZURE)
    ap.add_argument("--serve-link-gbps", type=float, default=0.032)
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--modes", default="scheduled,scheduled+steady,fifo",
                    help="delivery order [+ decode cadence] of each run, side by side")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.part == "sim":
            report({m: simulate(m, args, Path(tmp) / m) for m in args.modes.split(",")})
            return
        results = {}
        for transport in args.transports.split(","):
            for mode in args.modes.split(","):
                results[transport, mode] = serve_run(transport, mode, args, Path(tmp) / f"{transport}-{mode}")
        report_serve(results)


if __name__ == "__main__":
    main()
