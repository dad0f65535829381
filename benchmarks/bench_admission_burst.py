"""Admission on a fresh server: a burst of N prompts at once, against a service tier's TTFT SLO (issue 39 item 7).

    .venv/bin/python benchmarks/bench_admission_burst.py [--burst 60] [--tokens 384] \
        [--service-tier default:ttft_ms=2500,tpot_ms=400] [--calibration off fresh] [--warmup 0]

For each `--calibration` value, side by side in one run: a fresh `pdserve serve` (1 prefill + 1 decode worker,
the default model, its calibration cache in a new temporary folder, so `cached` and `fresh` both profile at
start), `--warmup` sequential requests first, then the burst: N streaming completions of `--tokens` random
prompt tokens each (no prefix hits), all sent at once with the official `openai` SDK. Per run: requests
accepted, refused (429 `slo_unattainable`), the share of the accepted whose first token came within the TTFT
SLO (client side), how many were admitted without a prediction (`fallbacks{kind=admission_unpredicted}`),
admission's prediction error (observed - predicted TTFT at the conductor: median of the accepted, the upper
bound of its bucket in `pdserve_admission_prediction_error_seconds`) and the workers' profile steps
(`pdserve_worker_calibration_steps`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_proc import Server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


async def one(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int) -> tuple[str, float | None]:
    """('ok', TTFT) or (the refusal's code, None)."""
    start = time.perf_counter()
    try:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                 temperature=0, extra_body={"ignore_eos": True})
        ttft = None
        async for _ in stream:
            ttft = ttft if ttft is not None else time.perf_counter() - start
        return "ok", ttft
    except openai.APIStatusError as e:
        return str((e.body or {}).get("code") or e.status_code), None


async def burst(url: str, n: int, tokens: int, max_tokens: int, seed: int) -> list[tuple[str, float | None]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 20000) for _ in range(tokens)] for _ in range(n)]
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
        return await asyncio.gather(*(one(client, p, max_tokens) for p in prompts))


async def warm_then_burst(url: str, args: argparse.Namespace) -> list[tuple[str, float | None]]:
    for i in range(args.warmup):  # one after the other
        await burst(url, 1, args.tokens, args.max_tokens, 1000 + i)
    return await burst(url, args.burst, args.tokens, args.max_tokens, args.seed)


def histogram_median(metrics: dict, name: str) -> tuple[float | None, int]:
    """The upper bound of the bucket holding the median of histogram `name` (summed over labels), and its count."""
    buckets: dict[float, float] = {}
    for (n, labels), v in metrics.items():
        if n == name + "_bucket":
            le = float(dict(labels)["le"])
            buckets[le] = buckets.get(le, 0.0) + v
    count = int(buckets.get(float("inf"), 0))
    if not count:
        return None, 0
    return next(le for le in sorted(buckets) if buckets[le] >= count / 2), count


def run(calibration: str, args: argparse.Namespace, log_dir: Path) -> dict:
    cache = tempfile.mkdtemp(prefix="pdserve-calibration-")
    os.environ["PDSERVE_CALIBRATION_CACHE"] = cache
    log = log_dir / f"serve-{calibration}.log"
    margin = [] if args.admission_margin is None else ["--admission-margin", str(args.admission_margin)]
    server = Server(["--service-tier", args.service_tier, "--calibration", calibration, *margin], log)
    try:
        results = asyncio.run(warm_then_burst(server.url, args))
        metrics = server.metrics()
        median, predicted = histogram_median(metrics, "pdserve_admission_prediction_error_seconds")
        unpredicted = sum(v for (n, labels), v in metrics.items() if n == "pdserve_fallbacks_total"
                          and dict(labels).get("kind") == "admission_unpredicted")
        steps = {dict(labels)["worker"]: f"{dict(labels)['source']} {v:.0f}" for (n, labels), v in metrics.items()
                 if n == "pdserve_worker_calibration_steps" and v}
    finally:
        server.stop()
    slo_s = float(re.search(r"ttft_ms=([\d.]+)", args.service_tier).group(1)) / 1000
    ttfts = [t for code, t in results if code == "ok" and t is not None]
    refused = [code for code, _ in results if code != "ok"]
    return {"calibration": calibration, "accepted": len(ttfts), "refused": len(refused),
            "codes": sorted(set(refused)), "within": sum(t <= slo_s for t in ttfts),
            "ttft_median": statistics.median(ttfts) if ttfts else None, "error_median_le": median,
            "predicted": predicted, "unpredicted": int(unpredicted), "workers": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--burst", type=int, default=60)
    p.add_argument("--tokens", type=int, default=384)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--service-tier", default="default:ttft_ms=2500,tpot_ms=400")
    p.add_argument("--calibration", nargs="+", default=["off", "fresh"])
    p.add_argument("--warmup", type=int, default=0, help="sequential requests before the burst")
    p.add_argument("--admission-margin", type=float, default=None, help="default: the server's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="bench_results/admission_burst")
    args = p.parse_args()
    print(f"{args.burst} x {args.tokens}-token prompts at once, max_tokens {args.max_tokens}, {args.service_tier}, "
          f"--admission-margin {'default' if args.admission_margin is None else args.admission_margin}, "
          f"warm-up {args.warmup}")
    print("| --calibration | accepted | refused (codes) | accepted within TTFT SLO | TTFT median (s) | "
          "admitted unpredicted | prediction error median (bucket le, s; n) | profile steps |")
    print("|---|---|---|---|---|---|---|---|")
    for calibration in args.calibration:
        r = run(calibration, args, Path(args.log_dir))
        share = f"{r['within']}/{r['accepted']} ({100 * r['within'] / r['accepted']:.0f}%)" if r["accepted"] else "-"
        med = "-" if r["ttft_median"] is None else f"{r['ttft_median']:.2f}"
        print(f"| {calibration} | {r['accepted']} | {r['refused']} ({', '.join(r['codes']) or '-'}) | {share} | "
              f"{med} | {r['unpredicted']} | {r['error_median_le']} ({r['predicted']}) | "
              f"{', '.join(f'{w}: {v}' for w, v in sorted(r['workers'].items()))} |", flush=True)


if __name__ == "__main__":
    main()
