"""Scheduled vs FIFO KV delivery on a real, shaped link, no `--link-gbps` (issue 39 item 1).

    sudo .venv/bin/python benchmarks/bench_netns_delivery.py [--rates-mbit 200,50] [--repeats 3]

The decode worker runs in a second network namespace joined by a veth pair (`pdserve.bench.netns`, as
`tests/test_netns_serve.py`); the veth's KV direction is shaped with `tc tbf` to each `--rates-mbit` (plus
`--delay-ms` of round trip where the kernel has netem). 1 prefill worker (here) + 1 decode worker (there), tcp
transport, `--link-share priority=0.8,default=0.1,flex=0.1`, one server pair per run; for each rate and repeat
the deliveries run one after the other on the same link. The workload: `--flex` flex prompts of
`--prompt-tokens` tokens at once, then `--priority-after-s` later `--priority` priority prompts of the same
length (distinct token ids: no prefix-cache hits), each streamed with `max_tokens` 4 through the `openai` SDK.

Per run: TTFT (first streamed token after the request went) per tier; the link's wire utilization, from the
veth's own tx byte counter sampled every 50 ms (bytes / (rate x time) from the first to the last sample that
moved more than a tenth of the rate: the busy period); the gateway's `pdserve_kv_link_effective_utilization`
(its median while the link was busy), `pdserve_kv_schedule_predictability{service_tier}` and
`pdserve_kv_wasted_transfer_ratio` at the end (where /metrics has them); KV bytes sent. Prints medians over
the repeats; writes bench_results/netns_delivery.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import statistics
import subprocess
import threading
import time
from pathlib import Path

import openai

from pdserve.bench.netns import Netns, TxSampler, netns, reap
from pdserve.bench.server_proc import free_port
from serve_proc import Server

LINK_SHARE = "priority=0.8,default=0.1,flex=0.1"
SECRET = {"PDSERVE_DEPLOYMENT_SECRET": secrets.token_hex(32)}


class GaugeProbe:
    """The gateway's `pdserve_kv_link_effective_utilization` every 0.25 s (the workers' stats come as often),
    in a thread."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.samples: list[tuple[float, float]] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            v = [v for (n, _), v in self.server.metrics().items() if n == "pdserve_kv_link_effective_utilization"]
            if v:
                self.samples.append((time.monotonic(), v[0]))
            self.stopped.wait(0.25)

    def stop(self) -> GaugeProbe:
        self.stopped.set()
        self.thread.join()
        return self

    def median_within(self, start: float, end: float) -> float | None:
        """Its median from a second into [start, end] (its window has filled a little by then)."""
        inside = [v for t, v in self.samples if start + 1.0 <= t <= end]
        return statistics.median(inside) if inside else None


def prompts(n: int, tokens: int, rng: random.Random) -> list[list[int]]:
    """`n` prompts of `tokens` random token ids (the model's vocabulary is larger): no two share a first block."""
    return [[rng.randrange(1000, 40000) for _ in range(tokens)] for _ in range(n)]


async def _one(client, model: str, prompt: list[int], tier: str, delay_s: float) -> tuple[str, float, float]:
    """-> (tier, TTFT, when it went, relative to the workload's start)."""
    await asyncio.sleep(delay_s)
    sent = time.monotonic()
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, stream=True,
                                             extra_body={"service_tier": tier, "ignore_eos": True})
    ttft = None
    async for _ in stream:
        if ttft is None:
            ttft = time.monotonic() - sent
    return tier, ttft, sent


async def workload(url: str, flex: list, priority: list, after_s: float) -> list[tuple[str, float, float]]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    try:
        model = (await client.models.list()).data[0].id
        jobs = [_one(client, model, p, "flex", 0.0) for p in flex]
        jobs += [_one(client, model, p, "priority", after_s) for p in priority]
        return await asyncio.gather(*jobs)
    finally:
        await client.close()


def start_pair(ns: Netns, delivery: str, log_dir: Path, tag: str) -> tuple[Server, subprocess.Popen]:
    """The decode worker in `ns` joining a gateway (+ its prefill worker) here, over tcp, no --link-gbps."""
    control = free_port()
    with open(log_dir / f"decode-{tag}.log", "w") as wlog:
        worker = ns.join_worker(f"tcp://{ns.host_ip}:{control}", "decode-ns", env=SECRET, log=wlog)
    os.environ.update(SECRET)  # the gateway's process inherits it
    try:
        server = Server(["--transport", "tcp", "--decode", "0", "--control-port", str(control), "--control-host",
                         ns.host_ip, "--data-host", ns.host_ip, "--num-threads", "1", "--delivery", delivery,
                         "--link-share", LINK_SHARE], log_dir / f"serve-{tag}.log")
    except RuntimeError:
        worker.kill()
        raise
    return server, worker


