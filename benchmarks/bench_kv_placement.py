"""Stage-driven KV placement vs plain LRU write-through on a multi-turn workload (issue 39 items 2 and 3):
later-turn TTFT and the device hit ratio, both placements over the same workload in the same run.

    .venv/bin/python benchmarks/bench_kv_placement.py --parts sim[,sim-steady][,serve] [--quick]

sim: `pdserve.sim` on an H100 cluster (Qwen2.5-7B, roofline), the Mooncake conversation trace
  ($PDSERVE_TRACES), its first --sim-requests requests (prompts up to --sim-max-input tokens), service tiers
  drawn from --tier-mix, PD --sim-prefill P + --sim-decode D with a small device pool (--sim-blocks) over a
  host tier (--sim-host-gb) and a disk tier (--sim-disk-gb) per engine: the cluster is memory-bound, so what
  each tier keeps decides the hits. Each placement is one `simulate` of the same workload (same prompts, same
  tiers): `--kv-placement write-through` (copied down as produced, least recently used first, nothing moved up
  ahead) and `staged` (expected use from think time, class- and expectation-aware eviction, prefetch).
sim-steady: the same cluster (a --steady-host-gb host tier) on synthetic conversations whose think times are
  steady (`steady_workload`): where an expected use can be predicted.
serve: the real server (`pdserve serve`, the default model on this CPU, 1 prefill + 1 decode worker) with a host and a
  disk tier, replaying the conversations `benchmarks/bench_kv_tiers.py --select conversations` selects (later
  turns and the turns they extend, of the trace's first --window requests, lengths x --length-scale), each
  placement --serve-rounds times, one server at a time, alternating which goes first; hit ratios from /metrics
  deltas over each replay; medians over the rounds.

"Later turn": a request whose leading hash_ids share more than block 0 (the system prefix every request
starts with) with an earlier request (as bench_kv_tiers.py). Device hit ratio: prefix-hit tokens found on the
device / prompt tokens (prefill role in PD). Prints tables, writes bench_results/kv_placement[_quick].json
with the CPU (lscpu "Model name"), the flags and the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kv_tiers as kvt  # noqa: E402 - beside this script (trace selection, replay, CPU name)

PLACEMENTS = ("write-through", "staged")


def later_turns(wl) -> list[bool]:
    seen: set = set()
    out = []
    for req in wl.requests:
        out.append(kvt.leading_seen(list(req.hash_ids), seen) > 1)
        seen.update(req.hash_ids)
    return out


def sim_run(args, placement: str, wl, later: list[bool], mix, host_gb: float | None = None) -> dict:
    from pdserve.bench.tier_mix import workload_tiers
    from pdserve.sim.cluster import ClusterSpec, simulate
    from pdserve.sim.hardware import get_gpu, get_model
    from pdserve.sim.timemodel import RooflineTimeModel
    model, gpu = get_model(args.sim_model), get_gpu("h100")
    spec = ClusterSpec(mode="pd", num_prefill=args.sim_prefill, num_decode=args.sim_decode,
                       num_kv_blocks=args.sim_blocks, host_kv_gb=host_gb or args.sim_host_gb,
                       disk_kv_gb=args.sim_disk_gb,
                       kv_placement=placement, seed=0)
    tiers = workload_tiers(mix, len(wl), 0) if mix else None
    run = simulate(wl, spec, model, gpu, RooflineTimeModel(model, gpu, 1), tiers=tiers)
    ttft = {"later": [], "first": []}
    by_tier: dict[str, list] = {}
    for r, is_later in zip(run.records, later):
        if r.ok and r.first_token_s is not None:
            t = r.first_token_s - r.start_s
            ttft["later" if is_later else "first"].append(t)
            if is_later:
                by_tier.setdefault(r.service_tier or "default", []).append(t)
    roles: dict[str, dict] = {}
    prefetch = {"issued": 0, "used": 0, "wasted": 0}
    for e in run.engines:
        role = roles.setdefault(e["role"], {"prompt_tokens": 0, "hits": {}})
        role["prompt_tokens"] += e["prompt_tokens"]
        for tier, n in e["kv_tiers"]["hit_tokens"].items():
            role["hits"][tier] = role["hits"].get(tier, 0) + n
        for k in prefetch:
            prefetch[k] += e["kv_tiers"]["placement"]["prefetch"][k]
    for role in roles.values():
        role["hit_ratio"] = {t: n / role["prompt_tokens"] for t, n in role["hits"].items()}
    return {"ttft_s": {k: {"n": len(v), "p50": kvt.pct(v, 50), "p90": kvt.pct(v, 90)} for k, v in ttft.items()},
            "later_ttft_p50_by_tier": {k: kvt.pct(v, 50) for k, v in sorted(by_tier.items())},
            "errors": sum(not r.ok for r in run.records), "roles": roles, "prefetch": prefetch,
            "sim_s": run.duration_s, "wall_s": round(run.wall_s, 1)}


def part_sim(args) -> dict:
    from pdserve.bench.tier_mix import parse_tier_mix
    from pdserve.workloads import load_workload
    wl = load_workload(f"mooncake:{kvt.TRACE}", max_requests=args.sim_requests, max_input_len=args.sim_max_input)
    later = later_turns(wl)
    mix = parse_tier_mix(args.tier_mix) if args.tier_mix else None
    out = {"requests": len(wl.requests), "later_turns": sum(later), "flags": {
        k: v for k, v in vars(args).items() if k.startswith("sim_") or k == "tier_mix"}}
    for placement in PLACEMENTS:
        print(f"[sim] {placement} ...", flush=True)
        out[placement] = sim_run(args, placement, wl, later, mix)
    return out


def steady_workload(args):
    """Conversations whose think times are steady (where an expected use can be predicted): --steady-convs
    conversations of --steady-turns turns, starting uniformly over --steady-span-s; turn 1 is 4 hash blocks
    (2,048 tokens), each later turn adds 2 (1,024 tokens: the answer and the next question), --steady-think-s
    +-10% after the previous turn's arrival; 200 output tokens."""
    import numpy as np

    from pdserve.workloads import RequestSpec, Workload
    rng = np.random.default_rng(0)
    reqs = []
    for c in range(args.steady_convs):
        t, blocks = rng.uniform(0, args.steady_span_s), [10_000_000 + 1000 * c + k for k in range(4)]
        for _ in range(args.steady_turns):
            reqs.append(RequestSpec(float(t), 512 * len(blocks), 200, tuple(blocks)))
            t += args.steady_think_s * rng.uniform(0.9, 1.1)
            blocks = blocks + [blocks[-1] + 1, blocks[-1] + 2]
    return Workload(sorted(reqs, key=lambda r: r.arrival_s), "steady-conversations")


