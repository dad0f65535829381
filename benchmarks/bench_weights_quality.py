"""Quality of each weight format (`--weights fp32 | q8_0 | q4`) on the default model, next to llama.cpp on the
same GGUF file (issue 43 item 3).

For each format: the fixed text (../shared/texts/gpl-3.0.txt) cut into windows of `--window` tokens, each
scored from its start through a real `pdserve serve --weights FORMAT` (`/v1/completions`, `echo`, `logprobs`,
`max_tokens: 0`: bench_perplexity.py's client) -> perplexity; the same windows through `pdserve.LLM` in this
process (prompt logprobs, top 1) -> the top-1 token at each position, and a check that it scores as the server
did. Then:
- perplexity change against fp32;
- teacher-forced greedy (top-1) agreement against fp32: the share of the text's positions where the format's
  most likely next token is fp32's;
- llama.cpp (`--llamacpp-python`, its own venv; benchmarks/peers/llamacpp_peer.py): its perplexity on the same
  token windows from its own Q4_1 computation, and its top-1 agreement with pdserve fp32.
Targets: q8_0 within +0.5% of fp32's perplexity; q4 within llama.cpp's own figure.

    .venv/bin/python benchmarks/bench_weights_quality.py [--formats fp32 q8_0 q4] [--windows 7] [--chunk 64]

`--chunk N`: prefill in chunks of at most N tokens (server and engine: `--max-num-batched-tokens N`); with N within
`quant.I8_ROWS` (16-128 on AVX-512 VNNI) q8_0 scores the text on int8 rows, the path of batch-16 decode steps.
Without it, a window's prefill is 1,024 rows: q8_0 and q4 score on the bf16 path where the CPU multiplies bf16
(`quant.BF16_ROWS`); the table names each format's matmul paths (`gemm_paths`).

Writes bench_results/weights_quality.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench_engine import host_cpu
from bench_perplexity import TEXT, perplexity, served_logprobs, windows
from serve_proc import Server

HERE = Path(__file__).resolve().parent


def served(fmt: str, parts: list[list[int]], mode: str, chunk: int | None) -> list[list[float]]:
    extra = [] if chunk is None else ["--max-num-batched-tokens", str(chunk)]
    server = Server(["--mode", mode, "--weights", fmt, *extra], Path(f"bench_results/weights_quality_{fmt}_server.log"))
    try:
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        return [served_logprobs(server.url, model, w) for w in parts]
    finally:
        server.stop()


def engine(fmt: str, parts: list[list[int]], chunk: int | None) -> tuple[list[list[float]], list[list[int]]]:
    """Each window's next-token logprobs and top-1 tokens under `fmt`, in this process."""
    from pdserve import LLM, SamplingParams
    from pdserve.model import kernels
    llm = LLM(weights=fmt, **({} if chunk is None else {"max_num_batched_tokens": chunk}))
    before = kernels.paths_used().get("gemm", {})
    outs = llm.generate(parts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    GEMM_PATHS[fmt] = {p: n - before.get(p, 0) for p, n in kernels.paths_used().get("gemm", {}).items()
                       if n > before.get(p, 0)}
    entries = [out.prompt_logprobs[1:] for out in outs]
    return [[e[0] for e in row] for row in entries], [[e[2][0][0] for e in row] for row in entries]


GEMM_PATHS: dict[str, dict[str, int]] = {}  # format -> the engine's matmul calls by path (kernels.paths_used)


def llamacpp(python: str, parts: list[list[int]]) -> dict | None:
    if not python or not Path(python).exists():
        return None
    from pdserve.model.loader import default_model_path
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(parts, f)
        f.flush()
        proc = subprocess.run([python, str(HERE / "peers" / "llamacpp_peer.py"), "--model", str(default_model_path()),
                               "--score", f.name], capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"llama.cpp failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / len(pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=["fp32", "q8_0", "q4"])
    ap.add_argument("--mode", default="colocated", choices=["pd", "colocated"])
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=7)
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunks of at most this many tokens")
    ap.add_argument("--llamacpp-python", default="/work/peers/llamacpp/bin/python")
    ap.add_argument("--out", type=Path, default=Path("bench_results/weights_quality.json"))
    args = ap.parse_args()

    from pdserve.model.loader import resolve_model_dir
    from pdserve.tokenizer import Tokenizer
    tokens = Tokenizer.from_dir(resolve_model_dir(None)).encode(TEXT.read_text(), add_special_tokens=False)
    parts = windows(tokens, args.window, args.windows)
    rows, top1 = {}, {}
    for fmt in args.formats:
        start = time.perf_counter()
        lps_served = served(fmt, parts, args.mode, args.chunk)
        lps_engine, top1[fmt] = engine(fmt, parts, args.chunk)
        diff = max(abs(a - b) for s, r in zip(lps_served, lps_engine) for a, b in zip(s, r))
        rows[fmt] = {"perplexity": perplexity(lps_served), "perplexity_engine": perplexity(lps_engine),
                     "max_abs_logprob_diff_served_vs_engine": diff, "seconds": time.perf_counter() - start,
                     "gemm_paths": GEMM_PATHS.get(fmt, {})}
    peer = llamacpp(args.llamacpp_python, parts)
    if peer is not None:
        top1["llama.cpp"] = peer["top1"]
        rows["llama.cpp"] = {"perplexity": perplexity(peer["logprobs"])}
    base = rows.get("fp32")
    for name, row in rows.items():
        if base is not None:
            row["perplexity_change"] = row["perplexity"] / base["perplexity"] - 1
            row["top1_agreement_vs_fp32"] = agreement(top1[name], top1["fp32"])
    result = {"text": TEXT.name, "window": args.window, "windows": len(parts),
              "tokens_scored": sum(len(p) - 1 for p in parts), "mode": args.mode, "chunk": args.chunk, "cpu": host_cpu(),
              "date": time.strftime("%Y-%m-%d"), "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"host: {result['cpu']['model']} ({', '.join(result['cpu']['isa'])}), {result['date']}")
    print(f"{result['tokens_scored']} tokens of {TEXT.name} in {len(parts)} windows of {args.window}, served "
          f"({args.mode}, echo)")
    print(f"{'weights':<11}{'perplexity':>11}{'vs fp32':>9}{'top-1 agree':>13}  matmul calls by path")
    for name, row in rows.items():
        print(f"{name:<11}{row['perplexity']:>11.4f}{row.get('perplexity_change', 0) * 100:>+8.2f}%"
              f"{row.get('top1_agreement_vs_fp32', 1) * 100:>12.1f}%  {row.get('gemm_paths', '')}")


if __name__ == "__main__":
    main()
