"""Where a burst's prefill goes: N prompts of IN tokens submitted at once, first token only (max_tokens 1).

    .venv/bin/python benchmarks/bench_prefill.py [--weights fp32 q8_0 q4] [--num-requests 16] [--input-len 128]
                                                 [--repeats 5] [--attention]

For each weight format:
1. The first step broken down by part of the forward, in CPU seconds of one thread (torch and the kernels on
   one thread, so other processes on a shared host do not count): the matmuls per layer, attention,
   rotary + cache write, RMSNorm, SiLU x up, the rest.
2. The burst's wall time and TTFT p50 on all threads, medians of --repeats, variants alternating in one process:
   quantized weights with their prefill matmuls in bf16 (`quant.BF16_ROWS`, where the CPU multiplies bf16
   natively) and in fp32 (dequantize + F.linear, the path before); with --attention, prefill attention through
   the compiled kernel (`attention_cpu`, the default) and through SDPA chunk by chunk (`KERNEL_MAX_PAIRS = 0`).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import numpy as np
import torch

from pdserve import LLM, SamplingParams
from pdserve.model import attention_cpu, kernels, linear, llama, quant


def timed(spent: collections.Counter, key, fn):
    def wrapper(*args, **kwargs):
        t0 = time.thread_time()
        out = fn(*args, **kwargs)
        spent[key(args) if callable(key) else key] += time.thread_time() - t0
        return out
    return wrapper


def burst(engine, prompts) -> tuple[float, float]:
    """(wall seconds, TTFT p50 seconds) of prompts submitted at once, one token each."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    t0, outs = time.monotonic(), []
    while engine.has_unfinished():
        outs += engine.step()
    return time.monotonic() - t0, statistics.median(o.first_token_s - t0 for o in outs)


def breakdown(engine, prompts) -> collections.Counter:
    spent: collections.Counter = collections.Counter()
    patches = [(kernels, "add_rms_norm", "RMSNorm"), (kernels, "silu_mul", "SiLU x up"),
               (llama, "rope_write", "rotary + cache write"), (llama, "paged_attention", "attention"),
               (linear.Linear, "__call__", lambda a: f"matmul {tuple(a[0].weight.shape)}"),
               (quant.QuantLinear, "__call__", lambda a: f"matmul {(a[0].n, a[0].k)}"),
               (llama.LlamaModel, "forward", "forward")]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for obj, name, key in patches:
            setattr(obj, name, timed(spent, key, getattr(obj, name)))
        burst(engine, prompts)
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        torch.set_num_threads(threads)
    spent["rest of the forward"] = spent.pop("forward") - sum(spent.values())
    return spent


def quant_linears(llm) -> list:
    model = llm.engine.executor.model
    layers = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return [lin for lin in [*layers, model.lm_head] if isinstance(lin, quant.QuantLinear)]


def set_bf16(linears: list, on: bool) -> None:
    """The quantized layers' prefill matmuls in bf16 (the rule, `quant.BF16_ROWS`) or in fp32 (the path before)."""
    for lin in linears:
        if not hasattr(lin, "rule_rows"):
            lin.rule_rows = (lin.bf16_from, lin.max_rows)
        lin.bf16_from, lin.max_rows = lin.rule_rows if on else (1 << 62, quant.KERNEL_ROWS.get(lin.isa, 0))


def variants(linears: list, attention: bool) -> dict:
    """name -> a function setting the variant up (each sets every knob, so they alternate cleanly)."""
    default = attention_cpu.KERNEL_MAX_PAIRS

    def setup(bf16: bool, pairs: int):
        def apply():
            set_bf16(linears, bf16)
            attention_cpu.KERNEL_MAX_PAIRS = pairs
        return apply

    out = {"default": setup(True, default)}
    if linears and linears[0].rule_rows[0] < 1 << 62:
        out["prefill matmuls fp32"] = setup(False, default)
    if attention:
        out["attention SDPA per chunk"] = setup(True, 0)
    return out


def run_format(fmt: str, args, prompts) -> None:
    llm = LLM(max_num_seqs=max(args.num_requests, 16), weights=fmt)
    llm.generate([[11, 12, 13]], None)  # warmup
    linears = quant_linears(llm)
    set_bf16(linears, True)
    bf16 = f"bf16 matmuls ({kernels.bf16_isa()}) from {linears[0].bf16_from} rows" \
        if linears and linears[0].bf16_from < 1 << 62 else "no bf16 matmuls"
    print(f"--weights {fmt}: {args.num_requests} x {args.input_len}-token prompts at once; load "
          f"{os.getloadavg()[0]:.1f}; {bf16}")
    spent = breakdown(llm.engine, prompts())
    total = sum(spent.values())
    print(f"first step on one thread, CPU seconds: {total:.2f}")
    for part, s in spent.most_common():
        print(f"  {part:<24}{s * 1e3:8.0f} ms {s / total:6.1%}")
    setups = variants(linears, args.attention)
    runs: dict[str, list] = {name: [] for name in setups}
    for _ in range(args.repeats):
        for name, apply in setups.items():
            apply()
            runs[name].append(burst(llm.engine, prompts()))
    setups["default"]()
    print(f"all {torch.get_num_threads()} threads, medians of {args.repeats} alternating runs "
          f"(load {os.getloadavg()[0]:.1f} at the end):")
    for name, r in runs.items():
        print(f"  {name:<26} burst {statistics.median(x[0] for x in r) * 1e3:7.0f} ms, "
              f"TTFT p50 {statistics.median(x[1] for x in r) * 1e3:7.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", nargs="+", default=["fp32", "q8_0", "q4"])
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--attention", action="store_true", help="also prefill attention through SDPA per chunk")
    args = ap.parse_args()
    rng = np.random.RandomState(0)
    prompts = lambda: [rng.randint(10, 49000, size=args.input_len).tolist() for _ in range(args.num_requests)]  # noqa: E731
    for fmt in args.weights:
        run_format(fmt, args, prompts)


if __name__ == "__main__":
    main()
