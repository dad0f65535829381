"""Simulator fidelity: the same scaled trace on the real `pdserve serve` and in `pdserve simulate` with the
time model fitted to this machine; relative error of median and P90 TTFT and TPOT (target <= 10%).

    .venv/bin/python benchmarks/bench_fidelity.py [--workload SPEC ...] [--rate 0.5] [--max-requests 40]
                                                 [--repeats 3] [--num-kv-blocks N] [--kv-host-gb G] [--quick]
    make fidelity    # = --quick: a calibration replay and one run of 16 requests, one idle probe per wake gap
                     # (~5 min on 2 cores: the calibration replay for the held-out column adds ~1.6)

This shared 2-core VM changes speed by tens of percent within minutes, so a profile taken once, minutes
before a run, can describe another machine than the one the run met. Hence, through the real command line:
  1. `pdserve profile --num-threads 1` (the workers' thread count in PD mode on 2 cores: one each) over the
     shapes this workload makes (prefill 16..512 tokens, decode batches 1..16 at 64 and 256 tokens), ~40 s,
     before the first run and after each run: P0, run 1, P1, run 2, P2, ...;
  2. each run: `pdserve serve` (1 prefill + 1 decode, shm); a calibration probe at idle (8 back-to-back
     streamed requests of 16 prompt tokens and 2 output tokens, then one such request after the server sat
     idle 0.5, 1, 2, 4 and 8 s, twice each), `pdserve bench serve` of the workload -> real<k>/, the probe
     again;
  3. run k is simulated with `pdserve profile --merge P(k-1) P(k)` (the machine around that run) plus the
     probe's wake-up tables (on this VM an engine idle for seconds runs its next step up to hundreds of ms
     slower): `wake` = how much longer than back-to-back the TTFT after each idle gap was (the prefill
     worker's step), `wake_decode` = the same for the first inter-token gap (the decode worker's step):
     `pdserve simulate --mode pd --prefill 1 --decode 1 --time-model fitted:... --control-latency-ms C` on
     the model's config.json (for KV sizes), the same KV pool size, block size and budgets -> sim<k>/, and
     once more without the wake-up table -> sim<k>_nowake/; C = the back-to-back probe's median latency minus
     the fitted prefill time of 16 tokens, over the 4 gateway <-> worker messages on a PD request's way to
     its first token; and once more with the time model fitted to the steps the real server itself reported
     over the run (`pdserve profile --from-server`, before it stops: timed while both workers ran), with the
     same wake-up tables -> sim<k>_server/ (the "server fit" columns), C there from the back-to-back probe's
     prefill steps as the server reported them (`served_control_latency_ms`);
  3b. before the first profile, a calibration replay of other requests of the workload (`--seed 1`; a trace
     replayed at its own timestamps, as `mooncake:`, gives the same requests: another run of them) -> real0/, its server's step fit with its probe's tables -> server_fit0.json; every run is
     simulated with it too -> sim<k>_heldout/ (the "held out" columns: a fit that never saw the requests it
     predicts, as a user calibrates the twin from yesterday's traffic);
  4. the relative errors of each run and their median over runs -> bench_results/fidelity/fidelity.json,
     with the four KV lifecycle metrics side by side, real (`bench serve`'s scrape of /metrics) and
     simulated (`sim.lifecycle`): schedule predictability (final and at dispatch), effective link
     utilization, P99 inter-token jitter, wasted-transfer rate (`--link-gbps G` throttles the real KV link
     and gives the simulator the same link; `--delivery` both);
     with the drift between consecutive profiles (how far the machine moved during each run) and the real
     runs' own spread (largest / smallest value of each metric over the runs - 1: the noise floor).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from serve_util import Server, wait_for  # noqa: E402

OUT = ROOT / "bench_results" / "fidelity"
PDSERVE = [sys.executable, "-m", "pdserve.cli"]
TRACE = "/work/shared/traces/AzureLLMInferenceTrace_conv_2023.csv"


def run(*args: str) -> None:
    print("$ pdserve", " ".join(args), flush=True)
    subprocess.run([*PDSERVE, *args], check=True)


PROBE_TOKENS, PROBE_REQUESTS, PD_HOPS = 16, 8, 4


WAKE_GAPS, WAKE_REPEATS = (0.5, 1.0, 2.0, 4.0, 8.0), 2


def _probe_request(url: str, rng) -> tuple[float, float]:
    """One streamed request of PROBE_TOKENS prompt tokens and 2 output tokens: (TTFT, the first
    inter-token gap = the decode worker's first step for it), seconds."""
    import asyncio

    import httpx

    from pdserve.bench.client import send_request

    async def send():
        async with httpx.AsyncClient(timeout=60) as client:
            return await send_request(client, url, "SmolLM2-135M-Instruct",
                                      [rng.randrange(100, 30000) for _ in range(PROBE_TOKENS)], 2)
    rec = asyncio.run(send())
    if rec.error or len(rec.token_times) != 2:
        raise SystemExit(f"probe request failed: {rec.error or rec.token_times}")
    return rec.first_token_s - rec.start_s, rec.token_times[1] - rec.token_times[0]


def probe(url: str, repeats: int = WAKE_REPEATS) -> tuple[list, list, list]:
    """The idle real server: (TTFT, first gap) of PROBE_REQUESTS back-to-back probe requests; then, for each
    wake gap, [gap, TTFT, first gap] of one after the server sat idle that long (`repeats` times); and the
    back-to-back requests' prefill steps as the prefill worker reported them (seconds)."""
    import random
    import time
    rng = random.Random(0)
    seen = len(_probe_prefill_steps(url))
    warm = [_probe_request(url, rng) for _ in range(PROBE_REQUESTS)]
    steps = wait_for(lambda: _probe_prefill_steps(url), lambda xs: len(xs) >= seen + PROBE_REQUESTS, 10.0)
    if len(steps) < seen + PROBE_REQUESTS:
        raise SystemExit(f"the probe's {PROBE_REQUESTS} prefill steps were not reported (GET /v1/admin/steps)")
    woken = []
    for gap in WAKE_GAPS:
        for _ in range(repeats):
            time.sleep(gap)
            woken.append([gap, *_probe_request(url, rng)])
    return warm, woken, steps[seen:seen + PROBE_REQUESTS]


def _probe_prefill_steps(url: str) -> list[float]:
    """The seconds of every served pure prefill step of PROBE_TOKENS tokens the server reported so far, oldest
    first."""
    import httpx
    return [r["seconds"] for r in httpx.get(url + "/v1/admin/steps", timeout=10).json()["data"]
            if r["source"] == "served" and r["role"] == "prefill" and r["prefill_tokens"] == PROBE_TOKENS
            and not r["decode_seqs"]]


def control_latency_ms(warm: list, fit: Path) -> float:
    """Per-message control-plane latency: the probe's median TTFT minus the fitted prefill time of its prompt."""
    import statistics
    pre = json.loads(fit.read_text())["prefill"]
    compute = pre["a"] + pre["b"] * PROBE_TOKENS + pre["c"] * PROBE_TOKENS ** 2
    return max(statistics.median(t for t, _ in warm) - compute, 0.0) / PD_HOPS * 1000


def served_wake(fit: dict, wake: dict) -> dict:
    """A served-step fit with the probe's wake-up tables: `wake` as measured; `wake_decode` at least the fit's
    own, the mean extra of the woken decode steps it left out (`pdserve.sim.from_server`), at every gap: the
    probe's table is each woken probe's extra over a back-to-back probe's first step, itself a woken step, so it
    misses the first-step cost the workload's requests pay (quick run at load 3.5: in-sample TPOT p50 17.7% with
    the probe's table alone, 8.6% with this; the fit before woken steps were left out: 7.9%)."""
    own = (fit.get("wake_decode") or [[0.0, 0.0]])[0][1]
    return {**fit, "wake": wake["wake"],
            "wake_decode": [[0.0, own]] + [[gap, max(own, extra)] for gap, extra in wake["wake_decode"]]}


def served_control_latency_ms(warm: list, steps: list[float]) -> float:
    """The same from the probe's prefill steps as the server reported them (the served-step fits' sims): a
    served-step fit's prefill of PROBE_TOKENS tokens is no measure of a back-to-back probe's, as nearly every
    prefill step it fits followed an idle wait (on the conversation workload it came out above the probe's TTFT:
    C = 0, no burst spacing, predictability 0.93 simulated vs 0.81 real; from the reported steps C = 3.5-4.9 ms
    and 0.74-0.79)."""
    import statistics
    return max(statistics.median(t for t, _ in warm) - statistics.median(steps), 0.0) / PD_HOPS * 1000


def wake_tables(warm: list, woken: list) -> dict:
    """The time model's wake-up tables, [[gap, median extra seconds over the back-to-back median]]: `wake` from
    the TTFT (the prefill worker's step after idling `gap`), `wake_decode` from the first inter-token gap
    (the decode worker's first step: its process was busy receiving the KV meanwhile)."""
    import statistics
    out = {}
    for key, col in (("wake", 1), ("wake_decode", 2)):
        base = statistics.median(w[col - 1] for w in warm)
        out[key] = [[gap, max(statistics.median(w[col] for w in woken if w[0] == gap) - base, 0.0)]
                    for gap in WAKE_GAPS]
    return out


PROFILE_SHAPES = ["--prefill-tokens", "16,32,64,128,256,512", "--decode-batches", "1,2,4,8,16",
                  "--decode-contexts", "64,256"]
METRICS = [(m, q) for m in ("ttft_ms", "tpot_ms") for q in ("p50", "p90")]


def drift(before: Path, after: Path) -> dict:
    """How much slower (+) the machine was at the second profile than at the first, per step kind: the
    median ratio of the two profiles' timings of the same shapes."""
    import statistics
    out = {}
    a, b = (json.loads(p.read_text())["samples"] for p in (before, after))
    for kind in ("prefill", "decode"):
        ratios = [y["seconds"] / x["seconds"] for x, y in zip(a, b) if x["kind"] == kind]
        out[kind] = statistics.median(ratios) - 1
    return out


def _delivery_flags(args) -> list[str]:
    return ["--delivery", args.delivery, *(["--link-gbps", str(args.link_gbps)] if args.link_gbps else [])]


def _tier_flags(args) -> list[str]:
    """The KV tiers of both sides (the simulator takes the real server's device pool size in blocks)."""
    return ["--kv-host-gb", str(args.kv_host_gb)] if args.kv_host_gb else []


def real_run(k: int, workload: list[str], args) -> tuple[int, tuple]:
    """Serve and replay the workload once; the KV pool size and the idle probe's latencies. The time model of
    the steps the server reported -> server_fit<k>.json."""
    pool = ["--num-kv-blocks", str(args.num_kv_blocks)] if args.num_kv_blocks else []
    server = Server("--num-threads", "1", *_delivery_flags(args), *pool, *_tier_flags(args))
    repeats = 1 if args.quick else WAKE_REPEATS
    try:
        blocks = int(server.metric("pdserve_kv_blocks_total", worker="decode-0"))
        before = probe(server.url, repeats)
        run("bench", "serve", "--endpoint", server.url, *workload, "--output", str(OUT / f"real{k}"),
            "--no-progress")
        after = probe(server.url, repeats)  # the machine drifts: probe around the run, as the profiles do
        probed = tuple(b + a for b, a in zip(before, after))
        run("profile", "--from-server", server.url, "--output", str(OUT / f"server_fit{k}.json"))
    finally:
        server.stop()
    return blocks, probed


def simulate(name: str, workload: list[str], fit: Path, blocks: int, control_ms: float, args) -> None:
    from pdserve.model.loader import resolve_model_dir
    config = resolve_model_dir(None) / "config.json"
    run("simulate", *workload, "--model", str(config), "--gpu", "l40s", "--time-model", f"fitted:{fit}",
        "--mode", "pd", "--prefill", "1", "--decode", "1", "--block-size", "16", "--num-kv-blocks", str(blocks),
        "--prefill-budget", "2048", "--decode-budget", "2048", "--control-latency-ms", f"{control_ms:.3f}",
        *_delivery_flags(args), *_tier_flags(args), "--output", str(OUT / name), "--no-progress")


def errors(k: int, sim_name: str) -> dict:
    real = json.loads((OUT / f"real{k}" / "result.json").read_text())["runs"][0]["summary"]
    sim = json.loads((OUT / sim_name / "result.json").read_text())["runs"][0]["summary"]
    return {f"{m}.{q}": {"real": real[m][q], "sim": sim[m][q], "rel_error": abs(sim[m][q] - real[m][q]) / real[m][q]}
            for m, q in METRICS}


LIFECYCLE = [("schedule_predictability", "schedule_predictability"),
             ("schedule_predictability_at_dispatch", "schedule_predictability_at_dispatch"),
             ("link_effective_utilization", "effective_link_utilization"),
             ("p99_inter_token_jitter_ms", "p99_inter_token_jitter_ms"), ("wasted_rate", "wasted_transfer_rate")]


def lifecycle(k: int, sim_name: str) -> dict:
    """The four lifecycle metrics of run k, real (from /metrics) and simulated, under one name each."""
    real = json.loads((OUT / f"real{k}" / "result.json").read_text())["runs"][0].get("kv") or {}
    sim = json.loads((OUT / sim_name / "result.json").read_text())["runs"][0]["sim"]["lifecycle"]
    out = {}
    for real_key, sim_key in LIFECYCLE:
        value = real.get(real_key)
        if isinstance(value, dict):  # per link: one link here (1 prefill -> 1 decode)
            value = max(value.values(), default=None)
        out[sim_key] = {"real": value, "sim": sim.get(sim_key)}
    return out


def main() -> int:
    import statistics
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default=f"azure:{TRACE}")
    ap.add_argument("--length-scale", default="0.1")
    ap.add_argument("--rate", default="0.5")
    ap.add_argument("--max-requests", default="40")
    ap.add_argument("--repeats", type=int, default=3, help="real runs, each between two profiles")
    ap.add_argument("--delivery", default="scheduled", choices=["scheduled", "fifo"])
    ap.add_argument("--link-gbps", type=float, default=None, help="throttle the KV link (real and simulated)")
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="the real server's device KV pool (blocks)")
    ap.add_argument("--kv-host-gb", type=float, default=None, help="a host KV tier (real and simulated)")
    ap.add_argument("--output", type=Path, default=None, help="results folder (default bench_results/fidelity)")
    ap.add_argument("--quick", action="store_true",
                    help="a short regression check (make fidelity): a calibration replay and one run of 16 requests, "
                         "one probe per wake gap")
    args = ap.parse_args()
    global OUT
    if args.quick:
        args.repeats, args.max_requests, OUT = 1, "16", OUT.parent / "fidelity_quick"
    OUT = args.output or OUT
    OUT.mkdir(parents=True, exist_ok=True)
    workload = workload_args(args, seed=0)
    profiles = [OUT / f"profile{k}.json" for k in range(args.repeats + 1)]
    held = held_out_fit(workload_args(args, seed=1), args)
    run("profile", "--num-threads", "1", *PROFILE_SHAPES, "--output", str(profiles[0]))
    runs = []
    for k in range(1, args.repeats + 1):
        blocks, (warm, woken, probe_steps) = real_run(k, workload, args)
        run("profile", "--num-threads", "1", *PROFILE_SHAPES, "--output", str(profiles[k]))
        fit = OUT / f"fit{k}.json"
        run("profile", "--merge", str(profiles[k - 1]), str(profiles[k]), "--output", str(fit))
        control_ms = control_latency_ms(warm, fit)
        wake = wake_tables(warm, woken)
        plain = json.loads(fit.read_text())
        fit.write_text(json.dumps({**plain, **wake}, indent=1))
        (OUT / f"fit{k}_nowake.json").write_text(json.dumps(plain, indent=1))
        simulate(f"sim{k}", workload, fit, blocks, control_ms, args)
        simulate(f"sim{k}_nowake", workload, OUT / f"fit{k}_nowake.json", blocks, control_ms, args)
        server_fit = OUT / f"server_fit{k}.json"
        server_fit.write_text(json.dumps(served_wake(json.loads(server_fit.read_text()), wake), indent=1))
        served_ms = served_control_latency_ms(warm, probe_steps)
        simulate(f"sim{k}_server", workload, server_fit, blocks, served_ms, args)
        if held is not None:  # out of sample: the fit of another replay's steps, its probe's tables
            simulate(f"sim{k}_heldout", workload, held[0], blocks, held[1], args)
        runs.append({"control_latency_ms": control_ms, "control_latency_served_ms": served_ms, "probe_s": warm,
                     "probe_prefill_s": probe_steps, "wake_probe_s": woken, "wake": wake,
                     "drift": drift(profiles[k - 1], profiles[k]), "rows": errors(k, f"sim{k}"),
                     "rows_without_wake": errors(k, f"sim{k}_nowake"),
                     "rows_server_fit": errors(k, f"sim{k}_server"), "lifecycle": lifecycle(k, f"sim{k}"),
                     "lifecycle_server_fit": lifecycle(k, f"sim{k}_server"), "token_time": token_time(k),
                     **({} if held is None else {"rows_server_heldout": errors(k, f"sim{k}_heldout"),
                                                 "lifecycle_server_heldout": lifecycle(k, f"sim{k}_heldout")})})
        print_run(k, runs[-1])
    median = {rows: {key: statistics.median(r[rows][key]["rel_error"] for r in runs) for key in runs[0][rows]}
              for rows in ROW_SETS if rows in runs[0]}
    for rows, label in zip(ROW_SETS, ("with the wake-up tables", "without them",
                                      "fitted to the server's own steps (with the wake-up tables)",
                                      "fitted to another replay's steps (held out: seed 1, before the runs)")):
        if rows not in median:
            continue
        print(f"\nmedian relative error over runs, {label}: "
              + ", ".join(f"{key} {e:.1%}" for key, e in median[rows].items()))
    spread = real_spread(runs) if len(runs) > 1 else None
    print("the real system against itself (largest / smallest of the runs - 1): " + (
        ", ".join(f"{key} {e:.1%}" for key, e in spread.items()) if spread else "needs --repeats 2 or more"))
    (OUT / "fidelity.json").write_text(json.dumps({"args": vars(args), "runs": runs,
                                                   "median_rel_error": median["rows"],
                                                   "median_rel_error_without_wake": median["rows_without_wake"],
                                                   "median_rel_error_server_fit": median["rows_server_fit"],
                                                   "median_rel_error_server_heldout": median.get("rows_server_heldout"),
                                                   "real_run_spread": spread}, indent=1, default=str))
    return 0


