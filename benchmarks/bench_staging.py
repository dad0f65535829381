"""Staging: prompts computed ahead on an idle prefill worker while the decode side has no room (issue 14).

    .venv/bin/python benchmarks/bench_staging.py --part serve [--workload fixed:256,128] [--requests 20] [--rate 0.5]
                                                 [--num-kv-blocks 64] [--kv-host-gb 0.5] [--transport shm]
    .venv/bin/python benchmarks/bench_staging.py --part sim [--max-requests 600] [--rates 2,4]

Both parts compare `--delivery scheduled` (staging on) with `--delivery fifo` (no staging: production starts
only once the decode worker has reserved blocks), one after the other in one invocation.

`--part serve`: the real `pdserve serve` (1 prefill + 1 decode worker, SmolLM2-135M), a KV pool of
`--num-kv-blocks` per worker (the decode worker holds a few requests at a time) and a host tier of
`--kv-host-gb`; `pdserve bench serve` sends `--workload` requests (distinct prompts) at `--rate` req/s: with
the defaults the decode worker holds two requests at a time and is the bottleneck, the prefill worker has
time to spare. Prints TTFT p50/p90, end-to-end p50, the run's length, prompts
staged and staged KV wasted (from /metrics).

`--part sim`: `pdserve simulate` on the Mooncake conversation trace (prompts clipped to 8,000 tokens),
llama-3-8b on H100s, 2 prefill + 1 decode engines with a decode KV pool of `--num-kv-blocks`: the decode
engine is the bottleneck. Prints TTFT p50/p90 and prompts staged per rate.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

TRACE = "/work/shared/traces/mooncake_conversation_trace.jsonl"


def serve_run(delivery: str, args, out: Path) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from serve_util import Server
    server = Server("--transport", args.transport, "--delivery", delivery, "--num-kv-blocks", str(args.num_kv_blocks),
                    "--kv-host-gb", str(args.kv_host_gb))
    try:
        subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "serve", "--endpoint", server.url,
                        "--workload", args.workload, "--num-requests", str(args.requests), "--rate", str(args.rate),
                        "--seed", "0", "--no-progress", "--output", str(out)], check=True, stdout=subprocess.DEVNULL)
        staged = server.metric("pdserve_kv_staged_total")
        wasted = {r: server.metric("pdserve_kv_wasted_bytes_total", reason=r) for r in ("stage_evicted", "stage_aborted")}
        hits = server.metric("pdserve_prefix_cache_hit_tokens_total", worker="prefill-0")
    finally:
        server.stop()
    res = json.loads((out / "result.json").read_text())
    return {"summary": res["runs"][0]["summary"], "staged": staged, "wasted": wasted, "prefill_hit_tokens": hits}


def report_serve(results: dict) -> None:
    print("delivery  | TTFT p50 / p90 ms | e2e p50 ms | run s | staged | prefill hit tokens | staged KV wasted MB "
          "(evicted, aborted) | errors")
    for delivery, r in results.items():
        s = r["summary"]
        print(f"{delivery:9s} | {s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p90']:.0f} | {s['e2e_ms']['p50']:.0f} | "
              f"{s['duration_s']:.1f} | {r['staged']:.0f} | {r['prefill_hit_tokens']:.0f} | "
              f"{r['wasted']['stage_evicted'] / 1e6:.1f}, {r['wasted']['stage_aborted'] / 1e6:.1f} | {s['num_errors']}")


def simulate(delivery: str, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "pdserve.cli", "simulate", "--workload", f"mooncake:{args.trace}",
           "--max-requests", str(args.max_requests), "--max-input-len", "8000", "--max-output-len", "400",
           "--model", "llama-3-8b", "--gpu", "h100", "--prefill", "2", "--decode", "1",
           "--num-kv-blocks", str(args.sim_kv_blocks), "--delivery", delivery, "--rates", args.rates,
           "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100",
           "--no-progress", "--output", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "result.json").read_text())


def report_sim(results: dict) -> None:
    print("delivery   rate | TTFT p50 / p90 ms | e2e p50 ms | staged | prefill busy | SLO attained")
    for delivery, res in results.items():
        for run in res["runs"]:
            s, life = run["summary"], run["sim"]["lifecycle"]
            busy = [e["busy_fraction"] for e in run["sim"]["engines"] if e["role"] == "prefill"]
            print(f"{delivery:9s} {run['rate']:5g} | {s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p90']:.0f} | "
                  f"{s['e2e_ms']['p50']:.0f} | {life['staged_prompts']} | "
                  f"{', '.join(f'{b:.0%}' for b in busy)} | {_pct(s['slo']['attainment'])}")


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="serve", choices=["serve", "sim"])
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--workload", default="fixed:256,128")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--rate", type=float, default=0.5)
    ap.add_argument("--num-kv-blocks", type=int, default=64)
    ap.add_argument("--kv-host-gb", type=float, default=0.5)
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--max-requests", type=int, default=600)
    ap.add_argument("--rates", default="2,4")
    ap.add_argument("--sim-kv-blocks", type=int, default=4000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.part == "serve":
            report_serve({d: serve_run(d, args, Path(tmp) / d) for d in ("scheduled", "fifo")})
        else:
            report_sim({d: simulate(d, args, Path(tmp) / d) for d in ("scheduled", "fifo")})


if __name__ == "__main__":
    main()
