"""Simulation results: the bench report (same JSON shape, table and plots) plus the simulator's own metrics.

`SimResult` is a `BenchResult` (so `pdserve bench compare` can read it) with the cluster description; each
run carries a `sim` block next to its bench `summary`:
* `kv`: per role, device KV pool use (peak / mean bytes and fractions) and the KV tiers (the real tier code on
  simulated links): prompt tokens, prefix-hit tokens per tier (`hit_tokens`: device, host, disk), bytes
  written into (`bytes_in`) and read out of (`bytes_out`) each tier, tier capacities and peak use, and the
  busiest engine's share of time each tier link was busy (`link_busy_fraction`: host_link, disk_read,
  disk_write; remote_read, remote_write: its links to the shared pool) and seconds spent loading host hits
  inside steps (`load_s`); each engine's own numbers are under `engines[i].kv_tiers`; with a shared pool
  (`--kv-remote-pool-gb`), `hit_tokens` has a `remote` entry too (prefix hits fetched from it) and `kv_pool`
  holds the pool's own counters (`pdserve.sim.kv_pool.SimKVPool.stats`);
* `transfer`: bytes sent / delivered, per-link utilization over the run and effective utilization while busy;
* `lifecycle`: schedule predictability (share of delivered KV blocks first consumed within +-5 ms of the
  conductor's prediction; also per service tier), effective link bandwidth utilization, P99 inter-token
  jitter (|gap - the request's mean gap|, pooled; also per service tier), wasted-transfer rate (bytes
  delivered but never consumed / bytes delivered): the definitions and code of the gateway's windowed gauges
  (`pdserve.core.lifecycle_metrics`), over the whole run; production paused by backpressure, prompts staged
  while their decode engine had no room;
* `cost`: GPU-hours and USD per 1k output tokens and per 1k tokens (prompt + output);
* `engines`: steps, fast-forwarded steps, busy share, prefix hits, preemptions and prefill yields (by tier)
  per engine.
The result's `feasibility` holds what share of the workload no deployment can serve and why, and the best SLO
attainment possible (`pdserve.sim.feasibility`).
Per-request token times are cut to the first and last in result.json (the summary used all of them).

Service tiers: records tagged with a `service_tier` (and `rejected` for refusals) give each summary a
`per_tier` block, judged by the SLOs in `SimResult.service_tiers` (the `--service-tier` specs, inherited from
`BenchResult`; pass `service_tiers=args.service_tier, tier_mix=...` when building the result). The per-tier
table is printed by `pdserve.bench.report.print_table` (which `pdserve simulate` prints before the simulator
tables), built by `pdserve.bench.report.tier_table(result)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from pdserve.bench.metrics import jitter_p99_ms, jitter_p99_ms_by_tier, tier_order
from pdserve.bench.report import BenchResult, write_result
from pdserve.core.cost import usd, usd_per_1k
from pdserve.core.kvstore.kv_meta import STORAGE_TIERS
from pdserve.core.lifecycle_metrics import wasted_ratio
from pdserve.sim.cluster import SimRun
from pdserve.sim.conductor import CONSUME_TOLERANCE_S


@dataclass
class SimResult(BenchResult):
    cluster: dict = field(default_factory=dict)
    # the share of the workload no deployment can serve and why, the best attainment possible
    # (`pdserve.sim.feasibility.Feasibility.to_dict`)
    feasibility: dict = field(default_factory=dict)


def lifecycle(run: SimRun) -> dict:
    """The lifecycle metrics over the run, by the definitions and code of the gateway's windowed gauges
    (`pdserve.core.lifecycle_metrics`), plus the simulator's own link and production counters."""
    life, links, checks = run.life, run.links, run.life.checks
    busy = sum(v["busy_s"] for v in links.values())
    bw_busy = sum(v["bytes"] / v["effective_utilization"] for v in links.values() if v["effective_utilization"])
    wasted = wasted_ratio(life.bytes_delivered, life.bytes_delivered - life.bytes_consumed)
    demand_capacity = sum(v["bandwidth"] * v["demand_s"] for v in links.values())
    now = run.duration_s  # (a window of the whole run: every check counts)
    return {
        "schedule_predictability": checks.predictability_all(now),
        "schedule_predictability_at_prefilled": checks.predictability_all(now, "at_prefilled"),
        "schedule_predictability_at_dispatch": checks.predictability_all(now, "at_dispatch"),
        "schedule_predictability_by_tier": _by_tier(checks.predictability(now)),
        "predictability_tolerance_ms": CONSUME_TOLERANCE_S * 1000,
        "prediction_abs_error_ms": _abs_ms(life.errors_s),
        "prediction_abs_error_at_dispatch_ms": _abs_ms(life.dispatch_errors_s),
        # useful (not wasted) bytes / capacity while the links had a backlog (more to carry than they did)
        "effective_link_utilization": (sum(v["demand_bytes"] for v in links.values()) * (1 - (wasted or 0.0))
                                       / demand_capacity) if demand_capacity else None,
        "link_utilization_while_busy": (sum(v["bytes"] for v in links.values()) / bw_busy) if bw_busy else None,
        "link_demand_s": sum(v["demand_s"] for v in links.values()),
        "link_busy_s": busy,
        "p99_inter_token_jitter_ms": jitter_p99_ms(run.records),
        "p99_inter_token_jitter_ms_by_tier": jitter_p99_ms_by_tier(run.records),
        "wasted_transfer_rate": wasted,
        "transfers": life.transfers, "transfer_failures": life.transfer_failures, "aborted": life.aborted,
        "production_paused_s": life.production_paused_s,
        "production_paced": dict(life.production_paced), "staged_prompts": life.staged,
        "idle_prewarms": life.idle_prewarms,
    }


