"""Perplexity of the served model on a fixed public text, scored through the OpenAI API as any client would:
`/v1/completions` with `echo: true`, `logprobs: 0`, `max_tokens: 0` (the prompt's own logprobs), the text cut
into windows of `--window` tokens (each scored from its start, no context carried over). The same windows
are scored in this process by `pdserve.LLM` (`prompt_logprobs`) as the reference the served numbers must
match. Issue 16 runs it once per KV codec (`--serve-args "--kv-cache-dtype int8"`).

    .venv/bin/python benchmarks/bench_perplexity.py                     # PD, the default model
    .venv/bin/python benchmarks/bench_perplexity.py --mode colocated --windows 4

Writes `bench_results/perplexity.json`."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import time
from pathlib import Path

import httpx

from serve_proc import Server

TEXT = Path(__file__).resolve().parents[2] / "shared" / "texts" / "gpl-3.0.txt"


def windows(tokens: list[int], size: int, count: int) -> list[list[int]]:
    return [tokens[i:i + size] for i in range(0, len(tokens) - size + 1, size)][:count]


def served_logprobs(url: str, model: str, window: list[int]) -> list[float]:
    body = {"model": model, "prompt": window, "max_tokens": 0, "echo": True, "logprobs": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert lps[0] is None and len(lps) == len(window), "echo must return one logprob per prompt token"
    return lps[1:]


def engine_logprobs(parts: list[list[int]], kv_cache_dtype: str = "auto") -> list[list[float]]:
    from pdserve import LLM, SamplingParams
    llm = LLM(kv_cache_dtype=kv_cache_dtype)
    outs = llm.generate(parts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    return [[e[0] for e in out.prompt_logprobs[1:]] for out in outs]


def perplexity(rows: list[list[float]]) -> float:
    flat = [lp for row in rows for lp in row]
    return math.exp(-sum(flat) / len(flat))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="pd", choices=["pd", "colocated"])
    ap.add_argument("--serve-args", default="", help="more `pdserve serve` flags, e.g. '--kv-cache-dtype int8'")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=7)
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--out", type=Path, default=Path("bench_results/perplexity.json"))
    args = ap.parse_args()

    from pdserve.model.loader import resolve_model_dir
    from pdserve.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_dir(resolve_model_dir(None))  # the default model's
    tokens = tokenizer.encode(args.text.read_text(), add_special_tokens=False)
    parts = windows(tokens, args.window, args.windows)
    server = Server(["--mode", args.mode, *shlex.split(args.serve_args)], Path("bench_results/perplexity_server.log"))
    try:
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        start = time.perf_counter()
        served = [served_logprobs(server.url, model, w) for w in parts]
        seconds = time.perf_counter() - start
    finally:
        server.stop()
    serve_args = shlex.split(args.serve_args)  # the reference keeps the served KV codec
    codec = serve_args[serve_args.index("--kv-cache-dtype") + 1] if "--kv-cache-dtype" in serve_args else "auto"
    reference = engine_logprobs(parts, codec)
    diff = max(abs(a - b) for s, r in zip(served, reference) for a, b in zip(s, r))
    result = {"text": args.text.name, "tokens_scored": sum(len(s) for s in served), "window": args.window,
              "windows": len(parts), "mode": args.mode, "serve_args": args.serve_args,
              "perplexity_served": perplexity(served), "perplexity_engine": perplexity(reference),
              "max_abs_logprob_diff": diff, "scoring_s": seconds}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
