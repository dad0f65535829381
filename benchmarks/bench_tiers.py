"""Service tiers under overload: admission and tiered queues vs one FIFO queue (issue 13's benchmark).

    .venv/bin/python benchmarks/bench_tiers.py [--parts capacity,overload,sim] [--quick]
        [--in 256 --out 32] [--rates 0.25,0.5,1,1.5,2,3] [--slo-ttft-ms 1000 --slo-tpot-ms 150] [--sustained R]
        [--loads 2,3] [--duration-s 90] [--tier-mix priority=0.2,default=0.6,flex=0.2]
        [--service-tier NAME:ttft_ms=X,tpot_ms=Y[,share=Z] ...] [--server-args "--num-threads 2"] [--seed 2]
        [--sim-model llama-3-70b --sim-gpu h100 --sim-tp 8 --sim-prefill 1 --sim-decode 1]
        [--sim-workload fixed:2048,256] [--sim-rates 2,3,4,5,6,7,8,9,10] [--sim-sustained R]
        [--sim-service-tier ...] [--output bench_results/tiers]

    smoke run (~3 min on 2 cores):  .venv/bin/python benchmarks/bench_tiers.py --quick

Parts, run in this order (each server started alone, stopped before the next one starts):

capacity: the load one real server sustains. One `pdserve serve --mode colocated` (defaults otherwise, plus
  --server-args), one untimed warm-up request, then per rate of --rates (ascending) one `pdserve bench serve
  --workload fixed:IN,OUT --rate r --num-requests n` with n = r x --capacity-window-s (60 s of arrivals),
  at most --capacity-max-requests (120), at least 5; single class (no --tier-mix), SLO --slo-ttft-ms /
  --slo-tpot-ms (defaults 1000 / 150 ms: the priority tier's), seed --seed + i at the i-th rate (fresh
  prompts, no prefix hits between rates). R = bench's goodput rule (`pdserve.bench.metrics.goodput`): the
  highest rate whose attainment, and that of every lower rate, is >= 0.9; the sweep stops at the first miss.
  If even the lowest rate misses, the script stops (choose lower --rates or give --sustained); with --quick
  it goes on with the lowest rate and the summary says so. --sustained R skips this part (without it,
  --parts overload runs this part first).

overload: for each multiplier m of --loads, rate m x R, n = rate x --duration-s requests, each run on a fresh
  server (warm-up request first), all runs with the same --seed, so every configuration sees the same
  arrivals (Poisson), prompts and tier tags (`bench serve --tier-mix`, drawn from the seed; default seed 2:
  seed 0's first 29 tags hold no priority request, which would empty that row of a short run; a tier of the
  mix that drew no request still gets a row, of zeros). Configurations:
    tiered+admission      serve --service-tier (each tier) --admission predict
    tiered, no admission  serve --service-tier (each tier) --admission off
    fifo                  serve --queue-policy fcfs (no --service-tier: one FIFO class, no admission)
  Every bench run gets --tier-mix and the same --service-tier specs (default priority ttft_ms=1000,
  tpot_ms=150,share=0.25; default ttft_ms=2000,tpot_ms=300; flex ttft_ms=10000), so the requests carry their
  tier (the fifo server ignores it in its order) and bench judges each tier by the same SLOs in every config.
  The per-tier numbers are bench's own `per_tier` block of result.json.

sim: the same three configurations in `pdserve simulate` (--sim-model on --sim-gpu, --sim-tp per engine, PD
  with --sim-prefill + --sim-decode engines; roofline time model), workload --sim-workload (fixed:2048,256:
  the real workload's shape x 8), SLOs for an H100 (--sim-service-tier; default priority ttft_ms=500,
  tpot_ms=50,share=0.25; default ttft_ms=2000,tpot_ms=100; flex ttft_ms=10000). Capacity R_sim: one
  `simulate --rates --sim-rates --num-requests --sim-capacity-requests` sweep, single class, SLO
  --sim-slo-ttft-ms / --sim-slo-tpot-ms (500 / 50: the priority tier's); R_sim = its goodput_req_s (same rule;
  same fallback as above). Then m x R_sim for m in --loads, n = rate x --sim-duration-s, seed --seed:
    tiered+admission      --service-tier ... --tier-mix ... --admission predict
    tiered, no admission  --service-tier ... --tier-mix ... --admission off
    fifo                  --admission off, no --service-tier and no --tier-mix
  `pdserve simulate` has no --queue-policy; its engines use the tiered policy, under which a request tagged
  priority still goes first even with no --service-tier. So the fifo run sends no tags (every request in the
  default tier: the tiered policy with one tier is FCFS), and its per-tier rows are computed here from its
  result.json per-request records: each request i gets the tier `pdserve.bench.tier_mix.assign_tiers(n, mix,
  seed)` gives it (exactly the tags the other two runs sent), judged by the --sim-service-tier SLOs with
  `pdserve.bench.metrics.per_tier` (the function bench's `per_tier` comes from). The other two runs' rows
  are the simulator's own `per_tier`; the script checks that the tags they carry are those same tags.

Output: per config, load and tier (and "all": every request, each judged by its own tier's SLO): requests,
429s (refused by admission), errors, TTFT p50/p90, TPOT p50/p90 (ms, successful requests), the SLO, attainment
over all requests (429s and errors are misses), attainment over the accepted (non-429) ones, goodput (requests
meeting their SLO per second of the run). Printed as markdown, and written with the capacity sweeps, the host
CPU (/proc/cpuinfo "model name"), the flags and every command run to --output (default bench_results/tiers,
with --quick bench_results/tiers_quick) as summary.md and summary.json (rewritten after each part); each run's
result.json, plots and logs (bench.log, server.log, sim.log) under capacity/, overload/, sim/ there.

--quick: --in 64 --out 8, rates 0.5,1 over 10 s windows (<= 10 requests each), loads 2, duration 10 s;
sim: rates 4,8 x 60 requests, 10 s of arrivals.
Expected run time of the defaults on 2 cores: capacity ~8 min, overload ~20 min (a run without admission at
3R keeps the server busy ~3x --duration-s), sim ~3 min.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pdserve.bench.metrics import RequestRecord, goodput, latency_stats, meets_slo, per_tier, tier_slo  # noqa: E402
from pdserve.bench.tier_mix import assign_tiers, parse_tier_mix, tier_slos  # noqa: E402
from pdserve.core.service_tiers import SERVICE_TIERS  # noqa: E402
from serve_proc import PDSERVE, Server  # noqa: E402 - beside this script

CONFIGS = ("tiered+admission", "tiered, no admission", "fifo")
SLUG = {"tiered+admission": "tiered-admission", "tiered, no admission": "tiered-noadmission", "fifo": "fifo"}
SERVE_TIERS = {"priority": "ttft_ms=1000,tpot_ms=150,share=0.25", "default": "ttft_ms=2000,tpot_ms=300",
               "flex": "ttft_ms=10000"}
SIM_TIERS = {"priority": "ttft_ms=500,tpot_ms=50,share=0.25", "default": "ttft_ms=2000,tpot_ms=100",
             "flex": "ttft_ms=10000"}
# flag: (full run, --quick)
SIZES = {"in_len": (256, 64), "out_len": (32, 8), "rates": ("0.25,0.5,1,1.5,2,3", "0.5,1"),
         "capacity_window_s": (60.0, 10.0), "capacity_max_requests": (120, 10), "loads": ("2,3", "2"),
         "duration_s": (90.0, 10.0), "sim_rates": ("2,3,4,5,6,7,8,9,10", "4,8"),
         "sim_capacity_requests": (600, 60), "sim_duration_s": (90.0, 10.0)}


# ---------------------------------------------------------------------------------------------- helpers
def host_cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def shown(cmd: list[str]) -> str:
    """A command as a user would type it: `pdserve ...` for the module."""
    return shlex.join(["pdserve", *cmd[len(PDSERVE):]] if cmd[:len(PDSERVE)] == PDSERVE else cmd)


def floats(text: str) -> list[float]:
    return sorted(float(x) for x in text.split(",") if x.strip())


def tier_flags(defaults: dict[str, str], overrides: list[str]) -> list[str]:
    """--service-tier flags: the defaults, each tier replaced by an override `NAME:...` given for it."""
    specs = {n: f"{n}:{s}" for n, s in defaults.items()}
    for o in overrides:
        specs[o.split(":", 1)[0].strip()] = o
    return [x for s in specs.values() for x in ("--service-tier", s)]


class Ctx:
    """Where things go: the output dir, the commands run, the report (saved after each part)."""

    def __init__(self, out: Path, report: dict) -> None:
        self.out, self.report, self.commands = out, report, report["commands"]

    def run(self, cmd: list[str], log: Path) -> None:
        self.commands.append(shown(cmd))
        print(f"$ {shown(cmd)}", flush=True)
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            raise RuntimeError(f"command failed ({rc}), see {log}")


def start_server(ctx: Ctx, args: list[str], log: Path) -> Server:
    """`pdserve serve` (recorded among the commands run), warmed up with one short request."""
    server = Server(args, log)
    ctx.commands.append(shown(server.cmd))
    print(f"$ {shown(server.cmd)}", flush=True)
    server.warm_up()
    return server


def bench(ctx: Ctx, url: str, run_dir: Path, workload: str, rate: float, n: int, seed: int,
          extra: list[str]) -> dict:
    """One `pdserve bench serve` at one rate; returns result.json's run."""
    cmd = [*PDSERVE, "bench", "serve", "--endpoint", url, "--workload", workload, "--rate", f"{rate:.4g}",
           "--num-requests", str(n), "--seed", str(seed), "--output", str(run_dir), "--label", run_dir.name,
           "--no-progress", *extra]
    ctx.run(cmd, run_dir / "bench.log")
    return json.loads((run_dir / "result.json").read_text())["runs"][0]