def part_sim_steady(args) -> dict:
    from pdserve.bench.tier_mix import parse_tier_mix
    wl = steady_workload(args)
    later = later_turns(wl)
    mix = parse_tier_mix(args.tier_mix) if args.tier_mix else None
    out = {"requests": len(wl.requests), "later_turns": sum(later), "flags": {
        k: v for k, v in vars(args).items() if k.startswith(("sim_", "steady_")) or k == "tier_mix"}}
    for placement in PLACEMENTS:
        print(f"[sim-steady] {placement} ...", flush=True)
        out[placement] = sim_run(args, placement, wl, later, mix, host_gb=args.steady_host_gb)
    return out


def part_serve(args, out_dir: Path) -> dict:
    """Each placement --serve-rounds times, alternating (the first round write-through first, the next staged
    first, ...), so a load that drifts on a shared host weighs on both alike; medians over the rounds."""
    records = kvt.select_trace(args.window, "conversations", args.singles_every)
    trace = out_dir / "selected_trace.jsonl"
    kvt.write_trace(records, trace)
    facts = kvt.replay_facts(trace, args)
    pool = max(int(facts["distinct_kv_blocks"] * args.device_fraction), 2 * facts["longest_request_tokens"] // 16)
    host = max(int(facts["distinct_kv_blocks"] * args.host_fraction), pool + facts["longest_request_tokens"] // 16)
    disk = int(facts["distinct_kv_blocks"] * args.disk_fraction)
    res = {"facts": {k: v for k, v in facts.items() if k != "later"}, "num_kv_blocks": pool,
           "host_blocks": host, "disk_blocks": disk}
    runs: dict[str, list] = {p: [] for p in PLACEMENTS}
    for i in range(args.serve_rounds):
        for placement in PLACEMENTS if i % 2 == 0 else PLACEMENTS[::-1]:
            with tempfile.TemporaryDirectory(prefix="kvp-disk-") as disk_dir:
                server_args = ["--num-kv-blocks", str(pool), "--kv-host-gb", str(kvt.gb_for(host)),
                               "--kv-disk-dir", disk_dir, "--kv-disk-gb", str(kvt.gb_for(disk)),
                               "--kv-placement", placement]
                runs[placement].append(kvt.replay("pd", f"{placement}-{i}", server_args, trace, facts, args,
                                                  out_dir))
    for placement, rs in runs.items():  # the prefill worker's hits: those shorten TTFT (the decode worker's, KV sent)
        ratios = [r["workers"]["prefill-0"]["hit_ratio_of_replay_prompt_tokens"] for r in rs]
        decode = [r["workers"]["decode-0"]["hit_ratio_of_replay_prompt_tokens"] for r in rs]
        res[placement] = {"rounds": rs, "median": {
            "later_ttft_p50_s": kvt.pct([r["ttft_s"]["later"]["p50"] for r in rs], 50),
            "later_ttft_p90_s": kvt.pct([r["ttft_s"]["later"]["p90"] for r in rs], 50),
            "all_ttft_p50_s": kvt.pct([r["ttft_s"]["all"]["p50"] for r in rs], 50),
            "hit_ratio": {t: kvt.pct([x.get(t, 0.0) for x in ratios], 50) for t in ("device", "host", "disk")},
            "decode_hit_ratio": {t: kvt.pct([x.get(t, 0.0) for x in decode], 50) for t in ("device", "host", "disk")},
            "errors": sum(r["errors"] for r in rs)}}
    return res


def print_tables(rep: dict) -> None:
    ms = kvt.ms
    for part in ("sim", "sim-steady"):
        if part not in rep:
            continue
        s = rep[part]
        print(f"\n{part}: {s['requests']} requests, {s['later_turns']} later turns")
        print("placement      | later TTFT p50 / p90 ms | first-turn TTFT p50 ms | device hits (prefill) | "
              "prefetch issued/used/wasted")
        for p in PLACEMENTS:
            r = s[p]
            hits = r["roles"].get("prefill", next(iter(r["roles"].values())))["hit_ratio"]
            print(f"{p:14} | {ms(r['ttft_s']['later']['p50'])} / {ms(r['ttft_s']['later']['p90'])} | "
                  f"{ms(r['ttft_s']['first']['p50'])} | {hits.get('device', 0):.1%} (host {hits.get('host', 0):.1%},"
                  f" disk {hits.get('disk', 0):.1%}) | {r['prefetch']['issued']}/{r['prefetch']['used']}/"
                  f"{r['prefetch']['wasted']} | later TTFT p50 by tier "
                  + ", ".join(f"{k} {ms(v)}" for k, v in r["later_ttft_p50_by_tier"].items()))
    if "serve" in rep:
        s = rep["serve"]
        print(f"\nreal server: {s['facts']['requests']} requests, {s['facts']['later_turns']} later turns")
        for p in PLACEMENTS:
            m = s[p]["median"]
            ratio = m["hit_ratio"]
            rounds = " ".join(f"{ms(r['ttft_s']['later']['p50'])}" for r in s[p]["rounds"])
            print(f"{p:14} | later TTFT p50 / p90 ms {ms(m['later_ttft_p50_s'])} / {ms(m['later_ttft_p90_s'])} "
                  f"(rounds' p50: {rounds}) | all p50 {ms(m['all_ttft_p50_s'])} | prefill device hits "
                  f"{ratio['device']:.1%} host {ratio['host']:.1%} disk {ratio['disk']:.1%} | decode device hits "
                  f"{m['decode_hit_ratio']['device']:.1%} | errors {m['errors']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="sim,serve")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sim-model", default="qwen2.5-7b")
    p.add_argument("--sim-requests", type=int, default=1200)
    p.add_argument("--sim-max-input", type=int, default=16000)
    p.add_argument("--sim-prefill", type=int, default=2)
    p.add_argument("--sim-decode", type=int, default=2)
    p.add_argument("--sim-blocks", type=int, default=6000)
    p.add_argument("--sim-host-gb", type=float, default=16.0)
    p.add_argument("--sim-disk-gb", type=float, default=64.0)
    p.add_argument("--tier-mix", default="priority=0.2,default=0.6,flex=0.2")
    p.add_argument("--steady-convs", type=int, default=240)
    p.add_argument("--steady-turns", type=int, default=6)
    p.add_argument("--steady-span-s", type=float, default=300.0)
    p.add_argument("--steady-think-s", type=float, default=30.0)
    p.add_argument("--steady-host-gb", type=float, default=4.0)
    p.add_argument("--window", type=int, default=600)
    p.add_argument("--singles-every", type=int, default=4)
    p.add_argument("--length-scale", type=float, default=1 / 64)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--device-fraction", type=float, default=0.25)
    p.add_argument("--host-fraction", type=float, default=0.5)
    p.add_argument("--disk-fraction", type=float, default=2.0)
    p.add_argument("--serve-rounds", type=int, default=2)
    args = p.parse_args()
    if args.quick:
        args.sim_requests, args.window, args.time_scale = 400, 250, 2.0
    name = "kv_placement_quick" if args.quick else "kv_placement"
    out_dir = kvt.ROOT / "bench_results" / name
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    path = kvt.ROOT / "bench_results" / f"{name}.json"
    rep = json.loads(path.read_text()) if path.is_file() else {}  # a part run alone keeps the others'
    rep.update({"cpu": kvt.host_cpu(), "date": datetime.date.today().isoformat()})
    if "sim" in parts:
        rep["sim"] = {**part_sim(args), "argv": sys.argv[1:]}
    if "sim-steady" in parts:
        rep["sim-steady"] = {**part_sim_steady(args), "argv": sys.argv[1:]}
    if "serve" in parts:
        rep["serve"] = {**part_serve(args, out_dir), "argv": sys.argv[1:]}
    print_tables(rep)
    path.write_text(json.dumps(rep, indent=1, default=str))
    print(f"\nwrote {path} (cpu: {rep['cpu']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
