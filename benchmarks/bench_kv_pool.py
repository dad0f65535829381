"""The shared KV pool (`--kv-remote`, issue 41) on the running system: the Mooncake conversation trace replayed on
2 prefill + 1 decode workers routed least-loaded (so a conversation's later turns land on either prefill worker),
with and without the pool, one server after the other, same trace, same flags otherwise.

    .venv/bin/python benchmarks/bench_kv_pool.py [--window 600] [--length-scale 0.015625] [--time-scale 1]
        [--device-fraction 0.25] [--host-fraction 0.5] [--pool-gb 1] [--quick]

The trace selection and replay are `bench_kv_tiers.py`'s (its docstring: `--select conversations`, later turns
and the requests they extend, replayed open loop with `pdserve bench serve --workload mooncake:FILE`). Each
worker gets the same device pool (`--num-kv-blocks` = --device-fraction x the replay's distinct 16-token
blocks) and host tier (--host-fraction x); the pool run adds `--kv-remote local --kv-remote-pool-gb`.
Reported per config: prefix-hit tokens by tier summed over the prefill workers, as a share of the replay's
prompt tokens (the cross-worker effect is the `remote` share), the prefix hit ratio (1 - prompt tokens the
prefill workers computed / the replay's), TTFT p50/p90 of later turns and of all requests, errors; and the ratios
own-tiers / pool. Writes bench_results/kv_pool.json (with --quick: kv_pool_quick.json)
with the CPU model and the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_kv_tiers import (BLOCK, gb_for, host_cpu, replay, replay_facts, select_trace,  # noqa: E402
                            write_trace)


def hit_shares(run: dict, prompt_tokens: int) -> dict[str, float]:
    """Over the prefill workers: the prefix hit ratio, 1 - prompt tokens they computed (looked up minus hit; a
    staged prompt is looked up twice, its second time a hit) / the replay's prompt tokens, and each tier's hit
    tokens as a share of the replay's prompt tokens."""
    out: dict[str, float] = {}
    computed = 0.0
    for name, w in run["workers"].items():
        if name.startswith("prefill"):
            computed += w["query_tokens"] - sum(w["hit_tokens"].values())
            for tier, n in w["hit_tokens"].items():
                out[tier] = out.get(tier, 0.0) + n / prompt_tokens
    return {"hit_ratio": 1 - computed / prompt_tokens, **out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=600)
    ap.add_argument("--select", default="conversations")
    ap.add_argument("--singles-every", type=int, default=0)
    ap.add_argument("--length-scale", type=float, default=1 / 64)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--device-fraction", type=float, default=0.25)
    ap.add_argument("--host-fraction", type=float, default=0.5)
    ap.add_argument("--pool-gb", type=float, default=1.0)
    ap.add_argument("--quick", action="store_true", help="the first 250 requests at twice the speed")
    args = ap.parse_args()
    if args.quick:
        args.window, args.time_scale = 250, 2.0
    out = Path("bench_results") / ("kv_pool_quick" if args.quick else "kv_pool")
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "selected_trace.jsonl"
    write_trace(select_trace(args.window, args.select, args.singles_every), trace)
    facts = replay_facts(trace, args)
    device = max(int(args.device_fraction * facts["distinct_kv_blocks"]),
                 2 * -(-facts["longest_request_tokens"] // BLOCK))
    host_gb = gb_for(max(int(args.host_fraction * facts["distinct_kv_blocks"]),
                         device + -(-facts["longest_request_tokens"] // BLOCK)))
    base = ["--prefill", "2", "--decode", "1", "--num-threads", "1", "--routing", "least-loaded",
            "--num-kv-blocks", str(device), "--kv-host-gb", str(host_gb)]
    runs = {"own tiers": replay("pd", "own-tiers", base, trace, facts, args, out),
            "pool": replay("pd", "pool", [*base, "--kv-remote", "local", "--kv-remote-pool-gb", str(args.pool_gb)],
                           trace, facts, args, out)}
    report = {"cpu": host_cpu(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
              "workload": {k: v for k, v in facts.items() if k != "later"}, "device_blocks": device,
              "host_gb": host_gb, "pool_gb": args.pool_gb, "runs": runs,
              "hit_shares": {name: hit_shares(run, facts["prompt_tokens"]) for name, run in runs.items()}}
    ratios = {}
    for group in ("later", "all"):
        for q in ("p50", "p90"):
            a, b = runs["own tiers"]["ttft_s"][group][q], runs["pool"]["ttft_s"][group][q]
            ratios[f"{group}_{q}"] = a / b if a and b else None
    report["ttft_ratio_own_over_pool"] = ratios
    path = Path("bench_results") / ("kv_pool_quick.json" if args.quick else "kv_pool.json")
    path.write_text(json.dumps(report, indent=2))
    print(f"\nCPU: {report['cpu']}; {facts['requests']} requests ({facts['later_turns']} later turns), device "
          f"{device} blocks and host {host_gb} GiB per worker, pool {args.pool_gb} GiB")
    for name, run in runs.items():
        t = run["ttft_s"]
        shares = ", ".join(f"{k} {v:.1%}" for k, v in sorted(report["hit_shares"][name].items()))
        print(f"{name:>9}: hits {shares}; TTFT later p50/p90 {t['later']['p50']:.3f}/{t['later']['p90']:.3f} s, "
              f"all p50/p90 {t['all']['p50']:.3f}/{t['all']['p90']:.3f} s; errors {run['errors']}")
    print("TTFT own tiers / pool:", {k: (round(v, 2) if v else None) for k, v in ratios.items()})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
