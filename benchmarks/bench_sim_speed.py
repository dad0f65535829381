"""How much faster than real time the simulator replays the one-hour Mooncake conversation trace.

    .venv/bin/python benchmarks/bench_sim_speed.py [--block-size 16] [--tp 4] [--max-requests N]
        [--no-fast-forward] [--host-kv-gb G]

Setup: 12,031 requests (the whole trace, trace timestamps), llama-3-70b on H100s, 8 prefill + 8 decode
engines at TP 4 (64 GPUs; 70B bf16 weights are 141 GB, so TP 4 leaves ~130 GB of KV per engine), roofline
time model, prefix-affinity routing. Prints wall time, simulated span and the speedup.
"""

from __future__ import annotations

import argparse
import time

from pdserve.sim.cluster import ClusterSpec, simulate
from pdserve.sim.hardware import get_gpu, get_model
from pdserve.sim.timemodel import make_time_model
from pdserve.workloads import load_workload

TRACE = "/work/shared/traces/mooncake_conversation_trace.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--no-fast-forward", action="store_true")
    ap.add_argument("--host-kv-gb", type=float, default=None, help="host KV tier per engine (default: the "
                    "simulator's, ClusterSpec.host_kv_gb); 0 turns the tier (and its bookkeeping) off")
    args = ap.parse_args()
    t0 = time.perf_counter()
    wl = load_workload(f"mooncake:{TRACE}", max_requests=args.max_requests)
    model, gpu = get_model("llama-3-70b"), get_gpu("h100")
    spec = ClusterSpec(mode="pd", num_prefill=8, num_decode=8, tp=args.tp, block_size=args.block_size,
                       fast_forward=not args.no_fast_forward,
                       **({} if args.host_kv_gb is None else {"host_kv_gb": args.host_kv_gb}))
    run = simulate(wl, spec, model, gpu, make_time_model("roofline", model, gpu, args.tp))
    wall = time.perf_counter() - t0
    ok = sum(r.ok for r in run.records)
    steps = sum(e["steps"] for e in run.engines)
    ff = sum(e["fast_forward_steps"] for e in run.engines)
    print(f"{len(wl)} requests ({ok} ok), block size {args.block_size}, tp {args.tp}, fast-forward "
          f"{not args.no_fast_forward}: simulated {run.duration_s:.0f} s in {wall:.1f} s wall "
          f"(simulate() {run.wall_s:.1f} s) -> {run.duration_s / wall:.0f}x real time; "
          f"{steps} engine steps ({ff} fast-forwarded), {run.num_events} events")


if __name__ == "__main__":
    main()
