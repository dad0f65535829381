"""Path choice (`--transport auto`) against each transport alone (issue 14, item 2).

    .venv/bin/python benchmarks/bench_paths.py [--workload fixed:1024,16] [--requests 24] [--rate 1]

The real `pdserve serve` (1 prefill + 1 decode worker, SmolLM2-135M) with `--transport shm`, `tcp` and `auto`,
one after the other, each sent the same `pdserve bench serve` run. Prints TTFT p50/p90, the mean KV transfer
time (reservation to settled, from /metrics), and under `auto` how many transfers each path carried.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

TRANSPORTS = ("shm", "tcp", "auto")


def run(transport: str, args, out: Path) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from serve_util import Server
    server = Server("--transport", transport)
    try:
        subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "serve", "--endpoint", server.url,
                        "--workload", args.workload, "--num-requests", str(args.requests), "--rate", str(args.rate),
                        "--seed", "0", "--no-progress", "--output", str(out)], check=True, stdout=subprocess.DEVNULL)
        n = server.metric("pdserve_kv_transfer_time_seconds_count", outcome="delivered")
        seconds = server.metric("pdserve_kv_transfer_time_seconds_sum", outcome="delivered")
        paths = {p: server.metric("pdserve_kv_path_transfers_total", path=p) for p in ("shm", "tcp")}
    finally:
        server.stop()
    res = json.loads((out / "result.json").read_text())
    return {"summary": res["runs"][0]["summary"], "transfer_ms": 1000 * seconds / n if n else None, "paths": paths}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="fixed:1024,16")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rate", type=float, default=1.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {t: run(t, args, Path(tmp) / t) for t in TRANSPORTS}
    print("transport | TTFT p50 / p90 ms | mean transfer ms | transfers on shm, tcp | errors")
    for t, r in results.items():
        s = r["summary"]
        paths = f"{r['paths']['shm']:.0f}, {r['paths']['tcp']:.0f}" if t == "auto" else "-"
        print(f"{t:9s} | {s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p90']:.0f} | {r['transfer_ms']:.1f} | {paths} | "
              f"{s['num_errors']}")


if __name__ == "__main__":
    main()