def sustained_from(sweep: list[dict], quick: bool, what: str) -> tuple[float, str]:
    """(R, how it was found): bench's goodput rule over the sweep; the lowest rate under --quick if none met."""
    r = goodput({s["rate"]: s["attainment"] for s in sweep})
    if r is not None:
        return r, "goodput (attainment >= 0.9 at it and every lower rate)"
    if not quick:
        raise SystemExit(f"{what}: even the lowest rate misses 90% attainment; choose lower rates or give R")
    low = min(s["rate"] for s in sweep)
    print(f"{what}: no rate met 90% attainment; --quick goes on with the lowest, {low:g} req/s", flush=True)
    return low, "lowest swept rate (--quick; none met 90% attainment): NOT a sustained rate"


def sweep_row(rate: float, n: int, summary: dict) -> dict:
    return {"rate": rate, "num_requests": n, "num_ok": summary["num_ok"], "attainment": summary["slo"]["attainment"],
            "ttft_ms": summary["ttft_ms"], "tpot_ms": summary["tpot_ms"],
            "request_throughput": summary["request_throughput"]}


# ---------------------------------------------------------------------------------------------- capacity
def part_capacity(args, ctx: Ctx) -> dict:
    workload = f"fixed:{args.in_len},{args.out_len}"
    slo = ["--slo-ttft-ms", f"{args.slo_ttft_ms:g}", "--slo-tpot-ms", f"{args.slo_tpot_ms:g}"]
    print(f"\n[capacity] {workload}, SLO TTFT {args.slo_ttft_ms:g} ms / TPOT {args.slo_tpot_ms:g} ms", flush=True)
    server = start_server(ctx, ["--mode", "colocated", *args.server_args], ctx.out / "capacity" / "server.log")
    sweep: list[dict] = []
    try:
        for i, rate in enumerate(floats(args.rates)):
            n = max(5, min(args.capacity_max_requests, math.ceil(rate * args.capacity_window_s)))
            run = bench(ctx, server.url, ctx.out / "capacity" / f"rate-{rate:g}", workload, rate, n,
                        args.seed + i, slo)
            sweep.append(sweep_row(rate, n, run["summary"]))
            print(f"  rate {rate:g}: attainment {sweep[-1]['attainment']:.0%}", flush=True)
            if sweep[-1]["attainment"] < 0.9:
                break
    finally:
        server.stop()
    r, how = sustained_from(sweep, args.quick, "capacity")
    return {"workload": workload, "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
            "server_args": ["--mode", "colocated", *args.server_args], "sweep": sweep, "sustained_rps": r,
            "how": how}


