"""Where a batch-16 decode step's time goes, and each compiled kernel against its torch path.

    .venv/bin/python benchmarks/bench_decode_parts.py [--steps 10] [--repeats 5] [--weights fp32] [--input-len 128]

1. The engine (default model, `--weights`, both cores): 16 random prompts of `--input-len` tokens are prefilled,
   then `--steps` pure batch-16 decode steps are timed plain, then again under cProfile; prints the functions
   with the most own time (the compiled kernels show as their Python wrappers: `gemm`, `decode_attention`, ...)
   per step.
2. Cold parts, same shapes as that step, medians of `--repeats`: decode attention over 30 layers of
   KV (context 192, huge-page caches as the engine's) and SiLU·up / add+RMSNorm, kernel vs torch path.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import numpy as np
import torch

from pdserve import LLM, SamplingParams
from pdserve.core.sched.schedule import ScheduledChunk
from pdserve.model import kernels
from pdserve.model.attention_torch import decode_attention as _decode_attention
from pdserve.model.hugepages import lazy_zeros
from pdserve.model.input_batch import CacheLayout, build_input_batch


def profile_steps(steps: int, weights: str = "fp32", input_len: int = 128) -> None:
    llm = LLM(max_num_seqs=16, weights=weights)
    engine = llm.engine
    rng = np.random.RandomState(0)
    params = SamplingParams(temperature=0, max_tokens=2 * steps + 8, ignore_eos=True)
    for _ in range(16):
        engine.add_request(rng.randint(10, 49000, size=input_len).tolist(), params)
    for _ in range(4):  # the prefill step and a few decode steps as warm-up
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    print(f"--weights {weights}, context {input_len}+: batch-16 decode step {step_ms:.1f} ms (plain)")
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    print(f"batch-16 decode step: {(time.perf_counter() - t0) / steps * 1e3:.1f} ms (under cProfile)")
    stats = pstats.Stats(prof).stats
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:8]
    for (file, line, name), (_, calls, own, _, _) in top:
        print(f"  {own / steps * 1e3:7.2f} ms/step  {calls // steps:5d} calls/step  {name} ({file.split('/')[-1]}:{line})")


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def cold_parts(repeats: int, layers: int = 30, ctx: int = 192, bs: int = 16) -> None:
    nb = 16 * (ctx // bs) + 16
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(0)).tolist()
    chunks = [ScheduledChunk(f"r{i}", (5,), ctx - 1, tuple(perm.pop() for _ in range(ctx // bs)), True,
                             SamplingParams()) for i in range(16)]
    meta = build_input_batch(chunks, CacheLayout(bs, nb, 3), torch.device("cpu")).meta
    caches = [lazy_zeros(2 * 3 * nb * bs * 64).view(2, 3, nb, bs, 64).normal_() for _ in range(layers)]
    q, out = torch.randn(16, 9, 64), torch.empty(16, 9 * 64)

    def kernel():
        for c in caches:
            kernels.decode_attention(q, c[0], c[1], meta.decode_rows, meta.decode_lens, out, 0.125)

    def torch_path():
        for c in caches:
            _decode_attention(q, c[0], c[1], meta, 0.125)

    kv_mb = layers * 16 * ctx * 3 * 64 * 4 * 2 / 1e6
    print(f"decode attention, {layers} layers, 16 x {ctx} context ({kv_mb:.0f} MB of KV): "
          f"kernel {median_ms(kernel, repeats):.1f} ms, torch {median_ms(torch_path, repeats):.1f} ms")
    gu, x, r, w = torch.randn(2048, 3072), torch.randn(16, 576), torch.randn(16, 576), torch.randn(576)
    parts = {"silu_mul 2048 x 1536": lambda: kernels.silu_mul(gu),
             "add_rms_norm 16 x 576, x60": lambda: [kernels.add_rms_norm(x.clone(), r, w, 1e-5) for _ in range(60)]}
    for name, fn in parts.items():
        k = median_ms(fn, repeats)
        with kernels.disabled():
            t = median_ms(fn, repeats)
        print(f"{name}: kernel {k:.2f} ms, torch {t:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--weights", default="fp32", help="the engine's weight format (fp32, q8_0, q4)")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens: the decode steps' context")
    args = ap.parse_args()
    profile_steps(args.steps, args.weights, args.input_len)
    cold_parts(args.repeats)


if __name__ == "__main__":
    main()
