"""What a worker reports in its `stats` event (every 0.25 s), with the engine steps it ran since the last one
(`steps`: `pdserve.core.sched.online_fit.StepRow.reported`; the conductor's admission model fits step times to
them)."""

from __future__ import annotations

import time


def worker_stats(w) -> dict:
    """A worker's `stats` event's values (`pdserve.conductor.wire.Stats`): its scheduler, KV pool and tiers, delivery (prefill) and reception (decode)."""
    from pdserve.core.kvstore import native
    from pdserve.model import kernels
    from pdserve.transfer.kv_seal import protection_report
    sched, blocks = w.engine.scheduler, w.engine.block_manager
    out = {"running": sched.num_running, "waiting": sched.num_waiting,
           "waiting_for_kv": sched.num_waiting_for_kv, "blocks_used": blocks.num_used_blocks,
           "blocks_total": blocks.num_blocks, "prompt_tokens": sched.stats.num_prompt_tokens,
           "prefix_hit_tokens": sched.stats.num_prefix_hit_tokens,
           "prompt_tokens_computed": sched.stats.num_prompt_tokens_computed, "preemptions": sched.stats.num_preemptions,
           "preemptions_by_tier": dict(sched.stats.preemptions_by_tier),
           "prefill_yields_by_tier": dict(sched.stats.prefill_yields_by_tier), "steps": w.step_times.take(),
           "kernel_fallbacks": kernels.fallback_count(), "native_fallbacks": native.fallback_count(),
           "weights_cache": getattr(w.executor, "weights_cache", {}),
           "grammar_errors": getattr(getattr(w.executor, "grammar", None), "errors", 0),
           "kv_pool_prefault_fallbacks": int(getattr(w.executor.kv_pool, "prefault_failed", False)),
           "kv_residual_evictions": getattr(getattr(w.executor, "residual", None), "evictions", 0),
           "kv": w.engine.kv_report(),
           "rejected_connections": {"control": w.cmd_refusals.count(),
                                    **(w.decode.receiver.rejected_connections if w.decode else {})},
           "pinned_blocks": blocks.num_pinned_blocks, "prefill_cap": sched.step_budget.last_cap,
           "capped_steps": sched.step_budget.num_capped_steps, "bad_commands": w.bad_commands,
           "step_budget_cold_starts": sched.step_budget.num_cold_start_steps,
           "tier_weights": sched.weights.report() if sched.weights is not None else {},
           "calibration": {"source": w.calibration.source, "steps": len(w.calibration.steps),
                           "fallbacks": w.calibration.fallbacks}}
    if w.prefill is not None:
        box = w.prefill.outbox
        breakers, shut = breaker_report(w.prefill)
        links = box.link_report()
        for link in shut & links.keys():
            links[link]["path_open"] = True  # the conductor pairs this worker with another decode worker
        out.update(kv_bytes_sent=box.bytes_sent, kv_send_failures=dict(w.prefill.failures),
                   kv_transfers_lent=len(w.prefill.lent), kv_chunks_in_place=box.chunks_in_place,
                   kv_chunks_payload=box.chunks_payload,
                   kv_keepalives_sent=w.prefill.keepalives_sent, kv_links=links, kv_path_breakers=breakers,
                   kv_grace_pins=w.prefill.grace_pins,
                   kv_wire_bytes={f"{tier}:{fmt}": n for (tier, fmt), n in w.prefill.wire_bytes.items()},
                   production_paused_s=w.prefill.paused_s, production_paced=dict(w.prefill.pace_counts),
                   kv_wasted_bytes=dict(w.prefill.wasted_bytes),
                   kv_staged_now=len(w.prefill.stages.staged),
                   kv_path_transfers=dict(getattr(w.prefill.sender, "transfers", {})),
                   kv_path_failovers=getattr(w.prefill.sender, "failovers", 0),
                   kv_protected_bytes=protection_report(w.prefill.sender)[0])
    if w.decode is not None:
        st = w.decode.stats
        out.update(kv_bytes_received=st.bytes_received, kv_chunks_transcoded=st.chunks_transcoded,
                   kv_failures=dict(st.failures),
                   kv_wasted_bytes=dict(st.wasted_bytes),
                   kv_late_chunks=w.decode.inbound.num_late_chunks,
                   kv_lease_renewals=w.decode.inbound.num_renewals,
                   pending_reservations=len(w.decode.pending),
                   kv_checkpoint_fallbacks=st.checkpoint_fallbacks,
                   kv_auth_failures=protection_report(w.decode.receiver)[1])
    cadence = getattr(w, "cadence", None)
    if cadence is not None:  # --decode-cadence steady
        out.update(cadence.stats())
    return out


def breaker_report(prefill) -> tuple[dict, set[str]]:
    """A prefill worker's KV path breakers (`pdserve.core.pd.breaker`) by receiving worker: ({"peer|path":
    {state, transitions}}, the receivers with no path that takes a transfer now)."""
    breakers = getattr(prefill.sender, "breakers", None)
    if breakers is None:
        return {}, set()
    names = prefill.peers  # receiver address -> worker name
    report = {}
    for key, value in breakers.report().items():
        dest, _, path = key.rpartition("|")
        report[f"{names.get(dest, dest)}|{path}"] = value
    return report, {names.get(d, d) for d in breakers.open_dests(time.monotonic())}
