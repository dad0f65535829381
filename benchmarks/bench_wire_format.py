"""The KV format per class on the wire (issue 39 item 4): `--kv-wire-dtype pool` vs `auto` (vs a fixed codec).

    .venv/bin/python benchmarks/bench_wire_format.py --part sim   [--link-gbps 4] [--max-requests 200]
    .venv/bin/python benchmarks/bench_wire_format.py --part serve [--serve-link-gbps 0.05]

`--part sim` runs `pdserve simulate` once per `--modes` entry on the same workload (the Mooncake conversation
trace, llama-3-8b on H100s, 2P+2D, KV links of `--link-gbps`, tier mix priority 0.2 / default 0.5 / flex 0.3)
and prints TTFT per tier (p50/p99), the KV bytes sent on the links (`sim.transfer.bytes_sent`), the schedule
predictability and the wasted-transfer rate.

`--part serve` starts the real `pdserve serve` (1 prefill + 1 decode worker, the default model, the link
throttled to `--serve-link-gbps`, `--link-share priority=0.8,default=0.1,flex=0.1`) once per `--serve-modes`
entry and sends the same requests to each: `--flex` flex prompts at once (~256 tokens each, windows of the GPL
text), then 1 s later `--priority` priority prompts; greedy, `--max-tokens` tokens, top-5 logprobs. Prints TTFT
per tier, `pdserve_kv_wire_bytes_total{service_tier,format}`, and per tier the quality of each mode's answers
against the first mode's (`pool`: exact KV everywhere): the share of positions with the same greedy token, the
mean position of the first difference, the logprob of the exact run's token at each position where the two
contexts are still equal (teacher-forced up to the first difference: there both read the same tokens, only
the KV format differs), and the mean |logprob difference| of the chosen token on those positions. Also the
echo perplexity of each prompt (`echo`, `logprobs: 0`, `max_tokens: 0`), which is computed on the prefill
worker from exact KV: it cannot see the wire format (the table shows it equal across modes).
Writes `bench_results/wire_format.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from serve_proc import Server

TRACE = "/work/shared/traces/mooncake_conversation_trace.jsonl"
TEXT = Path(__file__).resolve().parents[2] / "shared" / "texts" / "gpl-3.0.txt"
TIERS = ("priority", "default", "flex")
WATCH = ("death", "restart", "lapse", "fallback", "recompute", "transfer_bytes", "fail", "timeout")  # kept per run


# ---- simulator -------------------------------------------------------------------------------------------------
def simulate(mode: str, args, out: Path) -> dict:
    cmd = [sys.executable, __file__, "_tally", str(out / "wire_tally.json"), "simulate", "--workload", f"mooncake:{args.trace}",
           "--max-requests", str(args.max_requests), "--max-input-len", "7000", "--time-scale", str(args.time_scale),
           "--model", "llama-3-8b", "--gpu", "h100", "--prefill", "2", "--decode", "2",
           "--link-gbps", str(args.link_gbps), "--tier-mix", args.tier_mix, "--kv-wire-dtype", mode,
           "--no-progress", "--output", str(out)]
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    res = json.loads((out / "result.json").read_text())
    res["_wall_s"] = time.monotonic() - t0
    res["_wire_tally"] = json.loads((out / "wire_tally.json").read_text())
    return res


def tally_run(path: str, argv: list[str]) -> None:
    """`pdserve simulate argv` in this process, with the KV bytes it puts on the links tallied per service tier and
    format (`pdserve_kv_wire_bytes_total`'s breakdown; the simulator's report has only their sum): a measurement
    hook around `SimKVPath.push`, which adds each chunk's bytes to `life.bytes_sent`."""
    from collections import Counter

    from pdserve.cli import main as cli_main
    from pdserve.core.pd.wire_format import AUTO, COMPACT, POOL
    from pdserve.sim.kv_push import SimKVPath
    tally: Counter = Counter()
    orig = SimKVPath.push

    def push(self, p, f, end, duration_s):
        before = self.life.bytes_sent
        orig(self, p, f, end, duration_s)
        mode = self.wire.policy.mode
        fmt = "pool" if f.wire_ratio == 1.0 else f"{COMPACT if mode in (POOL, AUTO) else mode} (x{f.wire_ratio:.3f})"
        tally[f"{f.tier}:{fmt}"] += self.life.bytes_sent - before

    SimKVPath.push = push
    rc = cli_main(argv)
    Path(path).write_text(json.dumps(tally))
    sys.exit(rc)


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def report_sim(results: dict[str, dict]) -> None:
    print("wire | TTFT p50/p99 ms: priority, default, flex | KV bytes sent (GB) | vs first | predictable: all "
          "(priority, default, flex) | eff. link util | link busy s | wasted | wall s")
    base = None
    for mode, res in results.items():
        run = res["runs"][0]
        life, tiers = run["sim"]["lifecycle"], run["summary"].get("per_tier", {})
        ttft = ", ".join(f"{tiers[t]['ttft_ms']['p50']:.0f}/{tiers[t]['ttft_ms']['p99']:.0f}"
                         if t in tiers and tiers[t]["ttft_ms"]["p50"] is not None else "-" for t in TIERS)
        sent = run["sim"]["transfer"]["bytes_sent"]
        base = base or sent
        by_tier = life.get("schedule_predictability_by_tier") or {}
        tiers_p = ", ".join(_pct(by_tier.get(t)) for t in TIERS)
        print(f"{mode:5s} | {ttft} | {sent / 1e9:.2f} | {sent / base:.2f}x | {_pct(life['schedule_predictability'])}"
              f" ({tiers_p}) | {_pct(life['effective_link_utilization'])} | {life['link_busy_s']:.0f}"
              f" | {_pct(life['wasted_transfer_rate'])} | {res['_wall_s']:.0f}")
        print("   GB by tier:format:", ", ".join(f"{k} {v / 1e9:.2f}" for k, v in sorted(res["_wire_tally"].items())))