# ---------------------------------------------------------------------------------------------- overload
def serve_config(config: str, args) -> list[str]:
    base = ["--mode", "colocated", *args.server_args]
    if config == "fifo":
        return [*base, "--queue-policy", "fcfs"]
    admission = "predict" if config == "tiered+admission" else "off"
    return [*base, *tier_flags(SERVE_TIERS, args.service_tier), "--admission", admission]


def part_overload(args, ctx: Ctx, r: float) -> list[dict]:
    specs = tier_flags(SERVE_TIERS, args.service_tier)
    slos = tier_slos(specs[1::2])
    workload = f"fixed:{args.in_len},{args.out_len}"
    rows = []
    for m in floats(args.loads):
        rate = m * r
        n = max(1, round(rate * args.duration_s))
        print(f"\n[overload] {m:g}x R = {rate:.4g} req/s, {n} requests ({args.duration_s:g} s)", flush=True)
        for config in CONFIGS:
            run_dir = ctx.out / "overload" / f"{m:g}x-{SLUG[config]}"
            server = start_server(ctx, serve_config(config, args), run_dir / "server.log")
            try:
                run = bench(ctx, server.url, run_dir, workload, rate, n, args.seed,
                            ["--tier-mix", args.tier_mix, *specs])
            finally:
                server.stop()
            rows += run_rows(config, m, rate, run, slos, None, parse_tier_mix(args.tier_mix))
    return rows


