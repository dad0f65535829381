"""How long `pdserve serve` takes to be ready (/health 200) and to be gone after SIGTERM: what every server
start in the test suite, and every worker restart, costs. Medians of `--repeats` runs per shape.

    .venv/bin/python benchmarks/bench_startup.py [--repeats 5]
    .venv/bin/python benchmarks/bench_startup.py --cache --weights q8_0 --shapes colocated,"pd 1+1 shm"

`--cache`: each shape with the prepared-weights cache (`--weights-cache`) off, cold (an empty directory each run:
prepared and written) and warm (a directory prepared beforehand), the three alternating within each repeat.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdserve.bench.server_proc import free_port, wait_ready

COLD = Path(tempfile.gettempdir()) / "bench-startup-weights" / "cold"  # (removed after each run)
SHAPES = {"pd 1+1 shm": [], "pd 1+1 tcp": ["--transport", "tcp"], "colocated": ["--mode", "colocated"]}


def once(args: list[str]) -> tuple[float, float]:
    port = free_port()
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    why = wait_ready(proc, f"http://127.0.0.1:{port}", 300, poll_s=0.05)
    ready = time.monotonic() - start
    if why is not None:
        raise RuntimeError(why)
    stop = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    return ready, time.monotonic() - stop


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cache", action="store_true", help="the prepared-weights cache off, cold and warm (above)")
    ap.add_argument("--weights", default="fp32", help="--weights of the servers")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    args = ap.parse_args()
    for name in args.shapes.split(","):
        flags = SHAPES[name] + ["--weights", args.weights]
        variants = cache_variants(flags) if args.cache else {"": lambda: flags}
        runs: dict[str, list] = {v: [] for v in variants}
        for _ in range(args.repeats):
            for v, make in variants.items():
                runs[v].append(once(make()))
                shutil.rmtree(COLD, ignore_errors=True)
        for v, rs in runs.items():
            out = {"ready_s": statistics.median(r for r, _ in rs), "stop_s": statistics.median(s for _, s in rs)}
            print(name, v, json.dumps(out), flush=True)
    return 0


def cache_variants(flags: list[str]) -> dict:
    """off / cold (a new empty directory per run) / warm (one directory, prepared by a first, untimed run)."""
    warm = COLD.parent / "warm"
    shutil.rmtree(warm, ignore_errors=True)
    once(flags + ["--weights-cache", str(warm)])
    return {"off": lambda: flags + ["--weights-cache", "off"], "cold": lambda: flags + ["--weights-cache", str(COLD)],
            "warm": lambda: flags + ["--weights-cache", str(warm)]}


if __name__ == "__main__":
    sys.exit(main())
