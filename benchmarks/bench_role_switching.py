"""Role switching in the simulator: a load that shifts from prompt-heavy to output-heavy half-way, on every fixed
P/D split of N engines and with `--role-switching auto` from each of them.

    .venv/bin/python benchmarks/bench_role_switching.py [--engines 4] [--rate 10] [--half-s 120]

Llama-3-8B on H100s (TP 1, roofline time model, no host tier, 64 sequences per engine). First half: 6,000-token
prompts, 40 output tokens; second half: 300-token prompts, 1,200 output tokens; `--rate` requests/s
throughout. Per run: requests whose TTFT <= `--slo-ttft-ms` and TPOT <= `--slo-tpot-ms` (attainment),
goodput = those per second of the run, TTFT p50/p90, and the moves the planner made. The SLO is given to every
run as the default tier's (`--service-tier default:ttft_ms=..,tpot_ms=..`) with admission off, so nothing is
refused and the planner sizes a decode engine by the batch whose step meets the TPOT. Writes
bench_results/role_switching.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdserve.bench.metrics import summarize
from pdserve.sim.cluster import ClusterSpec, simulate
from pdserve.sim.hardware import get_gpu, get_model
from pdserve.sim.timemodel import RooflineTimeModel
from pdserve.workloads import RequestSpec, Workload


def shifting(rate: float, half_s: float) -> Workload:
    n = int(2 * half_s * rate)
    return Workload([RequestSpec(i / rate, 6000 if i / rate < half_s else 300, 40 if i / rate < half_s else 1200,
                                 None) for i in range(n)], "shift")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--rate", type=float, default=10.0)
    ap.add_argument("--half-s", type=float, default=120.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    ap.add_argument("--role-switch-s", type=float, default=20.0)
    args = ap.parse_args()
    model, gpu = get_model("llama-3-8b"), get_gpu("h100")
    workload = shifting(args.rate, args.half_s)
    rows = []
    for switching in ("off", "auto"):
        for p in range(1, args.engines):
            # the SLO is the default tier's (the planner sizes decode at the batch that meets its TPOT), with
            # admission off: every request is served, as without tiers
            tier = f"default:ttft_ms={args.slo_ttft_ms:g},tpot_ms={args.slo_tpot_ms:g}"
            spec = ClusterSpec(mode="pd", num_prefill=p, num_decode=args.engines - p, host_kv_gb=0, max_num_seqs=64,
                               role_switching=switching, role_switch_s=args.role_switch_s,
                               service_tiers=(tier,), admission="off")
            run = simulate(workload, spec, model, gpu, RooflineTimeModel(model, gpu, 1))
            s = summarize(run.records, duration_s=run.duration_s, slo_ttft_ms=args.slo_ttft_ms,
                          slo_tpot_ms=args.slo_tpot_ms)
            met = (s["slo"]["attainment"] or 0.0) * s["num_requests"]  # (attainment is over every request)
            rows.append({"start": f"{p}P{args.engines - p}D", "role_switching": switching,
                         "attainment": s["slo"]["attainment"], "goodput_rps": met / run.duration_s,
                         "duration_s": run.duration_s, "ttft_p50_ms": s["ttft_ms"]["p50"],
                         "ttft_p90_ms": s["ttft_ms"]["p90"], "moves": run.role_switches})
            r = rows[-1]
            print(f"{r['start']:>5} {switching:>4}  attainment {r['attainment']:.1%}  goodput {r['goodput_rps']:.2f}/s  "
                  f"run {r['duration_s']:.0f} s  TTFT p50 {r['ttft_p50_ms'] / 1e3:.2f} s p90 "
                  f"{r['ttft_p90_ms'] / 1e3:.2f} s  moves " + ", ".join(
                      f"{m['left']}->{m['joined']}@{m['at_s']:.0f}s" for m in r["moves"]), flush=True)
    out = Path("bench_results")
    out.mkdir(exist_ok=True)
    (out / "role_switching.json").write_text(json.dumps({"args": vars(args), "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
