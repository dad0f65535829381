"""How long `pdserve serve` takes to be ready (/health 200) and to be gone after SIGTERM: what every server
start in the test suite, and every worker restart, costs. Medians of `--repeats` runs per shape.

    .venv/bin/python benchmarks/bench_startup.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time

from pdserve.bench.server_proc import free_port, wait_ready

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
    args = ap.parse_args()
    out = {}
    for name, flags in SHAPES.items():
        runs = [once(flags) for _ in range(args.repeats)]
        out[name] = {"ready_s": statistics.median(r for r, _ in runs), "stop_s": statistics.median(s for _, s in runs)}
        print(name, json.dumps(out[name]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
