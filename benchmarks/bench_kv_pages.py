"""The CPU KV pool (and host tier) on normal pages vs on transparent huge pages, side by side.

    .venv/bin/python benchmarks/bench_kv_pages.py [--pages normal huge normal huge] [--rounds 3]

Each entry of `--pages` runs in its own process, one after another: the default model, 16 requests of a
~900-token prompt (distinct per request and round, so every round writes fresh pool blocks) x 48 output
tokens, greedy, `--rounds` rounds; prints each round's wall time and the process's system CPU time. `huge`
maps the pool as pdserve did before (MADV_HUGEPAGE); `normal` is the current mapping. Prints the CPU model.
"""

from __future__ import annotations

import argparse
import platform
import resource
import subprocess
import sys
import time


def child(pages: str, rounds: int) -> None:

    import pdserve.kv.device_pool as pool_mod
    import pdserve.kv.host_store as host_mod
    from pdserve import LLM, SamplingParams
    from pdserve.model.hugepages import huge_zeros
    if pages == "huge":
        pool_mod.lazy_zeros = host_mod.lazy_zeros = huge_zeros
    llm = LLM(max_num_batched_tokens=2048)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    base = "The quick brown fox jumps over the lazy dog near the river bank today. " * 60
    r0, times = resource.getrusage(resource.RUSAGE_SELF), []
    for k in range(rounds):
        t0 = time.perf_counter()
        llm.generate([f"round {k} request {i} " + base for i in range(16)], params)
        times.append(time.perf_counter() - t0)
    sys_s = resource.getrusage(resource.RUSAGE_SELF).ru_stime - r0.ru_stime
    print(f"{pages:6s} rounds " + ", ".join(f"{t:.2f} s" for t in times) + f"; system CPU {sys_s:.2f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", nargs="+", default=["normal", "huge", "normal", "huge"], choices=["normal", "huge"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.rounds)
        return
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"CPU: {cpu}; THP: {open('/sys/kernel/mm/transparent_hugepage/enabled').read().strip()}")
    for pages in args.pages:
        subprocess.run([sys.executable, __file__, "--child", pages, "--rounds", str(args.rounds)], check=True)


if __name__ == "__main__":
    main()