# ---------------------------------------------------------------------------------------------- per tier
def records_of(run: dict, tags: list[str] | None) -> list[RequestRecord]:
    recs = [RequestRecord(**r) for r in run["requests"]]
    if tags is not None:
        if len(tags) != len(recs):
            raise RuntimeError(f"{len(tags)} tier tags for {len(recs)} records")
        for rec, tag in zip(recs, tags):
            rec.service_tier = tag
    return recs


def all_tiers(recs: list[RequestRecord], slos: dict, duration_s: float) -> dict:
    """The per-tier summary's fields over every request, each judged by its own tier's SLO."""
    ok = [r for r in recs if r.ok]
    rejected = sum(r.rejected for r in recs)
    met = sum(meets_slo(r, *tier_slo(r.service_tier, slos, None, None)) for r in recs)
    accepted = len(recs) - rejected
    return {"num_requests": len(recs), "num_ok": len(ok), "num_rejected": rejected,
            "num_errors": len(recs) - len(ok) - rejected,
            "ttft_ms": latency_stats([v for r in ok if (v := r.ttft_s) is not None]),
            "tpot_ms": latency_stats([v for r in ok if (v := r.tpot_s) is not None]),
            "slo": {"ttft_ms": None, "tpot_ms": None, "attainment": met / len(recs) if recs else None,
                    "attainment_accepted": met / accepted if accepted else None},
            "goodput_rps": met / duration_s}


def no_requests(tier: str, slos: dict) -> dict:
    """A tier of the mix that drew no request in this run: a row of zeros, so its absence shows."""
    ttft, tpot = tier_slo(tier, slos, None, None)
    none = {"p50": None, "p90": None}
    return {"num_requests": 0, "num_rejected": 0, "num_errors": 0, "ttft_ms": none, "tpot_ms": none,
            "slo": {"ttft_ms": ttft, "tpot_ms": tpot, "attainment": None, "attainment_accepted": None},
            "goodput_rps": None}


