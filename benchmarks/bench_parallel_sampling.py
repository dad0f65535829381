"""n > 1 against separate requests: how many prompt tokens the server computes (`pdserve_prompt_tokens_computed_total`,
read from /metrics before and after) and how long the answers take, on prompts no earlier request shares.

Per trial, on a fresh prompt each time: one completion with `n` sequences; `n` separate requests with the same
prompt sent at once; the same `n` sent one after another. Usage counts the prompt once for `n` (as OpenAI
does) and once per request for the separate ones.

    .venv/bin/python benchmarks/bench_parallel_sampling.py [--n 3] [--trials 3] [--prompt-words 120]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).parent))
from serve_proc import Server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
WORDS = "sea wind lighthouse keeper night storm harbour rope lantern gull tide shore ship sail rock wave".split()


def computed(server: Server) -> float:
    return sum(v for (name, _), v in server.metrics().items() if name == "pdserve_prompt_tokens_computed_total")


async def measure(server: Server, client, how: str, prompt: str, n: int, max_tokens: int) -> dict:
    before, start = computed(server), time.perf_counter()
    ask = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.8)
    if how == "n":
        outs = [await client.completions.create(n=n, seed=1, **ask)]
    elif how == "concurrent":
        outs = await asyncio.gather(*(client.completions.create(seed=1 + i, **ask) for i in range(n)))
    else:
        outs = [await client.completions.create(seed=1 + i, **ask) for i in range(n)]
    wall = time.perf_counter() - start
    texts = {c.text for o in outs for c in o.choices}
    return {"computed": computed(server) - before, "prompt_tokens": sum(o.usage.prompt_tokens for o in outs),
            "completion_tokens": sum(o.usage.completion_tokens for o in outs), "distinct": len(texts), "s": wall}


async def run(server: Server, args) -> None:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    rng, rows = random.Random(0), {"n": [], "concurrent": [], "sequential": []}
    for trial in range(args.trials):
        for how in rows:  # a fresh prompt each time: nothing in the prefix cache helps
            prompt = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
            got = await measure(server, client, how, prompt, args.n, args.max_tokens)
            rows[how].append(got)
            print(f"trial {trial} {how:<10} prompt tokens counted {got['prompt_tokens']:4d}, computed "
                  f"{got['computed']:4.0f}; completion tokens {got['completion_tokens']}, distinct answers "
                  f"{got['distinct']}; {got['s']:.2f} s", flush=True)
    await client.close()
    for how, got in rows.items():
        print(f"median {how:<10} computed {statistics.median(g['computed'] for g in got):.0f} prompt tokens, "
              f"{statistics.median(g['s'] for g in got):.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--prompt-words", type=int, default=120)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--mode", default="pd", choices=["pd", "colocated"])
    ap.add_argument("--log", default="/tmp/pdserve-bench-parallel-sampling.log")
    args = ap.parse_args()
    server = Server(["--mode", args.mode], Path(args.log))
    try:
        server.warm_up()
        asyncio.run(run(server, args))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
