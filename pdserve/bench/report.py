"""Benchmark results: the JSON file, the printed table, the PNG plots, and side-by-side comparisons.

`result.json` holds the run configuration, the workload description (every scaling applied), per rate the
summary (`pdserve.bench.metrics.summarize`) and every request's timeline relative to that run's start, and
the goodput when a rate sweep and SLOs were given. With service tiers (`--tier-mix`), each summary has a
`per_tier` block (see `pdserve.bench.metrics`), judged by the `--service-tier` SLOs kept in `service_tiers`,
and the printed report adds a per-tier table. Plots next to it: `ttft_cdf.png`, `tpot_cdf.png`,
`throughput.png` (output tokens/s per second of the run), and `attainment.png` for a sweep.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pdserve.bench.kv_lifecycle import describe
from pdserve.bench.metrics import RequestRecord, goodput, summarize
from pdserve.bench.run_cost import describe as describe_cost
from pdserve.bench.tier_mix import tier_slos
from pdserve.errors import InvalidRequestError


@dataclass
class BenchResult:
    endpoint: str
    model: str
    workload: str
    label: str
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    workload_description: dict = field(default_factory=dict)
    runs: list[dict] = field(default_factory=list)
    service_tiers: list[str] = field(default_factory=list)  # `--service-tier` specs: per-tier SLOs
    tier_mix: dict[str, float] | None = None  # `--tier-mix`, parsed

    def add_run(self, rate: float | None, records: list[RequestRecord], duration_s: float, start_s: float,
                kv: dict | None = None, cost: dict | None = None) -> None:
        """`kv`: the server's KV delivery outcomes over the run (`pdserve.bench.kv_lifecycle.kv_delta`); `cost`:
        what the run cost (`pdserve.bench.run_cost`; the run has a `cost` entry only when it is known)."""
        summary = summarize(records, duration_s=max(duration_s, 1e-9), slo_ttft_ms=self.slo_ttft_ms,
                            slo_tpot_ms=self.slo_tpot_ms, tier_slos=tier_slos(self.service_tiers))
        self.runs.append({"rate": rate, "summary": summary, "kv": kv,
                          "requests": [_relative(r, start_s) for r in records]})
        if cost is not None:
            self.runs[-1]["cost"] = cost

    @property
    def goodput(self) -> float | None:
        sweep = {r["rate"]: r["summary"]["slo"]["attainment"] for r in self.runs if r["rate"] is not None}
        return goodput(sweep) if len(sweep) > 1 and None not in sweep.values() else None

    def to_dict(self) -> dict:
        return {**asdict(self), "goodput_req_s": self.goodput}


def _relative(r: RequestRecord, t0: float) -> dict:
    d = asdict(r)
    for key in ("start_s", "first_token_s", "end_s"):
        d[key] = None if d[key] is None else d[key] - t0
    d["token_times"] = [t - t0 for t in r.token_times]
    return d


def _records(run: dict) -> list[RequestRecord]:
    return [RequestRecord(**r) for r in run["requests"]]


def _ms(stats: dict, key: str) -> str:
    v = stats.get(key)
    return "-" if v is None else f"{v:.0f}"


def print_table(result: BenchResult, console: Console | None = None) -> None:
    table = Table(title=f"{result.label}: {result.workload} -> {result.endpoint} ({result.model})")
    for col in ("rate", "ok/err/429", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                "ITL p99", "SLO met"):
        table.add_column(col, justify="right")
    for run in result.runs:
        s = run["summary"]
        att = s["slo"]["attainment"]
        counts = f"{s['num_ok']}/{s['num_errors']}/{s.get('num_rejected', 0)}"
        table.add_row("-" if run["rate"] is None else f"{run['rate']:g}", counts,
                      f"{s['request_throughput']:.2f}", f"{s['output_throughput']:.1f}",
                      _ms(s["ttft_ms"], "p50"), _ms(s["ttft_ms"], "p99"), _ms(s["tpot_ms"], "p50"),
                      _ms(s["tpot_ms"], "p99"), _ms(s["itl_ms"], "p99"), "-" if att is None else f"{att:.0%}")
    console = console or Console(width=max(Console().width, 120))
    console.print(table)
    tiers = tier_table(result)
    if tiers is not None:
        console.print(tiers)
        console.print("tiers: 429 = refused on arrival (a miss in 'met'); 'met acc' = SLO met among accepted ones")
    for run in result.runs:
        at = f"rate {run['rate']}: " if run["rate"] else ""
        if run.get("kv"):
            console.print(f"  {at}{describe(run['kv'])}")
        if run.get("cost"):
            console.print(f"  {at}{describe_cost(run['cost'])}")
        for err in run["summary"]["errors"]:
            console.print(f"  errors at rate {run['rate']}: {err['count']} x {err['message']}")
    if result.slo_ttft_ms or result.slo_tpot_ms:
        console.print(f"SLOs: TTFT <= {result.slo_ttft_ms} ms, TPOT <= {result.slo_tpot_ms} ms; "
                      f"goodput (>= 90% meet both): {result.goodput if result.goodput is not None else '-'} req/s")
    console.print("latencies in ms; percentiles are numpy linear interpolation over successful requests")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _slo(slo: dict) -> str:
    return "/".join("-" if v is None else f"{v:g}" for v in (slo["ttft_ms"], slo["tpot_ms"]))


def tier_table(result: BenchResult) -> Table | None:
    """Per rate and service tier: requests, 429 refusals, errors, TTFT/TPOT p50/p90 (ms), the SLO used (ttft/tpot
    ms), attainment over all the tier's requests and over the accepted (non-429) ones ("met acc"), goodput
    (requests meeting the SLO per second). None when no run has `per_tier`."""
    runs = [r for r in result.runs if r["summary"].get("per_tier")]
    if not runs:
        return None
    table = Table(title=f"service tiers: {result.label}")
    for col in ("rate", "tier", "reqs", "429", "err", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90",
                "SLO ms", "met", "met acc", "good/s"):
        table.add_column(col, justify="left" if col == "tier" else "right", no_wrap=True)
    for run in runs:
        for tier, t in run["summary"]["per_tier"].items():
            slo, good = t["slo"], t["goodput_rps"]
            table.add_row("-" if run["rate"] is None else f"{run['rate']:g}", tier, str(t["num_requests"]),
                          str(t["num_rejected"]), str(t["num_errors"]), _ms(t["ttft_ms"], "p50"),
                          _ms(t["ttft_ms"], "p90"), _ms(t["tpot_ms"], "p50"), _ms(t["tpot_ms"], "p90"), _slo(slo),
                          _pct(slo["attainment"]), _pct(slo["attainment_accepted"]),
                          "-" if good is None else f"{good:.2f}")
    return table


def write_result(result: BenchResult, out: Path) -> Path:
    try:
        out.mkdir(parents=True, exist_ok=True)
        path = out / "result.json"
        path.write_text(json.dumps(result.to_dict(), indent=1))
    except OSError as e:
        raise InvalidRequestError(f"cannot write to {out}: {e.strerror or e}", param="output") from e
    _plots(result, out)
    return path


def _plots(result: BenchResult, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(("all" if r["rate"] is None else f"{r['rate']:g} req/s"), _records(r)) for r in result.runs]
    for name, getter, title in (("ttft_cdf", lambda r: r.ttft_s, "TTFT"), ("tpot_cdf", lambda r: r.tpot_s, "TPOT")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, recs in runs:
            _cdf(ax, [v * 1000 for r in recs if r.ok and (v := getter(r)) is not None], label)
        _finish(fig, ax, f"{title} CDF - {result.label}", f"{title} (ms)", "fraction of requests", out / f"{name}.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, recs in runs:
        times = [t for r in recs if r.ok for t in r.token_times]
        if times:
            bins = range(0, int(max(times)) + 2)
            ax.hist(times, bins=list(bins), histtype="step", label=label)
    _finish(fig, ax, f"output throughput - {result.label}", "time since start (s)", "chunks/s", out / "throughput.png")
    sweep = [(r["rate"], r["summary"]["slo"]["attainment"]) for r in result.runs
             if r["rate"] is not None and r["summary"]["slo"]["attainment"] is not None]
    if len(sweep) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([s[0] for s in sweep], [s[1] for s in sweep], marker="o", label=result.label)
        ax.axhline(0.9, linestyle="--", color="gray")
        _finish(fig, ax, "SLO attainment vs rate", "request rate (req/s)", "SLO attainment", out / "attainment.png")


def _cdf(ax, values: list[float], label: str) -> None:
    if values:
        xs = sorted(values)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def _finish(fig, ax, title: str, xlabel: str, ylabel: str, path: Path) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt
    plt.close(fig)


def load_result(path: Path) -> dict:
    path = path / "result.json" if path.is_dir() else path
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequestError(f"cannot read a result from {path}: {e}", param="results") from e


def compare(paths: list[Path], labels: list[str] | None, out: Path | None, console: Console | None = None) -> None:
    results = [load_result(p) for p in paths]
    labels = labels or [r["label"] for r in results]
    table = Table(title="comparison (ms; last rate of each result)")
    for col in ("result", "rate", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                "SLO met", "goodput"):
        table.add_column(col, justify="right")
    for label, res in zip(labels, results):
        run = res["runs"][-1]
        s = run["summary"]
        att = s["slo"]["attainment"]
        table.add_row(label, "-" if run["rate"] is None else f"{run['rate']:g}", f"{s['request_throughput']:.2f}",
                      f"{s['output_throughput']:.1f}", _ms(s["ttft_ms"], "p50"), _ms(s["ttft_ms"], "p99"),
                      _ms(s["tpot_ms"], "p50"), _ms(s["tpot_ms"], "p99"), "-" if att is None else f"{att:.0%}",
                      "-" if res.get("goodput_req_s") is None else f"{res['goodput_req_s']:g}")
    (console or Console(width=max(Console().width, 120))).print(table)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "comparison.json").write_text(json.dumps(
            {"results": [str(p) for p in paths], "labels": labels,
             "summaries": [r["runs"][-1]["summary"] for r in results]}, indent=1))
        _compare_plot(results, labels, out / "compare.png")


def _compare_plot(results: list[dict], labels: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, res in zip(labels, results):
        recs = _records(res["runs"][-1])
        _cdf(axes[0], [r.ttft_s * 1000 for r in recs if r.ok and r.ttft_s is not None], label)
        _cdf(axes[1], [r.tpot_s * 1000 for r in recs if r.ok and r.tpot_s is not None], label)
    for ax, name in zip(axes, ("TTFT (ms)", "TPOT (ms)")):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