def _by_tier(values: dict) -> dict:
    return {t: values[t] for t in sorted(values, key=tier_order)}


def _abs_ms(errors: list) -> dict | None:
    if not errors:
        return None
    e = np.abs(np.asarray(errors)) * 1000
    return {"p50": float(np.percentile(e, 50)), "p90": float(np.percentile(e, 90))}


LINKS = ("host_link", "disk_read", "disk_write", "remote_read", "remote_write")
REMOTE = "remote"  # the shared pool's key in `hit_tokens` (not a storage tier of one worker: `kv_meta.STORAGE_TIERS`)


def _sum(es, key: str) -> dict:
    tiers = (*STORAGE_TIERS, REMOTE) if key == "hit_tokens" and REMOTE in es[0]["kv_tiers"][key] else STORAGE_TIERS
    return {t: sum(e["kv_tiers"][key][t] for e in es) for t in tiers}


def _kv(run: SimRun) -> dict:
    out = {}
    for role in sorted({e["role"] for e in run.engines}):
        es = [e for e in run.engines if e["role"] == role]
        tiers = [e["kv_tiers"] for e in es]
        ios = [t["io"] for t in tiers if t["io"] is not None]
        out[role] = {"engines": len(es),
                     "device_peak_fraction": max(e["device_kv"]["peak_fraction"] for e in es),
                     "device_mean_fraction": float(np.mean([e["device_kv"]["mean_fraction"] for e in es])),
                     "device_capacity_bytes": es[0]["device_kv"]["capacity_bytes"],
                     "host_capacity_bytes": tiers[0]["capacity_bytes"]["host"],
                     "disk_capacity_bytes": tiers[0]["capacity_bytes"]["disk"],
                     "host_peak_bytes": max(t["peak_bytes"]["host"] for t in tiers),
                     "disk_peak_bytes": max(t["peak_bytes"]["disk"] for t in tiers),
                     "host_written_bytes": sum(t["bytes_in"]["host"] for t in tiers),
                     "prompt_tokens": sum(e["prompt_tokens"] for e in es),
                     "hit_tokens": _sum(es, "hit_tokens"),
                     "bytes_in": _sum(es, "bytes_in"), "bytes_out": _sum(es, "bytes_out"),
                     "link_busy_fraction": {k: max(io["utilization"][k] for io in ios) for k in LINKS} if ios
                     else None,
                     "load_s": sum(io["load_s"] for io in ios)}
    return out


def hit_shares(kv_role: dict) -> dict:
    """Prefix-hit tokens per tier as shares of the role's prompt tokens."""
    n = kv_role["prompt_tokens"]
    return {t: hits / n if n else 0.0 for t, hits in kv_role["hit_tokens"].items()}


