"""A simulation run from the flags of `pdserve simulate` and `pdserve plan`: the cluster they describe, the
workload at each rate, and the run of one cluster over them (a `SimResult`). Below both commands' modules
(`pdserve.sim.cli`, `pdserve.sim.plan`), which import it."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pdserve.bench.cli import _rates, _workload_at
from pdserve.bench.tier_mix import tier_flags, workload_tiers
from pdserve.sim.cluster import ClusterSpec, simulate
from pdserve.sim.hardware import get_gpu, get_model, kv_pool_blocks
from pdserve.sim.report import SimResult, add_run
from pdserve.sim.timemodel import make_time_model


def cluster_spec(args, mode: str, tp: int, prefill: int = 1, decode: int = 1, instances: int = 1):
    """The `ClusterSpec` the flags describe, of `mode` at TP `tp` with these engine counts."""
    return ClusterSpec(mode=mode, num_prefill=prefill, num_decode=decode, num_instances=instances, tp=tp,
                       block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                       prefill_budget=args.prefill_budget, decode_budget=args.decode_budget, routing=args.routing,
                       link_latency_s=args.link_latency_us * 1e-6, host_kv_gb=args.kv_host_gb,
                       disk_kv_gb=args.kv_disk_gb, kv_eviction_policy=args.kv_eviction_policy,
                       kv_placement=args.kv_placement, kv_max_age_s=args.kv_max_age_s,
                       kv_host_cache_dtype=args.kv_host_cache_dtype, kv_disk_cache_dtype=args.kv_disk_cache_dtype,
                       host_link_gb_s=args.host_link_gb_s, disk_read_gb_s=args.disk_read_gb_s,
                       disk_write_gb_s=args.disk_write_gb_s,
                       kv_remote_pool_gb=args.kv_remote_pool_gb, kv_remote_gbps=args.kv_remote_gbps,
                       kv_remote_rtt_us=args.kv_remote_rtt_us,
                       control_latency_s=args.control_latency_ms * 1e-3,
                       fast_forward=not args.no_fast_forward, ttft_timeout_s=args.ttft_timeout_s,
                       transfer_failure_rate=args.transfer_failure_rate, seed=args.seed,
                       service_tiers=tuple(args.service_tier or ()), admission=args.admission,
                       admission_margin=args.admission_margin, delivery=args.delivery,
                       link_share=args.link_share, link_gbps=args.link_gbps,
                       delivery_backlog_s=args.delivery_backlog_s, kv_wire_dtype=args.kv_wire_dtype,
                       tier_weights=args.tier_weights, decode_cadence=args.decode_cadence,
                       idle_prewarm=args.idle_prewarm,
                       role_switching=args.role_switching, role_switch_s=args.role_switch_s)


def run_spec(args, spec, workloads: list, rates: list, label: str):
    """Simulate `spec` on each workload; returns the `SimResult`."""
    model, gpu = get_model(args.model, args.kv_cache_dtype), get_gpu(args.gpu)
    time_model = make_time_model(args.time_model, model, gpu, spec.tp)
    price = args.price_per_gpu_hour if args.price_per_gpu_hour is not None else gpu.price_per_hour
    mix, _ = tier_flags(args)
    result = SimResult(endpoint="simulator", model=model.name, workload=args.workload, label=label,
                       service_tiers=list(args.service_tier or ()), tier_mix=mix,
                       slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                       workload_description=workloads[0].description,
                       cluster={**vars(spec), "gpu": gpu.name, "num_gpus": spec.num_gpus,
                                "time_model": args.time_model, **kv_cache_info(model, gpu, spec, time_model)})
    for i, (rate, wl) in enumerate(zip(rates, workloads)):
        with Progress(TextColumn(f"{label} rate {rate or '-'}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), disable=args.no_progress) as bar:
            task = bar.add_task("sim", total=len(wl))
            run = simulate(wl, spec, model, gpu, time_model, block_tokens=args.block_tokens,
                           prompt_seed=args.seed + 7919 * i,
                           progress=lambda n, t: bar.update(task, completed=n),
                           tiers=workload_tiers(mix, len(wl), args.seed) if mix else None)
            bar.update(task, completed=len(wl))
        add_run(result, rate, run, spec.num_gpus, price)
    return result


def kv_cache_info(model, gpu, spec, time_model) -> dict:
    """What the KV codec makes of the cluster: bytes per token, blocks per engine, the fitted model's scaling."""
    info = {"kv_cache_dtype": model.kv_cache_dtype, "kv_bytes_per_token": model.kv_bytes_per_token,
            "kv_dequant_overhead": model.kv_dequant_overhead,
            "kv_pool_blocks": spec.num_kv_blocks or kv_pool_blocks(model, gpu, spec.tp, spec.block_size,
                                                                   max_num_seqs=spec.max_num_seqs)}
    scaling = getattr(time_model, "meta", {}).get("kv_codec_scaling")
    return {**info, "time_model_kv_scaling": scaling} if scaling else info


def workloads_at_rates(args) -> tuple[list, list]:
    """(rates, the workload at each): `pdserve bench`'s workload flags, one workload per swept rate."""
    rates = _rates(args)
    return rates, [_workload_at(args, r) for r in rates]