def one_run(ns: Netns, delivery: str, rate_mbit: float, args, seed: int, log_dir: Path) -> dict:
    rng = random.Random(seed)
    flex, priority = prompts(args.flex, args.prompt_tokens, rng), prompts(args.priority, args.prompt_tokens, rng)
    server, worker = start_pair(ns, delivery, log_dir, f"{rate_mbit:g}-{delivery}-{seed}")
    try:
        server.warm_up()
        tx, gauge = TxSampler(ns.link), GaugeProbe(server)
        start = time.monotonic()
        done = asyncio.run(workload(server.url, flex, priority, args.priority_after_s))
        time.sleep(0.6)  # the workers' last stats (every 0.25 s) reach the gateway
        tx.stop(), gauge.stop()
        metrics = server.metrics()
    finally:
        server.stop()
        reap(worker)
    busy_from, busy_to, _ = tx.busy(rate_mbit)
    ttft = {tier: [t for k, t, _ in done if k == tier] for tier in ("priority", "flex")}
    return {"delivery": delivery, "rate_mbit": rate_mbit, "seed": seed,
            "ttft_priority_s": statistics.median(ttft["priority"]), "ttft_priority_max_s": max(ttft["priority"]),
            "ttft_flex_s": statistics.median(ttft["flex"]), "ttft_flex_max_s": max(ttft["flex"]),
            "last_first_token_s": max(s + t for _, t, s in done) - start,
            "wire_utilization": tx.utilization(rate_mbit), "busy_s": busy_to - busy_from,
            "first_tokens": sorted((round(s + t - start, 2), k) for k, t, s in done),
            "effective_utilization_gauge": gauge.median_within(busy_from, busy_to), **_pick(metrics)}


def _pick(metrics: dict) -> dict:
    """What /metrics says at the end of a run (an absent series: None)."""
    def total(name: str) -> float:
        return sum(v for (n, _), v in metrics.items() if n == name)

    def by_tier(name: str) -> dict:
        return {dict(lab).get("service_tier", ""): v for (n, lab), v in metrics.items() if n == name}
    return {"kv_bytes": total("pdserve_kv_link_bytes_total"), "kv_chunks": total("pdserve_kv_link_chunks_total"),
            "predictability": by_tier("pdserve_kv_schedule_predictability") or None,
            "wasted_ratio": by_tier("pdserve_kv_wasted_transfer_ratio").get(""),
            "transfer_failures": total("pdserve_kv_transfer_failures_total"),
            "production_paused_s": total("pdserve_production_paused_seconds_total"),
            "worker_deaths": total("pdserve_worker_deaths_total")}


def _med(rows: list[dict], key: str, tier: str | None = None):
    vals = [r.get(key) if tier is None else (r.get(key) or {}).get(tier) for r in rows]
    vals = [v for v in vals if v is not None and v == v]  # (NaN: nothing to measure)
    return statistics.median(vals) if vals else None


def _fmt(v, spec: str = "{:.2f}") -> str:
    return "-" if v is None else spec.format(v)


COLUMNS = (("TTFT priority s", "ttft_priority_s", None, "{:.2f}"), ("TTFT flex s", "ttft_flex_s", None, "{:.2f}"),
           ("last 1st token s", "last_first_token_s", None, "{:.1f}"),
           ("wire util", "wire_utilization", None, "{:.0%}"),
           ("eff. util gauge", "effective_utilization_gauge", None, "{:.0%}"),
           ("predictable prio", "predictability", "priority", "{:.0%}"),
           ("predictable flex", "predictability", "flex", "{:.0%}"), ("wasted", "wasted_ratio", None, "{:.1%}"),
           ("KV MB", "kv_bytes", None, "{:.0f}"), ("paused s", "production_paused_s", None, "{:.1f}"),
           ("failures", "transfer_failures", None, "{:.0f}"))


def report(rows: list[dict]) -> None:
    """Medians over the repeats, one line per (rate, delivery)."""
    print("| rate Mbit/s | delivery | " + " | ".join(c[0] for c in COLUMNS) + " |")
    for rate in dict.fromkeys(r["rate_mbit"] for r in rows):
        for delivery in dict.fromkeys(r["delivery"] for r in rows):
            rs = [r for r in rows if r["rate_mbit"] == rate and r["delivery"] == delivery]
            cells = []
            for _, key, tier, spec in COLUMNS:
                v = _med(rs, key, tier)
                cells.append(_fmt(v / 1e6 if key == "kv_bytes" and v is not None else v, spec))
            print(f"| {rate:g} | {delivery} | " + " | ".join(cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates-mbit", default="200,50")
    ap.add_argument("--delay-ms", type=float, default=5.0, help="added round trip, where the kernel has netem")
    ap.add_argument("--deliveries", default="scheduled,fifo")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--flex", type=int, default=10)
    ap.add_argument("--priority", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--priority-after-s", type=float, default=2.0)
    ap.add_argument("--out", default="bench_results/netns_delivery.json")
    args = ap.parse_args()
    rows: list[dict] = []
    out = Path(args.out)
    log_dir = out.parent / "netns_delivery_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    with netns() as ns:
        for rate in (float(r) for r in args.rates_mbit.split(",")):
            shaping = ns.shape(rate, args.delay_ms)
            print(f"link: {shaping}", flush=True)
            for seed in range(args.repeats):
                for delivery in args.deliveries.split(","):  # interleaved: drift hits both alike
                    rows.append(one_run(ns, delivery, rate, args, seed, log_dir) | {"shaping": str(shaping)})
                    print(json.dumps(rows[-1]), flush=True)
                    out.write_text(json.dumps({"args": vars(args), "cpu": _cpu(), "runs": rows}, indent=1))
    report(rows)
    return 0


def _cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")


if __name__ == "__main__":
    raise SystemExit(main())