def sim_metrics(run: SimRun, num_gpus: int, price_per_gpu_hour: float) -> dict:
    ok = [r for r in run.records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    all_tokens = out_tokens + sum(r.prompt_tokens for r in ok)
    cost = usd(num_gpus, run.duration_s, price_per_gpu_hour)
    return {
        "kv": _kv(run),
        "transfer": {"bytes_sent": run.life.bytes_sent, "bytes_delivered": run.life.bytes_delivered,
                     "links": run.links},
        "lifecycle": lifecycle(run),
        "cost": {"gpus": num_gpus, "price_per_gpu_hour": price_per_gpu_hour, "usd": cost,
                 "usd_per_1k_output_tokens": usd_per_1k(cost, out_tokens),
                 "usd_per_1k_tokens": usd_per_1k(cost, all_tokens)},
        "engines": run.engines,
        "kv_pool": run.kv_pool,
        "simulator": {"wall_s": run.wall_s, "speedup": run.duration_s / run.wall_s, "events": run.num_events},
    }


def add_run(result: SimResult, rate: float | None, run: SimRun, num_gpus: int, price: float) -> None:
    result.add_run(rate, run.records, run.duration_s, 0.0)
    entry = result.runs[-1]
    for r in entry["requests"]:
        r["token_times"] = r["token_times"][:1] + r["token_times"][-1:] if len(r["token_times"]) > 2 else r[
            "token_times"]
    entry["sim"] = sim_metrics(run, num_gpus, price)


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def print_sim_table(result: SimResult, console: Console | None = None) -> None:
    table = Table(title=f"simulator: {result.label}")
    for col in ("rate", "KV peak (role)", "link util", "eff. link util", "predictable", "jitter p99 ms",
                "wasted xfer", "$/1k out tok", "sim speedup"):
        table.add_column(col, justify="right")
    for run in result.runs:
        s = run["sim"]
        kv = ", ".join(f"{k} {v['device_peak_fraction']:.0%}" for k, v in s["kv"].items())
        links = s["transfer"]["links"].values()
        util = float(np.mean([v["utilization"] for v in links])) if links else None
        life, cost = s["lifecycle"], s["cost"]
        jit = life["p99_inter_token_jitter_ms"]
        per_1k = cost["usd_per_1k_output_tokens"]
        table.add_row("-" if run["rate"] is None else f"{run['rate']:g}", kv, _pct(util),
                      _pct(life["effective_link_utilization"]), _pct(life["schedule_predictability"]),
                      "-" if jit is None else f"{jit:.1f}", _pct(life["wasted_transfer_rate"]),
                      "-" if per_1k is None else f"{per_1k:.4f}", f"{s['simulator']['speedup']:.0f}x")
    console = console or Console(width=max(Console().width, 120))
    console.print(table)
    line = kv_cache_line(result.cluster)
    if line:
        console.print(line)
    console.print(_tier_table(result))


def kv_cache_line(cluster: dict) -> str | None:
    """One line on the KV codec: bytes per token, pool blocks per engine, any fitted-model scaling."""
    if "kv_cache_dtype" not in cluster:
        return None
    blocks, bs = cluster["kv_pool_blocks"], cluster.get("block_size", 0)
    line = (f"KV cache {cluster['kv_cache_dtype']}: {cluster['kv_bytes_per_token']} bytes/token, "
            f"{blocks} blocks ({blocks * bs} tokens) per engine, dequant +{cluster['kv_dequant_overhead']:.0%} "
            "of KV reads")
    scaling = cluster.get("time_model_kv_scaling")
    if scaling:
        line += (f"; fitted time model measured with {scaling['measured']}: its cached-KV terms (decode context, "
                 f"prefill prefix) x{scaling['decode_context_scale']:.3f}")
    return line


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f}"


def _tier_table(result: SimResult) -> Table:
    """Per rate and role: prefix hits by tier (share of prompt tokens; the shared pool's too, where there is
    one), peak / capacity of host and disk, and how busy the busiest engine's tier links were."""
    table = Table(title=f"KV tiers: {result.label}")
    pool = any(run["sim"].get("kv_pool") for run in result.runs)
    for col in ("rate", "role", "hits device", "hits host", "hits disk", *(("hits pool",) if pool else ()),
                "host GB peak/cap", "disk GB peak/cap", "PCIe busy", "disk rd/wr busy",
                *(("pool rd/wr busy",) if pool else ())):
        table.add_column(col, justify="right")
    for run in result.runs:
        for role, v in run["sim"]["kv"].items():
            share, busy = hit_shares(v), v["link_busy_fraction"]
            table.add_row("-" if run["rate"] is None else f"{run['rate']:g}", role,
                          *(_pct(share.get(t)) for t in (*STORAGE_TIERS, *((REMOTE,) if pool else ()))),
                          f"{_gb(v['host_peak_bytes'])}/{_gb(v['host_capacity_bytes'])}",
                          f"{_gb(v['disk_peak_bytes'])}/{_gb(v['disk_capacity_bytes'])}",
                          "-" if busy is None else _pct(busy["host_link"]),
                          "-" if busy is None else f"{_pct(busy['disk_read'])}/{_pct(busy['disk_write'])}",
                          *((_pool_busy(busy),) if pool else ()))
    return table


def _pool_busy(busy: dict | None) -> str:
    return "-" if busy is None else f"{_pct(busy['remote_read'])}/{_pct(busy['remote_write'])}"


def write_sim_result(result: SimResult, out: Path) -> Path:
    path = write_result(result, out)
    _kv_plot(result, out / "kv_usage.png")
    return path


def _kv_plot(result: SimResult, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = result.runs[-1]
    fig, ax = plt.subplots(figsize=(7, 4))
    for e in run["sim"]["engines"]:
        if e["kv_series"]:
            t, used = zip(*e["kv_series"])
            ax.plot(t, [u / e["num_blocks"] for u in used], label=e["name"], linewidth=0.8)
    ax.set_title(f"device KV pool use - {result.label}")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("fraction of the pool")
    ax.grid(alpha=0.3)
    if len(run["sim"]["engines"]) <= 8:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