def run_rows(config: str, load: float, rate: float, run: dict, slos: dict, tags: list[str] | None,
             mix: dict) -> list[dict]:
    """One row per tier of the mix (+ "all"): the run's own `per_tier`, or (with `tags`) recomputed from its
    records."""
    duration = run["summary"]["duration_s"]
    recs = records_of(run, tags)
    tiers = per_tier(recs, duration_s=duration, tier_slos=slos) if tags is not None else run["summary"]["per_tier"]
    tiers = {n: tiers.get(n) or no_requests(n, slos) for n in SERVICE_TIERS if n in tiers or n in mix}
    source = "recomputed from result.json records" if tags is not None else "result.json per_tier"
    rows = []
    for tier, t in [*tiers.items(), ("all", all_tiers(recs, slos, duration))]:
        rows.append({"config": config, "load": load, "rate": rate, "tier": tier, "requests": t["num_requests"],
                     "rejected_429": t["num_rejected"], "errors": t["num_errors"],
                     "ttft_p50_ms": t["ttft_ms"]["p50"], "ttft_p90_ms": t["ttft_ms"]["p90"],
                     "tpot_p50_ms": t["tpot_ms"]["p50"], "tpot_p90_ms": t["tpot_ms"]["p90"],
                     "slo_ttft_ms": t["slo"]["ttft_ms"], "slo_tpot_ms": t["slo"]["tpot_ms"],
                     "attainment": t["slo"]["attainment"], "attainment_accepted": t["slo"]["attainment_accepted"],
                     "goodput_rps": t["goodput_rps"], "duration_s": duration, "source": source})
    return rows


# ---------------------------------------------------------------------------------------------- sim
def simulate(ctx: Ctx, args, run_dir: Path, extra: list[str]) -> dict:
    cmd = [*PDSERVE, "simulate", "--model", args.sim_model, "--gpu", args.sim_gpu, "--tp", str(args.sim_tp),
           "--mode", "pd", "--prefill", str(args.sim_prefill), "--decode", str(args.sim_decode),
           "--workload", args.sim_workload, "--output", str(run_dir), "--label", run_dir.name, "--no-progress",
           *extra]
    ctx.run(cmd, run_dir / "sim.log")
    return json.loads((run_dir / "result.json").read_text())


def part_sim_capacity(args, ctx: Ctx) -> dict:
    print(f"\n[sim capacity] {args.sim_workload} on {args.sim_prefill}P{args.sim_decode}D x TP{args.sim_tp} "
          f"{args.sim_gpu}, SLO TTFT {args.sim_slo_ttft_ms:g} / TPOT {args.sim_slo_tpot_ms:g} ms", flush=True)
    res = simulate(ctx, args, ctx.out / "sim" / "capacity",
                   ["--rates", args.sim_rates, "--num-requests", str(args.sim_capacity_requests),
                    "--slo-ttft-ms", f"{args.sim_slo_ttft_ms:g}", "--slo-tpot-ms", f"{args.sim_slo_tpot_ms:g}",
                    "--seed", str(args.seed)])
    sweep = [sweep_row(run["rate"], args.sim_capacity_requests, run["summary"]) for run in res["runs"]]
    r, how = sustained_from(sweep, args.quick, "sim capacity")
    if res["goodput_req_s"] is not None and res["goodput_req_s"] != r:
        raise RuntimeError(f"simulate's goodput {res['goodput_req_s']} != {r}")
    return {"workload": args.sim_workload, "slo_ttft_ms": args.sim_slo_ttft_ms, "slo_tpot_ms": args.sim_slo_tpot_ms,
            "sweep": sweep, "sustained_rps": r, "how": how}


def sim_config(config: str, args, specs: list[str]) -> list[str]:
    if config == "fifo":
        return ["--admission", "off"]
    return [*specs, "--tier-mix", args.tier_mix, "--admission", "predict" if config == "tiered+admission" else "off"]


def part_sim(args, ctx: Ctx, r: float) -> list[dict]:
    specs = tier_flags(SIM_TIERS, args.sim_service_tier)
    slos = tier_slos(specs[1::2])
    mix = parse_tier_mix(args.tier_mix)
    rows = []
    for m in floats(args.loads):
        rate = m * r
        n = max(1, round(rate * args.sim_duration_s))
        print(f"\n[sim] {m:g}x R_sim = {rate:.4g} req/s, {n} requests ({args.sim_duration_s:g} s)", flush=True)
        for config in CONFIGS:
            res = simulate(ctx, args, ctx.out / "sim" / f"{m:g}x-{SLUG[config]}",
                           ["--rate", f"{rate:.4g}", "--num-requests", str(n), "--seed", str(args.seed),
                            *sim_config(config, args, specs)])
            tags = assign_tiers(n, mix, args.seed)
            if config != "fifo" and [q["service_tier"] for q in res["runs"][0]["requests"]] != tags:
                raise RuntimeError("the simulator's tier tags differ from assign_tiers'")  # fifo's rows rely on it
            rows += run_rows(config, m, rate, res["runs"][0], slos, tags if config == "fifo" else None, mix)
    return rows