# ---- real server -----------------------------------------------------------------------------------------------
def prompts(n: int, chars: int = 1000) -> list[str]:
    text = TEXT.read_text()
    return [text[2000 + i * chars: 2000 + (i + 1) * chars] for i in range(n)]


def stream_one(url: str, model: str, prompt: str, tier: str, args, into: dict) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 5, "stream": True, "service_tier": tier}
    t0, tokens, lps, tops = time.monotonic(), [], [], []
    ttft = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            got = choice.get("logprobs") or {}
            if got.get("tokens"):
                ttft = ttft or time.monotonic() - t0
                tokens += got["tokens"]
                lps += got["token_logprobs"]
                tops += got["top_logprobs"]
    into.update(tier=tier, ttft_s=ttft, tokens=tokens, logprobs=lps, top=tops)


def echo_ppl(url: str, model: str, prompt: str) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    lps = r.json()["choices"][0]["logprobs"]["token_logprobs"][1:]
    return math.exp(-sum(lps) / len(lps))


def serve_run(mode: str, args, log: Path) -> dict:
    server = Server(["--kv-wire-dtype", mode, "--link-gbps", str(args.serve_link_gbps),
                     "--link-share", "priority=0.8,default=0.1,flex=0.1", *args.serve_args.split()], log)
    try:
        server.warm_up()
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        texts = prompts(args.flex + args.priority)
        results = [{} for _ in texts]
        threads = []
        for i, text in enumerate(texts):
            tier = "flex" if i < args.flex else "priority"
            if i == args.flex:
                time.sleep(1.0)
            th = threading.Thread(target=stream_one, args=(server.url, model, text, tier, args, results[i]))
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
        wire = {f"{dict(k)['service_tier']}:{dict(k)['format']}": v for (name, k), v in server.metrics().items()
                if name == "pdserve_kv_wire_bytes_total"}
        counted = {f"{name}{dict(k)}": v for (name, k), v in server.metrics().items()
                   if v and any(w in name for w in WATCH)}
        ppl = [echo_ppl(server.url, model, t) for t in texts]
        return {"requests": results, "wire_bytes": wire, "echo_ppl": ppl, "counted": counted}
    finally:
        server.stop()


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def compare(exact: dict, other: dict) -> dict:
    """`other`'s answer against `exact`'s (same prompt, greedy)."""
    a, b = exact["tokens"], other["tokens"]
    n = min(len(a), len(b))
    same = sum(x == y for x, y in zip(a, b))
    first = next((i for i in range(n) if a[i] != b[i]), n)
    forced = []  # logprob under `other` of exact's token, while the contexts are equal (up to the first difference)
    for i in range(min(first + 1, n)):
        forced.append(other["top"][i].get(a[i], float("nan")) if other["top"][i] else float("nan"))
    diffs = [abs(exact["logprobs"][i] - other["logprobs"][i]) for i in range(first)]
    return {"agree": same / max(n, 1), "first_diff": first, "n": n,
            "forced_lp": [x for x in forced if not math.isnan(x)], "forced_missing": sum(math.isnan(x) for x in forced),
            "exact_lp": exact["logprobs"][:first + 1], "lp_absdiff": diffs}


