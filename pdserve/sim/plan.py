"""`pdserve plan`: the cheapest deployment that meets the SLOs at the target rate on a GPU budget.

Candidates are every TP degree in `--tp-options` that fits the model, and for each every P/D split of every
engine count whose GPUs fit in `--gpus` (plus colocated deployments with `--include-colocated`). They are
simulated cheapest first (fewest GPUs; at equal cost, the split the role planner picks for the workload first
— `pdserve.core.role_planner`, the code `--role-switching auto` moves workers with — then more decode engines
first); the first one whose SLO
attainment reaches `--attainment` wins, and its simulated evidence is printed. A rate sweep (`--rates`)
requires every swept rate to pass. `--kv-cache-dtype` codes every candidate's KV (pool, links, tiers).

Before the search it prints what share of the workload no candidate can serve and why, hence the best
attainment possible (`pdserve.sim.feasibility`); a verdict without a winner gives the best attainment reached
against it and what would change it. With `--output`, plan.json holds the bound, every candidate simulated and
the verdict (and result.json the winner's evidence).
"""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pdserve.errors import InvalidRequestError
from pdserve.sim.hardware import get_gpu, get_model, kv_pool_blocks
from pdserve.sim.runs import cluster_spec, run_spec, workloads_at_rates


def candidates(args) -> list[tuple[str, int, int, int]]:
    """(mode, tp, prefill engines, decode or colocated engines), cheapest first."""
    model, gpu = get_model(args.model, getattr(args, "kv_cache_dtype", "auto")), get_gpu(args.gpu)
    out = []
    for tp in sorted({int(t) for t in args.tp_options.split(",") if t.strip()}):
        try:
            kv_pool_blocks(model, gpu, tp, args.block_size)
        except InvalidRequestError:
            continue  # weights do not fit at this TP
        for engines in range(1, args.gpus // tp + 1):
            if args.include_colocated:
                out.append(("colocated", tp, 0, engines))
            out.extend(("pd", tp, p, engines - p) for p in range(1, engines))
    return sorted(out, key=lambda c: ((c[2] + c[3]) * c[1], -c[3], c[1]))


def planner_split(args, workload, tp: int, engines: int) -> tuple[int, float]:
    """The role planner's split of `engines` PD engines for `workload` (`pdserve.core.role_planner`, the code
    `--role-switching auto` moves workers with): its token rates against one engine's capacity per role, from
    the time model -> (prefill engines, the busier role's utilization)."""
    from pdserve.core.role_planner import RoleLoad, best_split, utilization
    from pdserve.sim.timemodel import StepShape, make_time_model
    model, gpu = get_model(args.model, getattr(args, "kv_cache_dtype", "auto")), get_gpu(args.gpu)
    tm = make_time_model(args.time_model, model, gpu, tp)
    reqs = workload.requests
    span = max(reqs[-1].arrival_s - reqs[0].arrival_s, 1e-9) if len(reqs) > 1 else 1.0
    prompt = sum(r.input_len for r in reqs) / len(reqs)
    output = sum(r.output_len for r in reqs) / len(reqs)
    chunk, each = args.prefill_budget, min(args.prefill_budget, int(prompt))  # a chunk of prompts of `each`
    prefill_s = tm.step_time(StepShape(chunk, chunk * each, chunk * (each + 1) // 2, chunk, 0, 0, chunk // each))
    batch = args.max_num_seqs
    decode_s = tm.step_time(StepShape.decode(batch, int(batch * (prompt + output / 2))))
    load = RoleLoad(len(reqs) * prompt / span, len(reqs) * output / span, chunk / prefill_s, batch / decode_s)
    p = best_split(engines, load)
    return p, utilization(load, p, engines - p)


def plan(args) -> int:
    from pdserve.sim.feasibility import advice_lines, from_args, summary_lines

    if args.slo_ttft_ms is None and args.slo_tpot_ms is None:
        raise InvalidRequestError("plan needs --slo-ttft-ms and/or --slo-tpot-ms")
    rates, workloads = workloads_at_rates(args)
    console = Console(width=max(Console().width, 120))
    cands = candidates(args)
    # the largest prefill chunk any candidate's engines take: colocated engines prefill in their step budget
    budget = max(args.prefill_budget, args.decode_budget if args.include_colocated else 0)
    feas = from_args(args, workloads[-1], {c[1] for c in cands}, budget)
    for line in summary_lines(feas):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    table = Table(title=f"plan: {args.model} on <= {args.gpus} x {args.gpu}")
    for col in ("mode", "tp", "P", "D/N", "GPUs", "SLO met (worst rate)", "verdict"):
        table.add_column(col, justify="right")
    winner, rows = _search(args, console, table, cands, workloads, rates)
    console.print(table)
    best = max(rows, key=lambda r: r["attainment"], default=None)
    if winner is not None:
        winner.feasibility = feas.to_dict()
        console.print(f"cheapest deployment meeting the SLOs: {winner.label} ({winner.cluster['num_gpus']} GPUs)")
        _evidence(args, console, winner)
        verdict = [f"cheapest deployment meeting the SLOs: {winner.label}"]
    else:
        reached = f": the best reached {best['attainment']:.1%} ({best['label']})" if best else ""
        verdict = [f"no deployment within {args.gpus} GPUs meets the SLOs at attainment >= {args.attainment:.0%}"
                   f"{reached}, of {feas.best_attainment:.1%} possible",
                   *advice_lines(feas, best["attainment"] if best else 0.0, args.attainment, args.gpus)]
        for line in verdict:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    if args.output:
        _write_plan(Path(args.output), feas, rows, verdict)
    return 0 if winner is not None else 1


def _search(args, console: Console, table: Table, cands: list, workloads: list, rates: list):
    """Simulate the candidates cheapest first (at equal cost, the role planner's split first) until one meets
    the SLOs -> (its `SimResult` or None, a row per candidate simulated)."""
    preferred, rows = {}, []
    for tp, n in sorted({(c[1], c[2] + c[3]) for c in cands if c[0] == "pd" and c[2] + c[3] > 1}):
        preferred[(tp, n)], util = planner_split(args, workloads[-1], tp, n)
        console.print(f"role planner's split of {n} engines at TP {tp}: {preferred[(tp, n)]}P{n - preferred[(tp, n)]}D"
                      f" (busier role {util:.0%} busy at the highest rate)")
    order = sorted(cands, key=lambda c: ((c[2] + c[3]) * c[1], preferred.get((c[1], c[2] + c[3])) != c[2]))
    for mode, tp, p, d in order:
        # (role switching moves engines between prefill and decode: colocated candidates have none to move)
        spec = cluster_spec(args if mode == "pd" else Namespace(**{**vars(args), "role_switching": "off"}),
                            mode, tp, p or 1, d, d)
        result = run_spec(args, spec, workloads, rates, f"{mode} tp{tp} {p}P{d}D" if mode == "pd" else
                          f"colocated tp{tp} x{d}")
        worst = min(r["summary"]["slo"]["attainment"] for r in result.runs)
        ok = worst >= args.attainment
        table.add_row(mode, str(tp), str(p) if mode == "pd" else "-", str(d), str(spec.num_gpus), f"{worst:.1%}",
                      "MEETS" if ok else "misses")
        rows.append({"label": result.label, "gpus": spec.num_gpus, "attainment": worst, "meets": ok})
        if ok:
            return result, rows
    return None, rows


def _evidence(args, console: Console, result) -> None:
    from pdserve.bench.report import print_table
    from pdserve.sim.report import print_sim_table, write_sim_result
    print_table(result, console)
    print_sim_table(result, console)
    if args.output:
        console.print(f"wrote {write_sim_result(result, Path(args.output))}")


def _write_plan(out: Path, feas, rows: list[dict], verdict: list[str]) -> None:
    """plan.json: the bound on attainment (`pdserve.sim.feasibility`), every candidate simulated, the verdict."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps({"feasibility": feas.to_dict(), "candidates": rows,
                                                   "verdict": verdict}, indent=1))
    except OSError as e:
        raise InvalidRequestError(f"cannot write to {out}: {e.strerror or e}", param="output") from e