ROW_SETS = ("rows", "rows_without_wake", "rows_server_fit", "rows_server_heldout")


def token_time(k: int) -> dict:
    """Where run k's per-token time goes (issue 42 item 1), ms: the decode steps the real decode worker ran
    (`served_step`: start to next start, `pdserve.worker.step_times`), the same steps as the offline profile of
    one engine alone predicts them (`alone`: what the other worker on the cores and the loop add is the
    difference), and the real TPOT the client saw (`tpot`: mean over requests, so longer requests count more
    in the steps than here; the output path and held tokens are the rest)."""
    from pdserve.sim.from_server import kind, served_samples
    from pdserve.sim.timemodel import FittedTimeModel
    steps = json.loads((OUT / f"server_fit{k}.json").read_text())["steps"]
    decode = [(s, t) for s, t in served_samples([r for r in steps if r["role"] == "decode"]) if kind(s) == "decode"]
    alone = FittedTimeModel.from_json((OUT / f"fit{k}_nowake.json").read_text())
    real = json.loads((OUT / f"real{k}" / "result.json").read_text())["runs"][0]["summary"]["tpot_ms"]
    mean = (lambda xs: 1000 * sum(xs) / max(len(xs), 1))
    return {"decode_steps": len(decode), "alone_ms": mean([alone.step_time(s) for s, _ in decode]),
            "served_step_ms": mean([t for _, t in decode]), "tpot_mean_ms": real["mean"]}


