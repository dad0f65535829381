"""What a KV checkpoint saves when a decode worker dies (issue 15): the stall its streams see, resumed from a
checkpoint vs recomputed, side by side on one host.

Two servers in turn, 1 prefill + 2 decode workers, a disk KV tier each: `--kv-checkpoint-tokens N` (the
checkpoint path) and `--kv-checkpoint-tokens 0` (no checkpoint: the prefill worker recomputes prompt +
outputs). `--streams` greedy streams with long prompts; once every stream has `--kill-at` tokens, kill -9 the
decode worker that has the most of them. Per stream: the longest gap between two chunks (the stall, for the
streams of the killed worker), and whether the text equals the undisturbed run's.

    .venv/bin/python benchmarks/bench_checkpoint.py [--streams 4] [--prompt-words 600] [--tokens 400]
        [--kill-at 300] [--every 32] [--out bench_results/checkpoint.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from chaos import worker_pid  # noqa: E402
from serve_proc import Server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def prompt(i: int, words: int) -> str:
    return f"Report {i}: " + " ".join(f"entry {i}.{k} records value {k * 13 % 97};" for k in range(words // 5))


async def stream(client, url: str, text: str, tokens: int, arrived: list) -> tuple[str, list[float]]:
    body = {"model": MODEL, "prompt": text, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    out, times = "", []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                data = json.loads(line[6:])
                out += data["choices"][0]["text"]
                times.append(time.monotonic())
                arrived.append(1)
    return out, times


async def run(url: str, prompts: list[str], tokens: int, kill=None, kill_at: int = 0):
    counts = [[] for _ in prompts]
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(stream(client, url, p, tokens, c)) for p, c in zip(prompts, counts)]
        if kill is not None:
            while min(len(c) for c in counts) < kill_at:
                await asyncio.sleep(0.02)
            kill()
        return await asyncio.gather(*tasks)


def one_server(args, every: int, prompts: list[str], log_dir: Path) -> dict:
    disk = tempfile.mkdtemp(prefix="pdserve-ckpt-")
    server = Server(["--prefill", "1", "--decode", "2", "--kv-disk-dir", disk, "--kv-checkpoint-tokens", str(every)],
                    log_dir / f"checkpoint_{every}.log")
    try:
        server.warm_up()
        reference = [t for t, _ in asyncio.run(run(server.url, prompts, args.tokens))]
        running = {}

        def kill():
            metrics = server.metrics()
            for name in ("decode-0", "decode-1"):
                running[name] = metrics.get(("pdserve_num_requests_running", (("worker", name),)), 0)
            victim = max(running, key=running.get)
            os.kill(worker_pid(server, victim), signal.SIGKILL)
            running["killed"] = victim

        results = asyncio.run(run(server.url, prompts, args.tokens, kill, args.kill_at))
        stalls = sorted(max(b - a for a, b in zip(times, times[1:])) for _, times in results)
        moved = stalls[-max(int(running[running["killed"]]), 1):]  # the killed worker's streams stalled most
        metrics = server.metrics()
        migrated = {dict(lab)["source"]: v for (n, lab), v in metrics.items()
                    if n == "pdserve_requests_migrated_total"}
        return {"every": every, "killed": running["killed"], "streams_on_it": running[running["killed"]],
                "stall_s_of_moved": moved, "median_stall_s": statistics.median(moved),
                "identical": sum(t == r for (t, _), r in zip(results, reference)), "migrated": migrated}
    finally:
        server.stop()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--prompt-words", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--kill-at", type=int, default=300)
    ap.add_argument("--every", type=int, default=32)
    ap.add_argument("--out", default="bench_results/checkpoint.json")
    args = ap.parse_args()
    out = Path(args.out)
    prompts = [prompt(i, args.prompt_words) for i in range(args.streams)]
    rows = [one_server(args, every, prompts, out.parent) for every in (args.every, 0)]
    report = {"cpu": cpu_name(), "args": vars(args), "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