# ---------------------------------------------------------------------------------------------- output
def _ms(v) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _pct(v) -> str:
    return "-" if v is None else f"{v:.0%}"


def rows_table(rows: list[dict]) -> list[str]:
    out = ["| config | load | req/s | tier | requests | 429 | errors | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 "
           "| SLO ttft/tpot ms | attained (all) | attained (accepted) | goodput req/s |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        slo = "own tier's" if r["tier"] == "all" else "/".join(_ms(r[k]) for k in ("slo_ttft_ms", "slo_tpot_ms"))
        out.append(f"| {r['config']} | {r['load']:g}x | {r['rate']:.3g} | {r['tier']} | {r['requests']} | "
                   f"{r['rejected_429']} | {r['errors']} | {_ms(r['ttft_p50_ms'])} | {_ms(r['ttft_p90_ms'])} | "
                   f"{_ms(r['tpot_p50_ms'])} | {_ms(r['tpot_p90_ms'])} | {slo} | {_pct(r['attainment'])} | "
                   f"{_pct(r['attainment_accepted'])} | "
                   f"{'-' if r['goodput_rps'] is None else format(r['goodput_rps'], '.2f')} |")
    return out


def capacity_lines(name: str, cap: dict) -> list[str]:
    out = [f"### {name}: {cap['workload']}, SLO TTFT {cap['slo_ttft_ms']:g} ms / TPOT {cap['slo_tpot_ms']:g} ms",
           "", "| req/s | requests | ok | attained | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in cap.get("sweep", []):
        out.append(f"| {s['rate']:g} | {s['num_requests']} | {s['num_ok']} | {_pct(s['attainment'])} | "
                   f"{_ms(s['ttft_ms']['p50'])} | {_ms(s['ttft_ms']['p90'])} | {_ms(s['tpot_ms']['p50'])} | "
                   f"{_ms(s['tpot_ms']['p90'])} |")
    return [*out, "", f"R = **{cap['sustained_rps']:g} req/s** ({cap['how']})", ""]


def render(rep: dict) -> str:
    lines = [f"# Service tiers under overload ({rep['date']})", "",
             f"host: {rep['host_cpu']}, {rep['cores']} cores; command: `{rep['command']}`", "",
             "Latencies in ms (successful requests); 429 = refused by admission; attained = share meeting the "
             "tier's SLO (429s and errors are misses); accepted = of the non-429 ones; goodput = requests meeting "
             "their SLO per second of the run; tier `all` = every request, each judged by its own tier's SLO.", ""]
    for key, name in (("capacity", "Capacity (real server)"), ("sim_capacity", "Capacity (simulator)")):
        if key in rep:
            lines += capacity_lines(name, rep[key])
    for key, name in (("overload", "Overload, real server (colocated)"), ("sim", "Overload, simulator")):
        if rep.get(key):
            lines += [f"### {name}", "", *rows_table(rep[key]), ""]
    if rep.get("sim"):
        lines += ["sim fifo rows: per-tier numbers recomputed from result.json records (the run sends no tags).", ""]
    return "\n".join([*lines, "### Commands", "", "```", *rep["commands"], "```", ""])


def save(ctx: Ctx) -> str:
    ctx.out.mkdir(parents=True, exist_ok=True)
    (ctx.out / "summary.json").write_text(json.dumps(ctx.report, indent=1))
    md = render(ctx.report)
    (ctx.out / "summary.md").write_text(md)
    return md


# ---------------------------------------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="capacity,overload,sim")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny sizes")
    ap.add_argument("--in", dest="in_len", type=int, default=None, help="prompt tokens (256; --quick 64)")
    ap.add_argument("--out", dest="out_len", type=int, default=None, help="output tokens (32; --quick 8)")
    ap.add_argument("--rates", default=None, help="capacity sweep, req/s")
    ap.add_argument("--capacity-window-s", type=float, default=None, help="seconds of arrivals per capacity rate")
    ap.add_argument("--capacity-max-requests", type=int, default=None)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=150.0)
    ap.add_argument("--sustained", type=float, default=None, help="R in req/s: skip the capacity part")
    ap.add_argument("--loads", default=None, help="multipliers of R (2,3; --quick 2)")
    ap.add_argument("--duration-s", type=float, default=None, help="seconds of arrivals per overload run")
    ap.add_argument("--tier-mix", default="priority=0.2,default=0.6,flex=0.2")
    ap.add_argument("--service-tier", action="append", default=[], help="replaces that tier's default spec")
    ap.add_argument("--server-args", default="", help="more `pdserve serve` flags, one string")
    ap.add_argument("--seed", type=int, default=2, help="arrivals, prompts, tier tags (2: see the docstring)")
    ap.add_argument("--sim-model", default="llama-3-70b")
    ap.add_argument("--sim-gpu", default="h100")
    ap.add_argument("--sim-tp", type=int, default=8)
    ap.add_argument("--sim-prefill", type=int, default=1)
    ap.add_argument("--sim-decode", type=int, default=1)
    ap.add_argument("--sim-workload", default="fixed:2048,256")
    ap.add_argument("--sim-rates", default=None)
    ap.add_argument("--sim-capacity-requests", type=int, default=None)
    ap.add_argument("--sim-duration-s", type=float, default=None)
    ap.add_argument("--sim-slo-ttft-ms", type=float, default=500.0)
    ap.add_argument("--sim-slo-tpot-ms", type=float, default=50.0)
    ap.add_argument("--sim-sustained", type=float, default=None, help="R_sim in req/s: skip the sim sweep")
    ap.add_argument("--sim-service-tier", action="append", default=[], help="replaces that tier's default spec")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    for name, (full, quick) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.server_args = shlex.split(args.server_args)
    parse_tier_mix(args.tier_mix)  # a bad spec fails before any work
    tier_slos(tier_flags(SERVE_TIERS, args.service_tier)[1::2])
    tier_slos(tier_flags(SIM_TIERS, args.sim_service_tier)[1::2])
    return args


def main() -> int:
    args = parse_args()
    parts = set(args.parts.split(","))
    if parts - {"capacity", "overload", "sim"}:
        raise SystemExit(f"unknown parts {sorted(parts - {'capacity', 'overload', 'sim'})}")
    out = Path(args.output or ROOT / "bench_results" / ("tiers_quick" if args.quick else "tiers"))
    ctx = Ctx(out, {"host_cpu": host_cpu(), "cores": os.cpu_count(),
                    "date": datetime.datetime.now().isoformat(timespec="seconds"),
                    "command": shlex.join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
                    "flags": vars(args), "commands": []})
    t0 = time.monotonic()
    print(f"host: {ctx.report['host_cpu']}, {os.cpu_count()} cores", flush=True)
    if parts & {"capacity", "overload"}:
        if args.sustained is None:
            ctx.report["capacity"] = part_capacity(args, ctx)
            save(ctx)
        r = args.sustained if args.sustained is not None else ctx.report["capacity"]["sustained_rps"]
        if "overload" in parts:
            ctx.report["overload"] = part_overload(args, ctx, r)
            save(ctx)
    if "sim" in parts:
        if args.sim_sustained is None:
            ctx.report["sim_capacity"] = part_sim_capacity(args, ctx)
            save(ctx)
        r = args.sim_sustained if args.sim_sustained is not None else ctx.report["sim_capacity"]["sustained_rps"]
        ctx.report["sim"] = part_sim(args, ctx, r)
    ctx.report["wall_s"] = round(time.monotonic() - t0, 1)
    print("\n" + save(ctx))
    print(f"wall {ctx.report['wall_s']} s; wrote {out / 'summary.md'} and {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
