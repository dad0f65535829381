"""Does a host KV tier slow decoding? 16 requests x 128 prompt x 128 output tokens, greedy, default model.

    for i in 1 2 3; do for h in 0 4; do .venv/bin/python benchmarks/bench_tier_overhead.py $h; done; done

One configuration per process (`kv_host_gb` = the argument), two timed batches after a short warm-up;
prints output tokens/s of each. Alternate the two configurations over several process pairs and compare
medians: the machine is shared and noisy. With a host tier every full block is copied to host on the tier
I/O thread while the engine steps (write-through), so this measures that thread's cost to the step.
"""

from __future__ import annotations

import sys
import time

from pdserve import LLM, SamplingParams


def main() -> None:
    host_gb = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
    llm = LLM(kv_host_gb=host_gb)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate([[5 + j for j in range(128)]], SamplingParams(max_tokens=8))  # warm-up
    rates = []
    for rep in range(2):
        prompts = [[(rep * 1000 + i * 37 + j) % 30000 + 100 for j in range(128)] for i in range(16)]
        start = time.perf_counter()
        llm.generate(prompts, params)
        rates.append(16 * 128 / (time.perf_counter() - start))
    print(f"kv_host_gb={host_gb}: output tok/s {[round(r, 1) for r in rates]}", flush=True)


if __name__ == "__main__":
    main()
