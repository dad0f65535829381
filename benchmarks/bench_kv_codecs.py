"""KV codecs against `auto`, in one run (issue 16): for each codec a real `pdserve serve` (PD, 1 prefill + 1
decode worker, the same --kv-cache-gb) and, in this process, the engine's decode step.

Per codec:
- perplexity of the default model on ../shared/texts/gpl-3.0.txt, scored through `/v1/completions` with
  `echo` + `logprobs: 0` + `max_tokens: 0` (`--windows` windows of 1,024 tokens);
- greedy agreement with `auto` over 128 generated tokens on 16 prompts: free-running (served, all 16 at once;
  the share of positions whose token equals auto's, and how many of the 16 answers are identical: one early
  near-tie makes the rest of an answer differ), and teacher-forced (in this process: auto's 16 answers scored
  under the codec, `prompt_logprobs`; the share of their tokens the codec also ranks first);
- KV bytes per token (all layers, K and V) and the decode worker's KV blocks (`pdserve_kv_blocks_total`), so
  the concurrent 1,024-token requests (+16 output tokens) that fit at the same --kv-cache-gb;
- KV bytes on the wire per PD request of 1,024 prompt tokens (`pdserve_kv_transfer_bytes_total` after the
  perplexity windows / windows);
- decode step time at batch 16 (contexts of ~512 tokens), median of the steps, in this process
  (`pdserve.LLM`), with the kernel path each codec took.

    .venv/bin/python benchmarks/bench_kv_codecs.py [--codecs auto,int8,...] [--kv-cache-gb 1]

Writes bench_results/kv_codecs.json and prints a markdown table."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

from bench_perplexity import TEXT, perplexity, served_logprobs, windows
from serve_proc import Server

CODECS = ["auto", "fp16", "bf16", "fp8_e4m3", "int8", "int4"]
TOPICS = ["the ocean", "a mountain village", "how rain forms", "the history of bread", "a robot learning to paint",
          "why the sky is blue", "a city at night", "the life of a bee", "how computers add numbers", "a long train trip",
          "the moon", "a chess game", "learning a new language", "a winter morning", "volcanoes", "a small boat"]


async def greedy(url: str, model: str, tokens: int) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(topic: str) -> list[int]:
            body = {"model": model, "prompt": f"Write a few sentences about {topic}.", "max_tokens": tokens,
                    "temperature": 0, "ignore_eos": True, "logprobs": 0}
            r = await client.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["choices"][0]["logprobs"]["tokens"]
        return await asyncio.gather(*(one(t) for t in TOPICS))


def served(codec: str, args, parts: list[list[int]]) -> dict:
    server = Server(["--mode", "pd", "--kv-cache-dtype", codec, "--kv-cache-gb", str(args.kv_cache_gb)],
                    Path(f"bench_results/kv_codecs_{codec}_server.log"))
    try:
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        scored = [served_logprobs(server.url, model, w) for w in parts]
        wire = _total(server.metrics(), "pdserve_kv_transfer_bytes_total")  # the 1,024-token windows'
        answers = asyncio.run(greedy(server.url, model, args.tokens))
        blocks = _total(server.metrics(), "pdserve_kv_blocks_total", worker="decode-0")
    finally:
        server.stop()
    return {"perplexity": perplexity(scored), "tokens_scored": sum(map(len, scored)), "answers": answers,
            "decode_blocks": blocks, "wire_bytes_per_request": wire / len(parts)}


def _total(metrics: dict, name: str, **lab) -> float:
    return sum(v for (n, labels), v in metrics.items() if n == name and all(dict(labels).get(k) == x
                                                                             for k, x in lab.items()))


def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(f"Write a few sentences about {t}.") for t in TOPICS]


def auto_answers(tokens: int) -> list[list[int]]:
    """auto's greedy answers (token ids) in this process: what teacher-forced agreement scores."""
    from pdserve import LLM, SamplingParams
    llm = LLM(kv_host_gb=0)
    outs = llm.generate(prompts(llm.tokenizer), SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outs]