def report_serve(runs: dict[str, dict]) -> None:
    modes = list(runs)
    base = runs[modes[0]]
    print("mode | TTFT p50/max s: priority, flex | wire bytes (MB) by tier:format | echo ppl (mean over prompts)")
    for mode, run in runs.items():
        cells = []
        for tier in ("priority", "flex"):
            tt = [r["ttft_s"] for r in run["requests"] if r["tier"] == tier]
            cells.append(f"{_median(tt):.2f}/{max(tt):.2f}")
        wire = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in sorted(run["wire_bytes"].items()) if v)
        ppl = sum(run["echo_ppl"]) / len(run["echo_ppl"])
        print(f"{mode} | {', '.join(cells)} | {wire} | {ppl:.4f}")
        print("   counted:", run["counted"])
    print(f"quality vs {modes[0]} | tier | greedy agreement | first difference (mean pos) | identical answers | "
          "teacher-forced mean logprob of exact tokens (exact run / this run) | mean |dlogprob| before the difference | "
          "answers with a logprob moved > 1e-3")
    for mode in modes[1:]:
        for tier in ("priority", "flex"):
            rows = [compare(e, o) for e, o in zip(base["requests"], runs[mode]["requests"]) if e["tier"] == tier]
            agree = sum(r["agree"] for r in rows) / len(rows)
            first = sum(r["first_diff"] for r in rows) / len(rows)
            ident = sum(r["first_diff"] == r["n"] for r in rows)
            f_lp = [x for r in rows for x in r["forced_lp"]]
            e_lp = [x for r in rows for x, _ in zip(r["exact_lp"], range(len(r["forced_lp"])))]
            dl = [x for r in rows for x in r["lp_absdiff"]]
            miss = sum(r["forced_missing"] for r in rows)
            moved = sum(max(r["lp_absdiff"], default=0.0) > 1e-3 for r in rows)  # beyond batch-order noise (~1e-5)
            print(f"{mode} | {tier} | {agree:.1%} | {first:.1f} | {ident}/{len(rows)} | "
                  f"{sum(e_lp) / max(len(e_lp), 1):.4f} / {sum(f_lp) / max(len(f_lp), 1):.4f} over {len(f_lp)} tokens"
                  f" ({miss} not in top 5) | {sum(dl) / max(len(dl), 1):.5f} | {moved}/{len(rows)}")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "_tally":
        tally_run(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="sim", choices=["sim", "serve"])
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--link-gbps", type=float, default=4.0)
    ap.add_argument("--max-requests", type=int, default=200)
    ap.add_argument("--time-scale", type=float, default=0.3)
    ap.add_argument("--tier-mix", default="priority=0.2,default=0.5,flex=0.3")
    ap.add_argument("--modes", default="pool,auto,int8")
    ap.add_argument("--serve-link-gbps", type=float, default=0.05)
    ap.add_argument("--serve-modes", default="pool,auto")
    ap.add_argument("--serve-args", default="", help="more `pdserve serve` flags")
    ap.add_argument("--flex", type=int, default=6)
    ap.add_argument("--priority", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("bench_results/wire_format.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.part == "sim":
            results = {m: simulate(m, args, Path(tmp) / m) for m in args.modes.split(",")}
            report_sim(results)
        else:
            results = {m: serve_run(m, args, args.out.parent / f"wire_format_{m}.log") for m in args.serve_modes.split(",")}
            report_serve(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
