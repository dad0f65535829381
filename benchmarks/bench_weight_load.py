"""A model load with the prepared-weights cache (`--weights-cache`) off, cold (an empty directory: prepared and
written) and warm (mapped), each in a fresh process, the three alternating; medians of `--repeats`. The time is
the worker's model load (`ModelExecutor`: the cache's look-up, the checkpoint's tensors, the packed and fused
weights), not `import torch` or the KV pool.

    .venv/bin/python benchmarks/bench_weight_load.py --weights fp32 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = """
import sys, time, torch
from pdserve.engine import model_executor
from pdserve.engine.config import EngineConfig
from pdserve.model.config import ModelConfig
from pdserve.model.loader import resolve_model_dir
model_dir = resolve_model_dir(sys.argv[3] or None)
config = EngineConfig(model=sys.argv[3] or None, weights=sys.argv[1], weights_cache=sys.argv[2], num_threads=2,
                      num_kv_blocks=16)
start = time.perf_counter()
executor = model_executor.ModelExecutor(model_dir, ModelConfig.from_dir(model_dir), config)
print(time.perf_counter() - start, executor.weights_cache["state"])
"""


def once(weights: str, cache: str, model: str) -> tuple[float, str]:
    out = subprocess.run([sys.executable, "-c", _CHILD, weights, cache, model], capture_output=True, text=True,
                         check=True).stdout.split()
    return float(out[-2]), out[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="fp32")
    ap.add_argument("--model", default="", help="default: the embedded model")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-weight-load-"))
    try:
        once(args.weights, str(root / "warm"), args.model)
        runs: dict[str, list[float]] = {"off": [], "cold": [], "warm": []}
        for _ in range(args.repeats):
            for variant in runs:
                cache = "off" if variant == "off" else str(root / variant)
                seconds, state = once(args.weights, cache, args.model)
                assert state == {"off": "off", "cold": "miss", "warm": "hit"}[variant], (variant, state)
                runs[variant].append(seconds)
                shutil.rmtree(root / "cold", ignore_errors=True)
        print(json.dumps({"weights": args.weights, **{v: round(statistics.median(s), 2) for v, s in runs.items()},
                          "runs": runs}))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