def teacher_forced(llm, answers: list[list[int]]) -> float:
    from pdserve import SamplingParams
    seqs = [p + a for p, a in zip(prompts(llm.tokenizer), answers)]
    outs = llm.generate(seqs, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    ranks = [e[1] for o, a in zip(outs, answers) for e in o.prompt_logprobs[-len(a):]]
    return sum(r == 1 for r in ranks) / len(ranks)


def in_process(codec: str, args, answers: list[list[int]]) -> dict:
    from pdserve import LLM
    llm = LLM(kv_cache_dtype=codec, kv_host_gb=0, enable_prefix_caching=False)
    row = step_time(llm, args.batch, args.context, args.steps)
    row["teacher_forced_agreement"] = teacher_forced(llm, answers)
    return row


def step_time(llm, batch: int, context: int, steps: int) -> dict:
    from pdserve import SamplingParams
    from pdserve.model import kernels
    engine = llm.engine
    for i in range(batch):
        engine.add_request([(i * 7919 + j) % 30000 + 10 for j in range(context)],
                           SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
    started: set[str] = set()
    while len(started) < batch:  # every prompt prefilled: from here on, steps decode all 16
        started.update(o.request_id for o in engine.step() if o.token_ids)
    before = dict(kernels.paths_used().get("decode_attention", {}))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    after = kernels.paths_used().get("decode_attention", {})
    paths = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
    return {"decode_step_ms": statistics.median(times) * 1e3, "attention_paths": paths}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", type=Path, default=Path("bench_results/kv_codecs.json"))
    args = ap.parse_args()

    from pdserve.core.kvstore.kv_codecs import kv_bytes_per_token
    from pdserve.model.config import ModelConfig
    from pdserve.model.loader import resolve_model_dir
    from pdserve.tokenizer import Tokenizer
    model_dir = resolve_model_dir(None)
    cfg = ModelConfig.from_dir(model_dir)
    tokens = Tokenizer.from_dir(model_dir).encode(TEXT.read_text(), add_special_tokens=False)
    parts = windows(tokens, 1024, args.windows)
    answers = auto_answers(args.tokens)
    results = {}
    for codec in args.codecs.split(","):
        row = served(codec, args, parts)
        row.update(in_process(codec, args, answers))
        row["kv_bytes_per_token"] = kv_bytes_per_token(codec, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4)
        row["concurrent_1024"] = int(row["decode_blocks"] // (-(-(1024 + 16) // 16)))
        results[codec] = row
        print(codec, {k: v for k, v in row.items() if k != "answers"}, flush=True)
    report(results, args)


def report(results: dict, args) -> None:
    base = results.get("auto")
    print("\n| codec | perplexity | vs auto | greedy agreement, teacher-forced | free-running | identical answers | "
          "KV bytes/token | concurrent 1,024-token requests | vs auto | decode step, batch 16 (ms) | vs auto | "
          "wire bytes / PD request |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for codec, r in results.items():
        if base is not None:
            pairs = [(a, b) for x, y in zip(r["answers"], base["answers"]) for a, b in zip(x, y)]
            r["greedy_agreement"] = sum(a == b for a, b in pairs) / len(pairs)
            r["identical_answers"] = sum(x == y for x, y in zip(r["answers"], base["answers"]))
        rel = (lambda k: f"{r[k] / base[k] - 1:+.1%}") if base else (lambda k: "")  # noqa: E731
        ratio = (lambda k: f"{r[k] / base[k]:.2f}x") if base else (lambda k: "")  # noqa: E731
        print(f"| {codec} | {r['perplexity']:.3f} | {rel('perplexity')} | {r['teacher_forced_agreement']:.1%} | "
              f"{r.get('greedy_agreement', 0):.1%} | "
              f"{r.get('identical_answers', '')}/{len(TOPICS)} | {r['kv_bytes_per_token']:,} | "
              f"{r['concurrent_1024']} | {ratio('concurrent_1024')} | {r['decode_step_ms']:.1f} | "
              f"{rel('decode_step_ms')} | {r['wire_bytes_per_request']:,.0f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
