"""Structured output's cost on one server: the same chat requests with a JSON schema and without, in rounds
that alternate (noise hits both), at a fixed concurrency.

Both modes do the same work: a structured round answers each request under the schema until the grammar ends it
(max_tokens leaves room for that); the plain round sends the same requests with `ignore_eos` and max_tokens set
to what the latest structured round generated for each, so both rounds generate the same tokens at the same
batch occupancy and only the masks differ. (Without that, plain answers that stop early shrink the batch and
look faster for it.)

Reported per mode: output tokens per second (all requests' tokens / the round's wall time) and the median TPOT
(a request's time per output token after the first); for the structured rounds, how many answers parsed and
validated and how many were cut at max_tokens. The target (issue 18): structured output at most 10% slower at
16 concurrent requests.

    .venv/bin/python benchmarks/bench_structured.py [--concurrency 16] [--requests 32] [--rounds 3] [--mode pd]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).parent))
from serve_proc import Server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 40},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
JOBS = ["pilot", "baker", "poet", "chess player", "doctor", "farmer", "painter", "sailor", "judge", "teacher",
        "runner", "singer", "nurse", "miner", "tailor", "cook"]


async def one(client, i: int, structured: bool, max_tokens: int) -> dict:
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                                         "strict": True}}} if structured else \
        {"extra_body": {"ignore_eos": True}}
    content = (f'Describe a {JOBS[i % len(JOBS)]} as a JSON object with the keys "name", "age", "city" and '
               '"hobbies".')
    stamps, text = [], []
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                  max_tokens=max_tokens, temperature=0.7, seed=i, stream=True,
                                                  stream_options={"include_usage": True}, **extra)
    tokens, finish = 0, None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    tpot = (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 and len(stamps) > 1 else None
    valid = None
    if structured and finish == "stop":
        try:
            jsonschema.validate(json.loads("".join(text)), SCHEMA)
            valid = True
        except (json.JSONDecodeError, jsonschema.ValidationError):
            valid = False
    return {"tokens": tokens, "tpot": tpot, "valid": valid, "cut": finish == "length"}


async def round_(url: str, structured: bool, lengths: list[int], concurrency: int) -> dict:
    """One round: request i with max_tokens lengths[i]."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def gated(i):
        async with gate:
            return await one(client, i, structured, lengths[i])

    start = time.perf_counter()
    results = await asyncio.gather(*(gated(i) for i in range(len(lengths))))
    wall = time.perf_counter() - start
    await client.close()
    tokens = sum(r["tokens"] for r in results)
    return {"tok_s": tokens / wall, "tpot_ms": 1e3 * statistics.median(r["tpot"] for r in results if r["tpot"]),
            "tokens": tokens, "lengths": [r["tokens"] for r in results],
            "invalid": sum(r["valid"] is False for r in results), "cut": sum(r["cut"] for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256, help="of a structured answer")
    ap.add_argument("--mode", default="pd", choices=["pd", "colocated"])
    ap.add_argument("--log", default="/tmp/pdserve-bench-structured.log")
    args = ap.parse_args()
    server = Server(["--mode", args.mode], Path(args.log))
    try:
        server.warm_up()
        asyncio.run(round_(server.url, True, [args.max_tokens] * 2, 2))  # the workers' grammar set-up (~0.3 s)
        rows, lengths = {False: [], True: []}, None
        for r in range(args.rounds):  # S P, P S, S P, ... (the first plain round needs a structured one's lengths)
            for structured in (True, False) if r % 2 == 0 else (False, True):
                want = [args.max_tokens] * args.requests if structured else lengths
                got = asyncio.run(round_(server.url, structured, want, args.concurrency))
                rows[structured].append(got)
                if structured:
                    lengths = [max(1, n) for n in got["lengths"]]
                print(f"round {r} {'json_schema' if structured else 'plain':<11} {got['tok_s']:6.1f} tok/s  "
                      f"TPOT p50 {got['tpot_ms']:6.1f} ms  {got['tokens']} tokens"
                      + (f"  invalid {got['invalid']}  cut at max_tokens {got['cut']}" if structured else ""),
                      flush=True)
    finally:
        server.stop()
    med = {s: {k: statistics.median(x[k] for x in rows[s]) for k in ("tok_s", "tpot_ms")} for s in rows}
    print(f"median: plain {med[False]['tok_s']:.1f} tok/s, TPOT {med[False]['tpot_ms']:.1f} ms; json_schema "
          f"{med[True]['tok_s']:.1f} tok/s, TPOT {med[True]['tpot_ms']:.1f} ms; throughput ratio "
          f"{med[True]['tok_s'] / med[False]['tok_s']:.3f}, TPOT ratio {med[True]['tpot_ms'] / med[False]['tpot_ms']:.3f}; "
          f"structured answers invalid: {sum(x['invalid'] for x in rows[True])}, cut at max_tokens: "
          f"{sum(x['cut'] for x in rows[True])} (of {args.requests * args.rounds})")


if __name__ == "__main__":
    main()
