"""Role switching on the real server: a load that shifts from prompt-heavy to output-heavy half-way, on every
fixed P/D split of 3 workers and with `--role-switching auto` from each.

    .venv/bin/python benchmarks/bench_role_switching_serve.py [--half-s 60] [--rate-prompts 1.2] [--rate-outputs 3]

`pdserve serve` (default model, 1 torch thread per worker, `--max-num-seqs 4`; auto: `--role-switch-hold-s 10
--role-switch-cooldown-s 40`), an open-loop client (`pdserve.bench.client`): for `--half-s`, 1,500-token prompts
with 8 output tokens at `--rate-prompts` requests/s, then for `--half-s`, 32-token prompts with 96 output
tokens at `--rate-outputs` requests/s. Per run: SLO attainment (TTFT <= `--slo-ttft-ms`, TPOT <=
`--slo-tpot-ms`), goodput (requests meeting it per second of the run), TTFT p50/p90, and the moves made
(`pdserve_role_switches_total`). Writes bench_results/role_switching_serve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time
from pathlib import Path

import httpx
import psutil

from pdserve.bench.client import send_request
from pdserve.bench.metrics import summarize
from serve_proc import Server


def schedule(args) -> list[tuple[float, int, int]]:
    """(send at, prompt tokens, output tokens), Poisson arrivals in each half."""
    rng, out, t = random.Random(0), [], 0.0
    for start, rate, prompt, output in ((0.0, args.rate_prompts, 1500, 8), (args.half_s, args.rate_outputs, 32, 96)):
        t = start
        while True:
            t += rng.expovariate(rate)
            if t >= start + args.half_s:
                break
            out.append((t, prompt, output))
    return out


async def run_load(url: str, plan: list[tuple[float, int, int]]) -> tuple[list, float]:
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.monotonic()

        async def one(i: int, at: float, prompt: int, output: int):
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            tokens = [1000 + (i * 7919 + k) % 30000 for k in range(prompt)]  # distinct prompts: no prefix hits
            return await send_request(client, url, "SmolLM2-135M-Instruct", tokens, output)

        records = await asyncio.gather(*(one(i, *p) for i, p in enumerate(plan)))
        return list(records), time.monotonic() - start


class PlannerView(threading.Thread):
    """Samples the role planner's gauges (`pdserve_role_*`, by role) every `every_s` while the load runs:
    [seconds, {metric: {role: value}}] rows, empty under --role-switching off."""

    def __init__(self, server, every_s: float = 5.0) -> None:
        super().__init__(daemon=True)
        self.server, self.every_s, self.samples = server, every_s, []
        self._done = threading.Event()
        self.start()

    def run(self) -> None:
        start = time.monotonic()
        while not self._done.wait(self.every_s):
            view: dict = {}
            for (name, labels), value in self.server.metrics().items():
                if name.startswith("pdserve_role_") and not name.startswith(("pdserve_role_switches",
                                                                             "pdserve_role_move_seconds")):
                    view.setdefault(name.removeprefix("pdserve_role_"), {})[dict(labels).get("role")] = round(value, 2)
            if view:
                self.samples.append([round(time.monotonic() - start, 1), view])

    def stop(self) -> None:
        self._done.set()
        self.join()


def peak_rss_gb(pid: int) -> dict[str, float]:
    """Peak resident memory (VmHWM, GiB) of the server's processes still running, by command line's worker name."""
    out = {}
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            cmd = proc.cmdline()  # a worker: python -m pdserve.worker.worker SPEC_JSON
            name = json.loads(cmd[-1])["name"] if "pdserve.worker.worker" in cmd else "gateway"
            peak = next(int(line.split()[1]) for line in open(f"/proc/{proc.pid}/status") if line.startswith("VmHWM"))
        except (psutil.Error, OSError, StopIteration, ValueError, KeyError):
            continue
        out[name] = round(peak / 2**20, 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--half-s", type=float, default=60.0)
    ap.add_argument("--rate-prompts", type=float, default=1.2)
    ap.add_argument("--rate-outputs", type=float, default=3.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=5000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=250.0)
    ap.add_argument("--hold-s", type=float, default=10.0, help="--role-switch-hold-s of the auto runs")
    ap.add_argument("--cooldown-s", type=float, default=40.0, help="--role-switch-cooldown-s of the auto runs")
    ap.add_argument("--splits", default="1,2", help="prefill workers of the runs' starting splits (of 3)")
    ap.add_argument("--modes", default="off,auto", help="--role-switching values to run")
    args = ap.parse_args()
    plan = schedule(args)
    rows = []
    for switching in args.modes.split(","):
        for p in (int(x) for x in args.splits.split(",")):
            extra = ["--role-switching", "auto", "--role-switch-hold-s", f"{args.hold_s:g}",
                     "--role-switch-cooldown-s", f"{args.cooldown_s:g}"] if switching == "auto" else []
            server = Server(["--prefill", str(p), "--decode", str(3 - p), "--num-threads", "1", "--max-num-seqs", "4",
                             *extra], Path(f"bench_results/role_switching_{p}P{3 - p}D_{switching}.log"))
            try:
                server.warm_up()
                sampler = PlannerView(server)
                records, duration = asyncio.run(run_load(server.url, plan))
                sampler.stop()
                seen = server.metrics()
                moves = {dict(lab).get("role"): v for (n, lab), v in seen.items() if n == "pdserve_role_switches_total"}
                took = {dict(lab)["role"]: v for (n, lab), v in seen.items() if n == "pdserve_role_move_seconds_sum"}
                move_s = {role: round(t / seen[("pdserve_role_move_seconds_count", (("role", role),))], 1)
                          for role, t in took.items() if seen.get(("pdserve_role_move_seconds_count", (("role", role),)))}
                rss = peak_rss_gb(server.proc.pid)
            finally:
                server.stop()
            s = summarize(records, duration_s=duration, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
            att = s["slo"]["attainment"] or 0.0
            rows.append({"start": f"{p}P{3 - p}D", "role_switching": switching, "attainment": att,
                         "goodput_rps": att * s["num_requests"] / duration, "duration_s": duration,
                         "errors": s["num_errors"], "ttft_p50_ms": s["ttft_ms"]["p50"],
                         "ttft_p90_ms": s["ttft_ms"]["p90"], "moves": moves, "move_s": move_s, "peak_rss_gb": rss,
                         "planner": sampler.samples})
            r = rows[-1]
            print(f"{r['start']} {switching:>4}  attainment {att:.1%}  goodput {r['goodput_rps']:.3f}/s  run "
                  f"{duration:.0f} s  errors {r['errors']}  TTFT p50 {r['ttft_p50_ms'] / 1e3:.1f} s p90 "
                  f"{r['ttft_p90_ms'] / 1e3:.1f} s  moves {moves} (mean s per move {move_s})  peak RSS {rss}", flush=True)
    out = Path("bench_results")
    out.mkdir(exist_ok=True)
    (out / "role_switching_serve.json").write_text(json.dumps({"args": vars(args), "requests": len(plan),
                                                               "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
