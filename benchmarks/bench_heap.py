"""Prefill bursts with and without `pdserve.engine.heap` (malloc keeping freed activations): the evidence in its
docstring.

    .venv/bin/python benchmarks/bench_heap.py [--processes 3] [--bursts 5] [--weights fp32]

Each process builds the engine (the executor's `keep_freed_memory` replaced by a no-op for "off"), runs one warm-up
request, then `--bursts` bursts of 16 random 128-token prompts (one token each, one prefill step); it prints the
median burst after the first and the minor page faults over all bursts. Processes alternate off / on.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CHILD = """
import resource, statistics, sys, time
import numpy as np
from pdserve import LLM, SamplingParams
from pdserve.engine import model_executor
mode, weights, bursts = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "off":
    model_executor.keep_freed_memory = lambda: False
llm = LLM(max_num_seqs=16, weights=weights)
llm.generate([[11, 12, 13]], None)
engine, rng = llm.engine, np.random.default_rng(0)
params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
faults, walls = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, []
for _ in range(bursts):
    for _ in range(16):
        engine.add_request(rng.integers(100, 40000, 128).tolist(), params)
    t0 = time.monotonic()
    while engine.has_unfinished():
        engine.step()
    walls.append(time.monotonic() - t0)
print(statistics.median(walls[1:]) * 1e3, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=3, help="processes each way")
    ap.add_argument("--bursts", type=int, default=5)
    ap.add_argument("--weights", default="fp32")
    args = ap.parse_args()
    runs: dict[str, list[tuple[float, int]]] = {"off": [], "on": []}
    for _ in range(args.processes):
        for mode in runs:
            out = subprocess.run([sys.executable, "-c", CHILD, mode, args.weights, str(args.bursts)],
                                 capture_output=True, text=True, check=True).stdout.split()
            runs[mode].append((float(out[-2]), int(out[-1])))
            wall, faults = runs[mode][-1]
            print(f"{mode:>3}: burst median {wall:7.0f} ms, page faults {faults:>8}", flush=True)
    for mode, r in runs.items():
        print(f"{mode:>3}: median of the processes' medians {statistics.median(w for w, _ in r):.0f} ms; faults "
              f"{min(f for _, f in r)}-{max(f for _, f in r)} (minor page faults over {args.bursts} bursts)")


if __name__ == "__main__":
    main()
