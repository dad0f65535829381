"""Prefill time per KV codec, in this process (`pdserve.LLM`): steps of `--prompts` distinct prompts of
`--tokens` tokens each, no prefix caching; the median of the steps after the first (warm-up).

    .venv/bin/python benchmarks/bench_prefill_codecs.py [--codecs auto,int8,int4] [--steps 4]

One process per codec would be fairer to memory; one process keeps the host's state alike for all of them."""

from __future__ import annotations

import argparse
import statistics
import time

from pdserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codecs", default="auto,int8,int4")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    for codec in args.codecs.split(","):
        llm = LLM(kv_cache_dtype=codec, enable_prefix_caching=False)
        times = []
        for step in range(args.steps):
            prompts = [[(i * 7 + step + 13 * j) % 5000 + 100 for i in range(args.tokens)] for j in range(args.prompts)]
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
            times.append(time.perf_counter() - start)
        print(f"{codec}: prefill of {args.prompts} x {args.tokens} tokens, median {statistics.median(times[1:]):.2f} s "
              f"(steps: {', '.join(f'{t:.2f}' for t in times)})", flush=True)
        del llm


if __name__ == "__main__":
    main()
