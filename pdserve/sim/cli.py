"""`pdserve simulate` and `pdserve plan`. Wire into the main CLI with `add_sim_parsers(sub)`.

The workload flags are `pdserve bench serve`'s own argparse actions (copied from that parser, not
redefined), and the workload for each rate is built by the same helper, so a spec means the same thing to
the load generator and to the simulator.

    python -m pdserve.sim.cli simulate --workload mooncake:trace.jsonl --model llama-3-70b --gpu h100 --tp 4 \\
        --mode pd --prefill 8 --decode 8 --slo-ttft-ms 2000 --slo-tpot-ms 100 --output out/
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdserve.errors import InvalidRequestError

# Old spellings of `pdserve simulate` flags -> the field whose flag (as `pdserve serve`'s) replaced them; they
# still work and warn.
DEPRECATED_FLAGS = {"--host-kv-gb": "kv_host_gb", "--disk-kv-gb": "kv_disk_gb"}

# `pdserve bench serve` flags that describe the workload and the report; shared, not redefined.
WORKLOAD_FLAGS = ("workload", "rate", "rates", "arrival", "cv", "num_requests", "length_scale", "time_scale",
                  "max_requests", "max_input_len", "max_output_len", "block_tokens", "seed", "slo_ttft_ms",
                  "slo_tpot_ms", "label", "output", "no_progress", "tier_mix", "service_tier")


def _bench_actions() -> dict[str, argparse.Action]:
    from pdserve.bench.cli import add_bench_parser
    root = argparse.ArgumentParser()
    add_bench_parser(root.add_subparsers())
    bench = root._subparsers._group_actions[0].choices["bench"]  # noqa: SLF001 - argparse has no public walk
    serve = bench._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001
    return {a.dest: a for a in serve._actions}  # noqa: SLF001


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    actions = _bench_actions()
    for dest in WORKLOAD_FLAGS:
        parser._add_action(actions[dest])  # noqa: SLF001


def spec_default(name: str):
    """A simulate flag's default: its `ClusterSpec` field's (declared there once)."""
    from pdserve.core.settings import default_of
    from pdserve.sim.cluster import ClusterSpec
    return default_of(ClusterSpec, name)


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    from pdserve.core.settings import (AdmissionSettings, CadenceSettings, CodecSettings, DeliverySettings,
                                       KvBlockSettings, RoutingSettings)
    from pdserve.flags import add_config_args
    from pdserve.sim.cluster import SIM_KV_TIERS
    p.add_argument("--model", required=True, help="preset (llama-3-8b, llama-2-70b, llama-3-70b, qwen2.5-7b, "
                   "qwen2.5-32b) or a Hugging Face config.json path")
    p.add_argument("--gpu", default="h100", help="a100-80g | a800 | h100 | h200 | l40s")
    p.add_argument("--time-model", default="roofline", help="roofline | fitted:PATH.json")
    add_config_args(p, KvBlockSettings)
    add_config_args(p, CodecSettings)
    p.add_argument("--max-num-seqs", type=int, default=spec_default("max_num_seqs"))
    p.add_argument("--tier-weights", default=spec_default("tier_weights"), choices=("dynamic", "static"),
                   help="the elastic tiers' weights: dynamic (SLO slack, queue age, transfer progress, decode load: "
                        "pdserve.core.sched.tier_weights) or static (as configured)")
    p.add_argument("--prefill-budget", type=int, default=spec_default("prefill_budget"),
                   help="token budget per prefill step")
    p.add_argument("--decode-budget", type=int, default=spec_default("decode_budget"),
                   help="token budget per decode/colocated step")
    p.add_argument("--link-latency-us", type=float, default=spec_default("link_latency_s") * 1e6)
    p.add_argument("--control-latency-ms", type=float, default=spec_default("control_latency_s") * 1e3,
                   help="each gateway <-> worker message (command, reply, token event), and the spacing of a "
                        "burst's messages through a serial loop (the gateway's intake of requests of one instant, a "
                        "decode worker's take-in of the transfers one prefill step closes); measure it on the real "
                        "system, e.g. as benchmarks/bench_fidelity.py does")
    add_config_args(p, SIM_KV_TIERS, deprecated=DEPRECATED_FLAGS)
    p.add_argument("--host-link-gb-s", type=float, default=None,
                   help="GPU <-> host copy bandwidth per GPU, GB/s each way (default: the GPU preset's PCIe rate)")
    p.add_argument("--disk-read-gb-s", type=float, default=None,
                   help="disk tier read bandwidth per GPU, GB/s (default: the preset's NVMe rate)")
    p.add_argument("--disk-write-gb-s", type=float, default=None,
                   help="disk tier write bandwidth per GPU, GB/s (default: the preset's NVMe rate)")
    p.add_argument("--kv-remote-pool-gb", type=float, default=spec_default("kv_remote_pool_gb"),
                   help="one KV pool shared by every engine, below their host tiers (as --kv-remote: Mooncake "
                        "Store), GiB in all (0: none). Host blocks are written through to it; a prefix an engine's "
                        "own tiers miss is probed there and fetched into host")
    p.add_argument("--kv-remote-gbps", type=float, default=spec_default("kv_remote_gbps"),
                   help="each engine's link to the shared pool, Gbit/s each way (default: the engine's port, "
                        "--link-gbps or tp x the GPU preset's)")
    p.add_argument("--kv-remote-rtt-us", type=float, default=spec_default("kv_remote_rtt_us"),
                   help="one shared-pool operation's round trip: a probe takes this, a fetch or publish this plus "
                        "its bytes over the link")
    p.add_argument("--ttft-timeout-s", type=float, default=None, help="clients abort without a first token by then")
    p.add_argument("--transfer-failure-rate", type=float, default=spec_default("transfer_failure_rate"),
                   help="share of KV transfers that fail")
    p.add_argument("--no-fast-forward", action="store_true", help="step every decode step one by one")
    p.add_argument("--price-per-gpu-hour", type=float, default=None, help="USD; default: the GPU table's")
    # the simulator has no per-worker request cap: the real Admission's default applies
    add_config_args(p, AdmissionSettings, skip=frozenset({"max_outstanding"}))
    add_config_args(p, DeliverySettings)
    add_config_args(p, CadenceSettings)
    add_config_args(p, RoutingSettings)
    p.add_argument("--role-switch-s", type=float, default=spec_default("role_switch_s"),
                   help="a moved engine is out this long after it drained (weights reloaded)")


def add_sim_parsers(sub) -> None:
    sim = sub.add_parser("simulate", help="replay a workload on a simulated cluster (real scheduler, modelled GPUs)")
    add_workload_flags(sim)
    add_cluster_flags(sim)
    from pdserve.sim.cluster import MODES
    sim.add_argument("--tp", type=int, default=spec_default("tp"), help="tensor parallelism per engine")
    sim.add_argument("--mode", default=spec_default("mode"), choices=MODES)
    sim.add_argument("--prefill", type=int, default=spec_default("num_prefill"), help="prefill engines (pd)")
    sim.add_argument("--decode", type=int, default=spec_default("num_decode"), help="decode engines (pd)")
    sim.add_argument("--instances", type=int, default=spec_default("num_instances"), help="engines (colocated)")
    sim.set_defaults(func=cmd_simulate)
    plan = sub.add_parser("plan", help="cheapest P/D split and TP meeting SLOs at a rate on a GPU budget")
    add_workload_flags(plan)
    add_cluster_flags(plan)
    plan.add_argument("--gpus", type=int, required=True, help="GPU budget")
    plan.add_argument("--tp-options", default="1,2,4,8", help="comma-separated TP degrees to try")
    plan.add_argument("--attainment", type=float, default=0.9, help="required share of requests meeting the SLOs")
    plan.add_argument("--include-colocated", action="store_true", help="also try colocated deployments")
    plan.set_defaults(func=cmd_plan)


def check_kv_cache_dtype(args) -> None:
    """A bad --kv-cache-dtype (or tier codec) fails before any work, in one line."""
    from pdserve.core.settings import CodecSettings, pick
    pick(CodecSettings, args)


def cmd_simulate(args: argparse.Namespace) -> int:
    from pdserve.bench.report import print_table
    from pdserve.sim.report import print_sim_table, write_sim_result

    from pdserve.bench.tier_mix import tier_flags
    from pdserve.sim.feasibility import from_args as feasibility_from_args, summary_lines
    from pdserve.sim.runs import cluster_spec, run_spec, workloads_at_rates
    tier_flags(args)  # bad tier flags fail before any work
    check_kv_cache_dtype(args)
    spec = cluster_spec(args, args.mode, args.tp, args.prefill, args.decode, args.instances)  # bad flags: before work
    rates, workloads = workloads_at_rates(args)
    feas = feasibility_from_args(args, workloads[-1], [spec.tp],
                                 args.prefill_budget if args.mode == "pd" else args.decode_budget)
    print("\n".join(summary_lines(feas)))
    label = args.label or (Path(args.output).name if args.output else f"{args.mode} {spec.num_gpus}x{args.gpu}")
    result = run_spec(args, spec, workloads, rates, label)
    result.feasibility = feas.to_dict()
    print_table(result)
    print_sim_table(result)
    for run in result.runs:
        if run["summary"]["slo"]["attainment"] is not None:
            at = "" if run["rate"] is None else f" at {run['rate']:g} req/s"
            print(f"SLO attainment{at}: {run['summary']['slo']['attainment']:.1%} of "
                  f"{feas.best_attainment:.1%} possible")
    if args.output:
        print(f"wrote {write_sim_result(result, Path(args.output))}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from pdserve.sim.plan import plan
    from pdserve.sim.runs import cluster_spec
    check_kv_cache_dtype(args)
    cluster_spec(args, "pd", 1)  # bad cluster flags fail before any work, in one line
    return plan(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    add_sim_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
