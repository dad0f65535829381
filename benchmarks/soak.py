"""Soak: steady mixed load on a real `pdserve serve` for a while; the RSS of every process over time, and
errors (issue 15). Target: no error, RSS growth <= 5% after warm-up.

Load: `--clients` closed-loop clients, each sending one request after another: prompts of 8-600 tokens
(some sharing a prefix), 4-96 output tokens, greedy or seeded sampling, streaming or not, a few abandoned
mid-stream. RSS (psutil) of the gateway and each worker every `--sample-s`, with the KV blocks each worker's
tiers (device pool, host, disk) hold (/metrics); growth = last sample / the sample at the end of warm-up, per
process. Warm-up ends once the KV caches are full: at the first sample where every worker's tiers hold at least
99% of the blocks they hold at the end (a worker's RSS grows with its pools and host tier as they fill; what
grows after that is a leak); if that never happens, after the first `--warmup-frac` of the run.

    .venv/bin/python benchmarks/soak.py --minutes 30 [--clients 6] [--out bench_results/soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from serve_proc import Server  # noqa: E402

from pdserve.bench.server_proc import scrape_metrics  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
WORDS = "the quick brown fox jumps over a lazy dog while river boats drift past old mills".split()


def request_body(rng: random.Random) -> dict:
    shared = "System: you are a careful assistant. " * rng.choice((0, 8))
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 400)))
    body = {"model": MODEL, "prompt": shared + words, "max_tokens": rng.randint(4, 96), "ignore_eos": True,
            "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, seed=rng.randint(0, 1 << 30))
    return body


async def client_loop(url: str, rng: random.Random, until: float, errors: Counter, done: Counter) -> None:
    async with httpx.AsyncClient(timeout=300) as c:
        while time.monotonic() < until:
            body = request_body(rng)
            try:
                if body["stream"]:
                    async with c.stream("POST", url + "/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            errors[str(r.status_code)] += 1
                            continue
                        abandon = rng.random() < 0.05
                        async for line in r.aiter_lines():
                            if '"error"' in line:
                                errors["stream_error"] += 1
                            if abandon:
                                break
                else:
                    r = await c.post(url + "/v1/completions", json=body)
                    if r.status_code != 200:
                        errors[str(r.status_code)] += 1
                        continue
                done["requests"] += 1
            except httpx.HTTPError as e:
                errors[type(e).__name__] += 1


async def sampler(server: Server, until: float, every_s: float, samples: list) -> None:
    root = psutil.Process(server.proc.pid)
    start = time.monotonic()
    while time.monotonic() < until:
        row = {"t": round(time.monotonic() - start, 1)}
        for p in [root, *root.children()]:
            try:
                name = "gateway" if p.pid == root.pid else json.loads(p.cmdline()[-1])["name"]
                row[name] = p.memory_info().rss
            except (psutil.Error, ValueError, IndexError, KeyError):
                pass
        try:
            metrics = await asyncio.to_thread(scrape_metrics, server.url)
        except httpx.HTTPError:
            metrics = {}
        for (name, labels), value in metrics.items():
            if name == "pdserve_kv_tier_blocks":
                key = "kv_blocks:" + dict(labels)["worker"]
                row[key] = row.get(key, 0) + int(value)
        samples.append(row)
        await asyncio.sleep(every_s)


def warmup_end(samples: list[dict], frac: float) -> tuple[dict, str]:
    """The sample that ends warm-up (see the module docstring) and why."""
    last = samples[-1]
    kv = [k for k in last if k.startswith("kv_blocks:") and last[k] > 0]
    for row in samples:
        if kv and all(row.get(k, 0) >= 0.99 * last[k] for k in kv):
            return row, f"KV caches full (>= 99% of their final blocks) at t={row['t']} s"
    row = samples[max(int(len(samples) * frac) - 1, 0)]
    return row, f"KV caches never full: the first {frac:.0%} of the run (t={row['t']} s)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--sample-s", type=float, default=10)
    ap.add_argument("--warmup-frac", type=float, default=0.2)
    ap.add_argument("--out", default="bench_results/soak.json")
    args = ap.parse_args()
    out = Path(args.out)
    server = Server(["--prefill", "1", "--decode", "1"], out.parent / "soak_server.log")
    errors, done, samples = Counter(), Counter(), []
    try:
        server.warm_up()
        until = time.monotonic() + args.minutes * 60

        async def run():
            rngs = [random.Random(i) for i in range(args.clients)]
            await asyncio.gather(sampler(server, until, args.sample_s, samples),
                                 *(client_loop(server.url, r, until, errors, done) for r in rngs))

        asyncio.run(run())
    finally:
        server.stop()
    warm, why = warmup_end(samples, args.warmup_frac)
    last = samples[-1]
    rss = [k for k in last if k != "t" and not k.startswith("kv_blocks:")]
    growth = {k: last[k] / warm[k] - 1 for k in rss if k in warm}
    report = {"minutes": args.minutes, "clients": args.clients, "requests": done["requests"],
              "errors": dict(errors), "warmup": why, "rss_growth_after_warmup": growth,
              "rss_mb_last": {k: last[k] / 2**20 for k in rss}, "samples": samples}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