def workload_args(args, seed: int) -> list[str]:
    """The workload flags `bench serve` and `simulate` share."""
    return ["--workload", args.workload, "--length-scale", args.length_scale, "--rate", args.rate,
            "--max-requests", args.max_requests, "--seed", str(seed)]


def held_out_fit(workload: list[str], args) -> tuple[Path, float]:
    """A calibration replay of other requests of the same workload (seed 1) before the measured runs: the time
    model of the steps its server reported with its probe's wake-up tables -> server_fit0.json, and its
    control-plane latency. Each run is simulated with it too: a fit that never saw the requests it predicts,
    as a user calibrates the twin from yesterday's traffic."""
    _, (warm, woken, steps) = real_run(0, workload, args)
    fit = OUT / "server_fit0.json"
    fit.write_text(json.dumps(served_wake(json.loads(fit.read_text()), wake_tables(warm, woken)), indent=1))
    return fit, served_control_latency_ms(warm, steps)


def real_spread(runs: list[dict]) -> dict:
    """How far the real system's own runs of the same workload lie apart: the noise floor of any error."""
    return {key: max(r["rows"][key]["real"] for r in runs) / min(r["rows"][key]["real"] for r in runs) - 1
            for key in runs[0]["rows"]}


def print_run(k: int, r: dict) -> None:
    d = r["drift"]
    wake = "; ".join(f"{key}: " + ", ".join(f"+{x * 1000:.0f} ms after {g:g} s" for g, x in table)
                     for key, table in r["wake"].items())
    print(f"\nrun {k}: control-plane latency {r['control_latency_ms']:.2f} ms/message (from the probe's reported "
          f"prefill steps {r['control_latency_served_ms']:.2f}); {wake}; machine "
          f"drift over the run: prefill {d['prefill']:+.0%}, decode {d['decode']:+.0%}")
    held = r.get("rows_server_heldout")
    print(f"{'metric':<12}{'real ms':>10}{'sim ms':>10}{'rel. error':>12}{'no wake: sim':>14}{'error':>8}"
          f"{'server fit: sim':>17}{'error':>8}" + (f"{'held out: sim':>15}{'error':>8}" if held else ""))
    for key, row in r["rows"].items():
        name, alt, srv = key.replace("_ms", "").replace(".", " "), r["rows_without_wake"][key], r["rows_server_fit"][key]
        print(f"{name:<12}{row['real']:>10.1f}{row['sim']:>10.1f}{row['rel_error']:>12.1%}{alt['sim']:>14.1f}"
              f"{alt['rel_error']:>8.1%}{srv['sim']:>17.1f}{srv['rel_error']:>8.1%}"
              + (f"{held[key]['sim']:>15.1f}{held[key]['rel_error']:>8.1%}" if held else ""), flush=True)
    t = r["token_time"]
    print(f"where a token's time goes: the {t['decode_steps']} decode steps served {t['served_step_ms']:.1f} ms each "
          f"(an engine alone, the offline profile: {t['alone_ms']:.1f}); client TPOT mean {t['tpot_mean_ms']:.1f} ms")
    fits = [r["lifecycle_server_fit"]] + ([r["lifecycle_server_heldout"]] if held else [])
    print("lifecycle metric (real / simulated / server fit" + (" / held out" if held else "") + "): " + "; ".join(
        f"{key} {_fmt(v['real'])} / {_fmt(v['sim'])} / " + " / ".join(_fmt(f[key]['sim']) for f in fits)
        for key, v in r["lifecycle"].items()), flush=True)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3g}"


if __name__ == "__main__":
    sys.exit(main())
