"""PD vs colocated through `pdserve serve`: TTFT of one long prompt, and TPOT when long prompts keep arriving.

    .venv/bin/python benchmarks/bench_pd.py [--transport shm] [--ttft-prompt 1024] [--ttft-repeats 5]
        [--short 16 --short-in 64 --short-out 96 --short-every 0.5] [--long-in 1536 --long-every 2.5]
        [--modes pd,colocated]

Starts the server in each mode in turn (same machine, same workload, one after another):
  1. TTFT: one request at a time, a fresh `--ttft-prompt`-token prompt each (no prefix hits), max_tokens 1,
     streaming; median over repeats. Both modes get the same torch threads per worker (`--threads`,
     default all cores) so the difference is what disaggregation adds (delivery, hops, the last prompt token
     on the decode side), not a different core count.
  2. Interference: `--short` short requests (prompt `--short-in`, exactly `--short-out` output tokens) arrive
     every `--short-every` s while long prompts (`--long-in` tokens, 1 output token) arrive every
     `--long-every` s until the short ones finish. Cores are split as a user would: PD = 1 prefill + 1 decode
     worker with cores/2 threads each; colocated = 1 worker with all cores. Reported per short request: TPOT
     = (last token - first token) / (tokens - 1); and the inter-token gaps. p50/p99 of both.
Writes bench_results/pd.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from pdserve.bench.kv_lifecycle import describe, kv_delta, scrape

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serve_util import Server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def prompt_ids(rng: np.random.RandomState, n: int) -> list[int]:
    return rng.randint(100, 40000, size=n).tolist()


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.monotonic()
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.monotonic())
    return {"start": t0, "times": times}


async def ttft_runs(url: str, n_tokens: int, repeats: int, seed: int) -> list[float]:
    rng = np.random.RandomState(seed)
    out = []
    async with httpx.AsyncClient(timeout=600) as client:
        await stream(client, url, prompt_ids(rng, 32), 1)  # warm-up
        for _ in range(repeats):
            r = await stream(client, url, prompt_ids(rng, n_tokens), 1)
            out.append(r["times"][0] - r["start"])
    return out


async def interference(url: str, args, seed: int) -> dict:
    rng = np.random.RandomState(seed)
    shorts = [prompt_ids(rng, args.short_in) for _ in range(args.short)]
    done = asyncio.Event()
    async with httpx.AsyncClient(timeout=600) as client:
        await stream(client, url, prompt_ids(rng, 16), 2)  # warm-up

        async def longs():
            tasks = []
            while not done.is_set():
                tasks.append(asyncio.ensure_future(stream(client, url, prompt_ids(rng, args.long_in), 1)))
                try:
                    await asyncio.wait_for(done.wait(), args.long_every)
                except asyncio.TimeoutError:
                    pass
            return await asyncio.gather(*tasks)

        async def short(i, p):
            await asyncio.sleep(i * args.short_every)
            return await stream(client, url, p, args.short_out)

        long_task = asyncio.ensure_future(longs())
        results = await asyncio.gather(*(short(i, p) for i, p in enumerate(shorts)))
        done.set()
        long_results = await long_task
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in results]
    gaps = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
    return {"tpot": tpot, "itl": gaps, "num_long": len(long_results),
            "ttft_short": [r["times"][0] - r["start"] for r in results]}


def pct(xs, q) -> float:
    return float(np.percentile(xs, q))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--ttft-prompt", type=int, default=1024)
    ap.add_argument("--ttft-repeats", type=int, default=5)
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--short-in", type=int, default=64)
    ap.add_argument("--short-out", type=int, default=96)
    ap.add_argument("--short-every", type=float, default=0.5)
    ap.add_argument("--long-in", type=int, default=1536)
    ap.add_argument("--long-every", type=float, default=2.5)
    ap.add_argument("--parts", default="ttft,interference", help="comma-separated: ttft, interference")
    ap.add_argument("--modes", default="pd,colocated", help="comma-separated: pd, colocated")
    args = ap.parse_args()
    half = str(max(args.threads // 2, 1))
    modes = {m: f for m, f in {"pd": ["--transport", args.transport], "colocated": ["--mode", "colocated"]}.items()
             if m in args.modes.split(",")}
    report: dict = {"args": vars(args)}
    parts = args.parts.split(",")
    if "ttft" in parts:
        for mode, flags in modes.items():
            server = Server(*flags, "--num-threads", str(args.threads))
            try:
                report[f"ttft_{mode}"] = asyncio.run(ttft_runs(server.url, args.ttft_prompt, args.ttft_repeats, 1))
            finally:
                server.stop()
        if len(modes) < 2:
            raise SystemExit("--parts ttft compares both modes: --modes pd,colocated")
        pd, co = (statistics.median(report[f"ttft_{m}"]) for m in ("pd", "colocated"))
        print(f"TTFT, one {args.ttft_prompt}-token prompt, {args.threads} threads per worker, median of "
              f"{args.ttft_repeats}: PD {pd * 1e3:.0f} ms, colocated {co * 1e3:.0f} ms, PD adds {pd / co - 1:+.1%}")
    if "interference" in parts:
        interference_part(args, modes, half, report)
    out = Path("bench_results")
    out.mkdir(exist_ok=True)
    (out / "pd.json").write_text(json.dumps(report, indent=2))
    return 0


def interference_part(args, modes: dict, half: str, report: dict) -> None:
    for mode, flags in modes.items():
        threads = half if mode == "pd" else str(args.threads)
        server = Server(*flags, "--num-threads", threads)
        try:
            start, before = time.monotonic(), scrape(server.url)
            r = report[f"interference_{mode}"] = asyncio.run(interference(server.url, args, 2))
            r["wall_s"] = time.monotonic() - start
            r["kv"] = kv_delta(before, scrape(server.url))  # what `pdserve bench serve` reports
        finally:
            server.stop()
    print(f"TPOT of {args.short} short requests ({args.short_in} in / {args.short_out} out, one every "
          f"{args.short_every} s) while {args.long_in}-token prompts arrive every {args.long_every} s:")
    print(f"{'mode':<10}{'TPOT p50':>10}{'TPOT p99':>10}{'ITL p50':>10}{'ITL p99':>10}{'longs':>7}  (ms)")
    for mode in modes:
        r = report[f"interference_{mode}"]
        print(f"{mode:<10}{pct(r['tpot'], 50) * 1e3:>10.1f}{pct(r['tpot'], 99) * 1e3:>10.1f}"
              f"{pct(r['itl'], 50) * 1e3:>10.1f}{pct(r['itl'], 99) * 1e3:>10.1f}{r['num_long']:>7}")
    if "pd" in modes:
        pd = report["interference_pd"]
        print(f"PD run {pd['wall_s']:.0f} s, short TTFT p50 {pct(pd['ttft_short'], 50):.1f} s; {describe(pd['kv'])}")
    if len(modes) == 2:
        pd99, co99 = (pct(report[f"interference_{m}"]["tpot"], 99) for m in ("pd", "colocated"))
        print(f"PD P99 TPOT is {1 - pd99 / co99:.0%} lower than colocated")


if __name__ == "__main__":
    sys.exit(main())
