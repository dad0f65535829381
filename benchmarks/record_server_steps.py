"""Record a real server's step reports as a test fixture (tests/data/server_steps.json, for
tests/test_from_server.py): `pdserve serve` (1 prefill + 1 decode, one thread each), a short replay of the
scaled Azure conversation trace through `pdserve bench serve`, then GET /v1/admin/steps; the served steps kept,
every prefill step and an even sample of the decode steps, at most --max-rows in all.

    .venv/bin/python benchmarks/record_server_steps.py [--max-requests 24] [--rate 1] [--max-rows 300]
    .venv/bin/python benchmarks/record_server_steps.py --from-fit bench_results/fidelity_quick/server_fit1.json
        # the steps a fidelity run's server reported (`make fidelity` keeps them), no server of its own
    .venv/bin/python benchmarks/record_server_steps.py --from-fit bench_results/fidelity_mc/server_fit0.json \
        bench_results/fidelity_mc/server_fit1.json --output tests/data/server_steps_prefix.json
        # the conversation workload's (prefix reuse: steps with a prefix term), two servers' steps
    .venv/bin/python benchmarks/record_server_steps.py --prefix --output tests/data/server_steps_prefix.json
        # prefill steps over a cached prefix (tests/test_from_server.py's prefix term): one request at a time,
        # each of PREFIXES sent alone (no prefix) and then with each of SUFFIXES after it (a chunk of the
        # suffix's tokens at the prefix's position), in a server of one thread per worker
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import urllib.request
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from serve_util import TRACES, Server  # noqa: E402

OUT = ROOT / "tests" / "data" / "server_steps.json"


def cpu_model() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def keep(records: list[dict], max_rows: int) -> list[dict]:
    served = [r for r in records if r["source"] == "served" and (r["prefill_tokens"] or r["decode_seqs"])]
    pre = [r for r in served if r["prefill_tokens"]][:max_rows // 3]
    dec = [r for r in served if not r["prefill_tokens"]]
    step = max(1, len(dec) // max(1, max_rows - len(pre)))
    return pre + dec[::step][:max_rows - len(pre)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-requests", default="24")
    ap.add_argument("--rate", default="1")
    ap.add_argument("--max-rows", type=int, default=300)
    ap.add_argument("--from-fit", nargs="+", default=None,
                    help="`pdserve profile --from-server` JSON files: their steps")
    ap.add_argument("--output", type=Path, default=OUT)
    ap.add_argument("--prefix", action="store_true", help="prefill steps over cached prefixes (see above)")
    args = ap.parse_args()
    records = ([r for path in args.from_fit for r in json.loads(Path(path).read_text())["steps"]] if args.from_fit
               else prefix_steps() if args.prefix else served_steps(args))
    rows = keep(records, args.max_rows)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"recorded": {"command": " ".join(["benchmarks/record_server_steps.py", *sys.argv[1:]]),
                                            "cpu": cpu_model(), "date": date.today().isoformat(),
                                            "load_average_1m": round(os.getloadavg()[0], 2),
                                            "steps_reported": len(records)},
                               "data": rows}, indent=None).replace("}, {", "},\n{"))
    print(f"kept {len(rows)} of {len(records)} step records -> {args.output}")
    return 0


def served_steps(args) -> list[dict]:
    """Serve, replay the scaled trace, and read back the step reports."""
    server = Server("--num-threads", "1")
    try:
        with tempfile.TemporaryDirectory() as out:
            subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "serve", "--endpoint", server.url,
                            "--workload", f"azure:{TRACES / 'AzureLLMInferenceTrace_conv_2023.csv'}",
                            "--length-scale", "0.1", "--rate", args.rate, "--max-requests", args.max_requests,
                            "--seed", "0", "--output", out, "--no-progress"], check=True)
        with urllib.request.urlopen(f"{server.url}/v1/admin/steps", timeout=30) as resp:
            records = json.loads(resp.read())["data"]
    finally:
        server.stop()
    return records


PREFIXES, SUFFIXES = (128, 256, 512, 768), (16, 48, 96, 160)


def prefix_steps() -> list[dict]:
    """Serve; send each prefix alone, then each prefix + suffix (its prefix's blocks cached), one request at a
    time; read back the step reports."""
    import asyncio
    import random

    import httpx

    from pdserve.bench.client import send_request
    rng = random.Random(0)

    async def send_all(url: str) -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            for length in PREFIXES:
                prefix = [rng.randrange(100, 30000) for _ in range(length)]
                for suffix in (0, *SUFFIXES):
                    rec = await send_request(client, url, "SmolLM2-135M-Instruct",
                                             prefix + [rng.randrange(100, 30000) for _ in range(suffix)], 2)
                    if rec.error:
                        raise SystemExit(f"request failed: {rec.error}")
    server = Server("--num-threads", "1")
    try:
        asyncio.run(send_all(server.url))
        with urllib.request.urlopen(f"{server.url}/v1/admin/steps", timeout=30) as resp:
            records = json.loads(resp.read())["data"]
    finally:
        server.stop()
    return records


if __name__ == "__main__":
    sys.exit(main())
