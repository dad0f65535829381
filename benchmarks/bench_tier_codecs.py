"""Quality and bytes of a compact host KV tier (`--kv-host-cache-dtype`, issue 39 item 4): perplexity of the default
model through `/v1/completions` echo (as `bench_perplexity.py` scores it) for prompts whose older KV is served
from the host tier, one real `pdserve serve` (colocated) per host-tier codec, side by side.

Echo asks for every prompt token's logprob, so the prompt is computed in full (a prefix-cache hit would skip
the logits); what makes it read the host tier is the long-context hot window: with `--kv-hot-window-tokens 256`
and 256-token prefill chunks, each chunk of a 1,024-token window reads all but the last 256 tokens of its context
from the host tier, layer by layer, decoded from the tier's codec (`attention_torch.cold_kv`). So every scored
token past the first 256 of a window attends over KV that went through the host codec, and `pool` (the host tier
in the pool's fp32) is the exact reference. Bytes: the host tier's bytes per block and the blocks a 4 GiB host
tier holds (the server's own `pdserve_kv_tier_capacity_blocks`, at --kv-host-gb 4).

    .venv/bin/python benchmarks/bench_tier_codecs.py --windows 2

Writes `bench_results/tier_codecs.json`."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import httpx

from bench_perplexity import TEXT, served_logprobs, windows
from serve_proc import Server

FLAGS = ["--mode", "colocated", "--kv-hot-window-tokens", "256", "--max-num-batched-tokens", "256",
         "--kv-host-gb", "4", "--calibration", "off"]


def run(codec: str, parts: list[list[int]]) -> dict:
    extra = [] if codec == "pool" else ["--kv-host-cache-dtype", codec]
    server = Server([*FLAGS, *extra], Path(f"bench_results/tier_codecs_{codec}.log"))
    try:
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        start = time.perf_counter()
        rows = [served_logprobs(server.url, model, w) for w in parts]
        seconds = time.perf_counter() - start
        m = server.metrics()
    finally:
        server.stop()
    capacity = sum(v for (name, labels), v in m.items()
                   if name == "pdserve_kv_tier_capacity_blocks" and dict(labels).get("tier") == "host")
    host_in = sum(v for (name, labels), v in m.items()
                  if name == "pdserve_kv_tier_bytes_total" and dict(labels).get("tier") == "host"
                  and dict(labels).get("direction") == "in")
    flat = [lp for row in rows for lp in row]
    return {"codec": codec, "rows": rows, "perplexity": math.exp(-sum(flat) / len(flat)), "seconds": seconds,
            "host_capacity_blocks": int(capacity), "host_bytes_in": int(host_in)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codecs", default="pool,fp16,fp8_e4m3,int8,int4")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench_results/tier_codecs.json"))
    args = ap.parse_args()
    from pdserve.model.loader import resolve_model_dir
    from pdserve.tokenizer import Tokenizer
    tokens = Tokenizer.from_dir(resolve_model_dir(None)).encode(TEXT.read_text(), add_special_tokens=False)
    parts = windows(tokens, args.window, args.windows)
    results = []
    for codec in args.codecs.split(","):  # each as it ends (a long run on a busy host still shows what it has)
        results.append(run(codec, parts))
        print(f"{codec}: perplexity {results[-1]['perplexity']:.4f}, {results[-1]['seconds']:.0f} s", flush=True)
    ref = results[0]
    print("| host tier codec | perplexity | vs pool | max per-token logprob diff | host blocks in 4 GiB | vs pool "
          "| host tier bytes written |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        diff = max(abs(a - b) for s, t in zip(r["rows"], ref["rows"]) for a, b in zip(s, t))
        r["vs_pool"] = r["perplexity"] / ref["perplexity"] - 1
        r["max_logprob_diff"] = diff
        print(f"| {r['codec']} | {r['perplexity']:.4f} | {r['vs_pool']:+.2%} | {diff:.4f} | "
              f"{r['host_capacity_blocks']:,} | {r['host_capacity_blocks'] / ref['host_capacity_blocks']:.2f}x | "
              f"{r['host_bytes_in']:,} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"window": args.window, "windows": len(parts), "flags": FLAGS,
                                    "results": [{k: v for k, v in r.items() if k != "rows"} for r in results]},
                                   indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
