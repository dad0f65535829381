"""The shared KV pool in the simulator (issue 41): `pdserve simulate` on an H100 cluster replaying the Mooncake
conversation trace, with and without the pool (`--kv-remote-pool-gb`), the same trace, seed and flags otherwise.

    PDSERVE_TRACES=/work/shared/traces .venv/bin/python benchmarks/bench_sim_kv_pool.py [--requests 1200]

Each variant is one `pdserve simulate` (the command is printed) on 2 prefill + 1 decode engines routed least-loaded,
so a later turn often lands on the prefill engine that did not compute its history. Per variant:
* prefix hit ratio: 1 - prompt tokens the prefill engines computed / prompt tokens of the requests (stage passes
  count what they computed; a prompt they staged is then a device hit), and the pool's share of prompt tokens;
* TTFT p50 / p90 of later turns (a request whose leading hash_ids share more than block 0, the system prefix every
  request starts with, with an earlier request: as bench_kv_placement.py) and of first turns;
* the pool's counters and what each engine's tier code skipped (`remote.skipped_blocks`, `slow_probes`).
Writes bench_results/sim_kv_pool.json with the CPU (lscpu "Model name"), the commands and the date.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kv_tiers as kvt  # noqa: E402 - beside this script (CPU name, trace location)
from bench_kv_placement import later_turns  # noqa: E402 - the same "later turn"

# name -> the pool flags of that variant
VARIANTS = {"no pool": [], "pool 1 TiB": ["--kv-remote-pool-gb", "1024"],
            "pool 16 GiB": ["--kv-remote-pool-gb", "16"],
            "pool 1 TiB at 10 Gbit/s": ["--kv-remote-pool-gb", "1024", "--kv-remote-gbps", "10"]}


def command(args, out: Path, pool: list[str]) -> list[str]:
    return ["simulate", "--no-progress", "--workload", f"mooncake:{args.trace}", "--max-requests",
            str(args.requests), "--max-input-len", str(args.max_input_len), "--model", args.model, "--gpu", "h100",
            "--prefill", str(args.prefill), "--decode", str(args.decode), "--routing", "least-loaded",
            "--seed", "0", *pool, "--output", str(out)]


def summarize(res: dict, later: list[bool]) -> dict:
    run = res["runs"][0]
    sim, reqs = run["sim"], run["requests"]
    prefill = sim["kv"]["prefill"]
    computed = prefill["prompt_tokens"] - sum(prefill["hit_tokens"].values())
    prompts = sum(r["prompt_tokens"] for r in reqs)
    ttft = {"later": [], "first": []}
    for r, is_later in zip(reqs, later):
        if r["error"] is None and r["first_token_s"] is not None:
            ttft["later" if is_later else "first"].append(r["first_token_s"] - r["start_s"])
    remote = [e["kv_tiers"].get("remote") for e in sim["engines"]]
    return {"hit_ratio": 1 - computed / prompts, "pool_share": prefill["hit_tokens"].get("remote", 0) / prompts,
            "prefill_hit_tokens": prefill["hit_tokens"], "prompt_tokens": prompts,
            "ttft_ms": {k: {"n": len(v), "p50": _pct(v, 50), "p90": _pct(v, 90)} for k, v in ttft.items()},
            "errors": sum(r["error"] is not None for r in reqs), "staged_prompts": sim["lifecycle"]["staged_prompts"],
            "kv_pool": sim["kv_pool"],
            "skipped_blocks": sum(r["skipped_blocks"] for r in remote if r),
            "slow_probes": sum(r["slow_probes"] for r in remote if r), "sim_s": run["summary"].get("duration_s")}


def _pct(v: list[float], q: float) -> float | None:
    return float(np.percentile(v, q)) * 1e3 if v else None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--trace", default=str(kvt.TRACES / "mooncake_conversation_trace.jsonl"))
    p.add_argument("--requests", type=int, default=1200)
    p.add_argument("--max-input-len", type=int, default=16000)
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "bench_results" / "sim_kv_pool.json"))
    args = p.parse_args()
    from pdserve.sim.cli import main as pdserve_sim
    from pdserve.workloads import load_workload
    wl = load_workload(f"mooncake:{args.trace}", max_requests=args.requests, max_input_len=args.max_input_len)
    later = later_turns(wl)
    results = {}
    for name in args.variants.split(","):
        out = Path(args.out).with_suffix("") / name.replace(" ", "_").replace(",", "").replace("/", "")
        argv = command(args, out, VARIANTS[name])
        print("pdserve " + " ".join(argv), flush=True)
        with contextlib.redirect_stdout(io.StringIO()):
            if pdserve_sim(argv) != 0:
                raise SystemExit(f"{name}: pdserve simulate failed")
        results[name] = {"command": "pdserve " + " ".join(argv),
                         **summarize(json.loads((out / "result.json").read_text()), later)}
        _print_row(name, results[name])
    Path(args.out).write_text(json.dumps({"cpu": kvt.host_cpu(), "date": datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds"), "later_turns": sum(later), "requests": len(later),
        "results": results}, indent=1))
    print(f"wrote {args.out}")
    return 0


def _print_row(name: str, r: dict) -> None:
    t, pool = r["ttft_ms"], r["kv_pool"] or {}
    print(f"| {name} | {r['hit_ratio']:.1%} | {r['pool_share']:.1%} | {t['later']['p50']:.0f} / "
          f"{t['later']['p90']:.0f} | {t['first']['p50']:.0f} / {t['first']['p90']:.0f} | {r['staged_prompts']} | "
          f"{pool.get('fetched_blocks', '-')} | {pool.get('evicted_blocks', '-')} | {r['skipped_blocks']} | "
          f"{r['slow_probes']} | {r['errors']} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
