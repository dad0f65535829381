"""Idle prewarm: hot prefixes computed ahead on an idle prefill worker (issue 14, item 4).

    .venv/bin/python benchmarks/bench_idle_prewarm.py --part serve [--requests 160] [--rate 1.5] [--docs 4]
                                                      [--new-doc-every 12] [--transport shm]
    .venv/bin/python benchmarks/bench_idle_prewarm.py --part sim [--max-requests 600] [--rates 3,6]

Both parts compare `--idle-prewarm` with `--no-idle-prewarm`, one after the other in one invocation, on the
same requests.

`--part serve`: the real `pdserve serve` (2 prefill + 1 decode workers, SmolLM2-135M, prefix-affine
routing). The workload is generated here (a Mooncake-format JSONL in a temporary directory; the same file for
both runs): `--docs` documents are trending at any time and a new one replaces the oldest every
`--new-doc-every` requests; each request is one of the trending documents (512 tokens) plus 64 tokens of its
own, 16 output tokens, Poisson arrivals at `--rate` req/s. Prints TTFT p50/p90/p99, the prefill workers'
prefix-hit tokens and the warm passes (from /metrics).

`--part sim`: `pdserve simulate` on the Mooncake conversation and synthetic traces (prompts clipped to 8,000
tokens), llama-3-8b on H100s, 2 prefill + 2 decode engines. Prints TTFT p50/p90/p99 and warm passes per rate.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

TRACES = ("/work/shared/traces/mooncake_conversation_trace.jsonl", "/work/shared/traces/mooncake_synthetic_trace.jsonl")
MODES = ("--idle-prewarm", "--no-idle-prewarm")


def trending_docs(path: Path, args) -> None:
    """Each request: one of the `docs` trending documents (one 512-token hash block) + its own tail."""
    rng = random.Random(0)
    trending, next_doc, next_tail, t = list(range(args.docs)), args.docs, 10**6, 0.0
    with path.open("w") as f:
        for i in range(args.requests):
            if i and i % args.new_doc_every == 0:
                trending = trending[1:] + [next_doc]
                next_doc += 1
            t += rng.expovariate(args.rate)
            f.write(json.dumps({"timestamp": round(t * 1000), "input_length": 576, "output_length": 16,
                                "hash_ids": [rng.choice(trending), next_tail]}) + "\n")
            next_tail += 1


def serve_run(mode: str, args, workload: Path, out: Path) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from serve_util import Server
    server = Server("--prefill", "2", "--decode", "1", "--transport", args.transport, mode)
    try:
        subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "serve", "--endpoint", server.url,
                        "--workload", f"mooncake:{workload}", "--seed", "0", "--no-progress", "--output", str(out)],
                       check=True, stdout=subprocess.DEVNULL)
        hits = {w: server.metric("pdserve_prefix_cache_hit_tokens_total", worker=w) for w in ("prefill-0", "prefill-1")}
        warms = server.metric("pdserve_kv_idle_prewarms_total", outcome="done")
    finally:
        server.stop()
    res = json.loads((out / "result.json").read_text())
    return {"summary": res["runs"][0]["summary"], "hits": hits, "warms": warms}


def report_serve(results: dict) -> None:
    print("mode              | TTFT p50 / p90 / p99 ms | e2e p50 ms | prefill hit tokens (p0, p1) | warm passes | errors")
    for mode, r in results.items():
        s, t = r["summary"], r["summary"]["ttft_ms"]
        print(f"{mode:17s} | {t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f} | {s['e2e_ms']['p50']:.0f} | "
              f"{r['hits']['prefill-0']:.0f}, {r['hits']['prefill-1']:.0f} | {r['warms']:.0f} | {s['num_errors']}")


def simulate(mode: str, trace: str, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "pdserve.cli", "simulate", "--workload", f"mooncake:{trace}",
           "--max-requests", str(args.max_requests), "--max-input-len", "8000", "--max-output-len", "400",
           "--model", "llama-3-8b", "--gpu", "h100", "--prefill", "2", "--decode", "2", "--rates", args.rates,
           mode, "--no-progress", "--output", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "result.json").read_text())


def report_sim(trace: str, results: dict) -> None:
    print(Path(trace).name)
    print("mode              rate | TTFT p50 / p90 / p99 ms | warm passes | prefill busy")
    for mode, res in results.items():
        for run in res["runs"]:
            t, life = run["summary"]["ttft_ms"], run["sim"]["lifecycle"]
            busy = [e["busy_fraction"] for e in run["sim"]["engines"] if e["role"] == "prefill"]
            print(f"{mode:17s} {run['rate']:4g} | {t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f} | "
                  f"{life['idle_prewarms']} | {', '.join(f'{b:.0%}' for b in busy)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="serve", choices=["serve", "sim"])
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--rate", type=float, default=1.5)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--new-doc-every", type=int, default=12)
    ap.add_argument("--max-requests", type=int, default=600)
    ap.add_argument("--rates", default="3,6")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.part == "serve":
            workload = Path(tmp) / "trending_docs.jsonl"
            trending_docs(workload, args)
            report_serve({m: serve_run(m, args, workload, Path(tmp) / m) for m in MODES})
        else:
            for trace in TRACES:
                report_sim(trace, {m: simulate(m, trace, args, Path(tmp) / f"{Path(trace).stem}{m}") for m in MODES})


if __name__ == "__main__":
    main()
