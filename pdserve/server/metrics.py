"""Prometheus metrics of a deployment, all named `pdserve_*`, in one registry owned by the gateway.

Per-request latencies are observed by the gateway; worker state (running/waiting requests, KV block usage,
prefix-cache hits, KV transfer bytes and failures) comes from the workers' periodic `stats` events and
their per-request `prefilled` / `transfer` events. Counters that workers keep as running totals are turned
into increments here.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.core.cost import CostMeter
from pdserve.core.pd.breaker import STATE_CODES
from pdserve.core.lifecycle_metrics import LifecycleWindow

LINK_WINDOW_S = 10.0  # the window of pdserve_kv_link_utilization
LIFECYCLE_WINDOW_S = 60.0  # the window of the lifecycle gauges (`pdserve.core.lifecycle_metrics`)

# actual - predicted first consumption: "on time" is within +-5 ms (pdserve.conductor.consumption)
_ERROR_BUCKETS = (-10.0, -1.0, -0.25, -0.1, -0.05, -0.025, -0.005, 0.005, 0.025, 0.05, 0.1, 0.25, 1.0, 10.0)
_TTFT_ERROR_BUCKETS = (-10.0, -5.0, -2.5, -1.0, -0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                       10.0)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, prices: dict[str, float] | None = None) -> None:
        """`prices`: USD per worker-hour by role (`--price-per-hour`); None or empty: cost is not measured."""
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Time to first token", ["service_tier"],
                              registry=r, buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Time between consecutive output tokens",
                             ["service_tier"], registry=r, buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Request arrival to last token", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.queue = Histogram("pdserve_request_queue_time_seconds", "Time waiting before first scheduled",
                               ["worker_role"], registry=r, buckets=_LATENCY_BUCKETS)
        self.prefill = Histogram("pdserve_request_prefill_time_seconds", "First scheduled to prompt computed",
                                 ["worker_role"], registry=r, buckets=_LATENCY_BUCKETS)
        self.kv_transfer_time = Histogram("pdserve_kv_transfer_time_seconds",
                                          "Per-request KV delivery, reservation to settled", ["outcome"],
                                          registry=r, buckets=_LATENCY_BUCKETS)
        self.kv_transfer_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes delivered and verified",
                                         ["worker"], registry=r)
        self.kv_transcoded = Counter("pdserve_kv_chunks_transcoded", "KV chunks a decode worker received in another "
                                     "KV format than its pool's (--decode-kv-cache-dtype) and transcoded",
                                     ["worker"], registry=r)
        self.kv_transfer_failures = Counter("pdserve_kv_transfer_failures", "Failed KV deliveries (outcome held: "
                                            "its lease lapsed, the conductor decides; once per transfer)",
                                            ["reason", "outcome"], registry=r)
        self.kv_chunks = Counter("pdserve_kv_chunks_sent", "KV chunks a prefill worker sent: in_place = the decode "
                                 "worker copied them from its shared pool; payload = the bytes travelled",
                                 ["worker", "mode"], registry=r)
        self.kv_wasted = Counter("pdserve_kv_wasted_bytes", "KV bytes a decode worker received (verified) and "
                                 "never consumed: its transfer failed (failed_timeout, failed_peer, ...) or its "
                                 "request was aborted first; or a prefill worker staged and never delivered "
                                 "(stage_aborted, stage_evicted)", ["reason"], registry=r)
        self.kv_link_util = Gauge("pdserve_kv_link_utilization", "Share of the last LINK_WINDOW_S seconds a prefill "
                                  "worker spent sending KV chunks on a link (prefill worker -> decode worker)",
                                  ["link"], registry=r)
        self.kv_link_effective = Gauge("pdserve_kv_link_effective_utilization", "KV bytes a link carried "
                                       "over the last LINK_WINDOW_S seconds / (its capacity x the time it had "
                                       "something to send); capacity: --link-gbps, else the transport's measured "
                                       "rate", ["link"], registry=r)
        self.kv_link_bytes = Counter("pdserve_kv_link_bytes", "KV chunk bytes sent on a link", ["link"], registry=r)
        self.kv_link_chunks = Counter("pdserve_kv_link_chunks", "KV chunks sent on a link (bytes / chunks: the "
                                      "chunk size, smaller while the link is congested)", ["link"], registry=r)
        self._link_history: dict[str, deque] = {}  # link -> (monotonic time, its running totals)
        self.tier_weight = Gauge("pdserve_tier_weight", "An elastic service tier's weight on a worker now: its configured "
                                 "weight x the dynamic factor (pdserve.core.sched.tier_weights)",
                                 ["worker", "service_tier"], registry=r)
        self.tier_weight_input = Gauge("pdserve_tier_weight_input", "The inputs of an elastic tier's dynamic weight: "
                                       "slack_s (least time left before a waiting request's TTFT SLO), queue_age_s, "
                                       "held_share (waiting requests whose KV link is held), decode_load",
                                       ["worker", "service_tier", "input"], registry=r)
        self.kv_wire_bytes = Counter("pdserve_kv_wire_bytes", "KV chunk bytes queued for the links, by service tier "
                                     "and the format they travel in (--kv-wire-dtype)", ["service_tier", "format"],
                                     registry=r)
        self.kv_consumption_error = Histogram(
            "pdserve_kv_consumption_error_seconds", "Per delivered KV block: its first consumption by a decode "
            "step minus the conductor's (final, refined) prediction of it", ["service_tier"], registry=r,
            buckets=_ERROR_BUCKETS)
        self.kv_consumption_error_at_prefilled = Histogram(
            "pdserve_kv_consumption_error_at_prefilled_seconds", "As pdserve_kv_consumption_error_seconds, against "
            "the prediction made when the prompt was prefilled (before the link's later re-estimates)",
            ["service_tier"], registry=r, buckets=_ERROR_BUCKETS)
        self.kv_prediction_refinements = Counter(
            "pdserve_kv_prediction_refinements", "Consumption predictions refined again after the prompt was "
            "prefilled: its link's landing estimate moved (another transfer became due there)", ["service_tier"],
            registry=r)
        self.kv_consumption_error_at_dispatch = Histogram(
            "pdserve_kv_consumption_error_at_dispatch_seconds", "As pdserve_kv_consumption_error_seconds, against "
            "the prediction made when the prefill was dispatched", ["service_tier"], registry=r,
            buckets=_ERROR_BUCKETS)
        self._lifecycle_gauges(r, prices)
        self.kv_renewals = Counter("pdserve_kv_lease_renewals", "Leases of KV deliveries renewed by their sender's "
                                   "alive records (queued or producing at a live prefill worker)", ["worker"],
                                   registry=r)
        self.kv_lent = Gauge("pdserve_kv_transfers_lent", "Transfers whose blocks a prefill worker still holds "
                             "for a reader", ["worker"], registry=r)
        self.requests = Counter("pdserve_requests", "Finished requests", ["finish_reason", "service_tier"],
                                registry=r)
        self.slo_attained = Counter("pdserve_slo_attained", "Requests that met their service tier's TTFT and "
                                    "TPOT SLOs (tiers without an SLO: every finished request)", ["service_tier"],
                                    registry=r)
        self.predicted_ttft = Histogram("pdserve_admission_predicted_ttft_seconds", "Admission's predicted time "
                                        "to first token of arriving requests (compare with the TTFT histogram)",
                                        ["service_tier"], registry=r, buckets=_LATENCY_BUCKETS)
        self.prediction_error = Histogram(
            "pdserve_admission_prediction_error_seconds", "Per admitted request with a TTFT prediction: its time to "
            "first token at the conductor minus admission's prediction of it (signed: > 0, later than predicted)",
            ["service_tier"], registry=r, buckets=_TTFT_ERROR_BUCKETS)
        self.calibration_steps = Gauge("pdserve_worker_calibration_steps", "Profile steps a worker's time model "
                                       "started with (source: profiled at its start, cached from an earlier one, "
                                       "off: --calibration off)", ["worker", "source"], registry=r)
        self.admission_rejected = Counter("pdserve_admission_rejected", "Requests refused on arrival: "
                                          "slo_ttft / slo_tpot (predicted SLO miss), queue_full, "
                                          "server_overloaded (--max-queue), no_worker",
                                          ["service_tier", "reason"], registry=r)
        self.backlog = Gauge("pdserve_prefill_backlog_tokens", "Prompt tokens routed to a worker and not yet "
                             "prefilled (the conductor's view; admission's queueing input), by tier class",
                             ["worker", "tier_class"], registry=r)
        self.prefill_cap = Gauge("pdserve_step_prefill_cap_tokens", "Prefill tokens a worker's next step may "
                                 "carry: the token budget, lowered by the tiers' TPOT and TTFT SLOs "
                                 "(pdserve.core.sched.step_budget)", ["worker"], registry=r)
        self.capped_steps = Counter("pdserve_step_prefill_capped", "Steps whose prefill tokens were capped to keep "
                                    "the tiers' TPOT / TTFT SLOs", ["worker"], registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens served", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Output tokens served", registry=r)
        self.running = Gauge("pdserve_num_requests_running", "Requests in the running batch", ["worker"], registry=r)
        self.waiting = Gauge("pdserve_num_requests_waiting", "Requests waiting (queue, blocks, or KV delivery)",
                             ["worker"], registry=r)
        self.blocks_used = Gauge("pdserve_kv_blocks_used", "KV blocks held by live requests (cached-but-free "
                                 "blocks count as free)", ["worker"], registry=r)
        self.blocks_total = Gauge("pdserve_kv_blocks_total", "KV blocks in the pool", ["worker"], registry=r)
        self.prefix_hits = Counter("pdserve_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache, "
                                   "by the KV tier they were found in", ["worker", "tier"], registry=r)
        self.tier_blocks = Gauge("pdserve_kv_tier_blocks", "KV blocks per tier and lifecycle stage",
                                 ["worker", "tier", "stage"], registry=r)
        self.tier_capacity = Gauge("pdserve_kv_tier_capacity_blocks", "KV blocks each tier can hold",
                                   ["worker", "tier"], registry=r)
        self.tier_bytes = Counter("pdserve_kv_tier_bytes", "KV bytes written into (in) or read out of (out) a "
                                  "tier", ["worker", "tier", "direction"], registry=r)
        self.tier_corrupt = Counter("pdserve_kv_tier_corrupt", "KV blocks found damaged in a tier and dropped "
                                    "(never served)", ["worker", "tier"], registry=r)
        self.tier_moves = Counter("pdserve_kv_tier_moves", "KV blocks moved between tiers (pdserve.core.kvstore."
                                  "kv_placement): promotion (up; stage active: a request's hit, decay: ahead of an "
                                  "expected use), demotion (left a tier, lives on below) or drop (left with no copy "
                                  "below, dst none), by the block's lifecycle stage then",
                                  ["worker", "kind", "stage", "src", "dst"], registry=r)
        self.kv_prefetch = Counter("pdserve_kv_prefetch_blocks", "KV blocks moved up ahead of an expected use "
                                   "(--kv-placement staged): issued, used (read by a request since) or wasted "
                                   "(evicted or lapsed unread)", ["worker", "outcome"], registry=r)
        self.prefix_queries = Counter("pdserve_prefix_cache_query_tokens", "Prompt tokens looked up in the "
                                      "prefix cache", ["worker"], registry=r)
        self.prompt_computed = Counter("pdserve_prompt_tokens_computed", "Prompt tokens a worker ran through the "
                                       "model (not found in its prefix cache, not delivered to it)", ["worker"],
                                       registry=r)
        self.preemptions = Counter("pdserve_preemptions", "Requests preempted (recompute): a running request "
                                   "that could not grow, or the priority tier taking its share back",
                                   ["worker", "service_tier"], registry=r)
        self.prefill_yields = Counter("pdserve_prefill_yields", "Steps a running prefill let a higher-ranked "
                                      "arrival go first at a chunk boundary (keeping its blocks; it gets what "
                                      "the arrival leaves of the step)",
                                      ["worker", "service_tier"], registry=r)
        self.kv_staged = Counter("pdserve_kv_staged", "Prompts computed ahead on their prefill worker while "
                                 "their decode worker had no room (their KV kept in its cache and host tier)",
                                 ["service_tier"], registry=r)
        self.kv_staged_now = Gauge("pdserve_kv_staged_prompts", "Prompts a prefill worker staged and has not "
                                   "delivered yet", ["worker"], registry=r)
        self.kv_leases_lapsed = Counter("pdserve_kv_leases_lapsed", "KV transfers whose prefill worker sent nothing "
                                        "for --kv-timeout-s (the worker is passed by until it reports again)",
                                        ["worker"], registry=r)
        self.kv_lease_extensions = Counter("pdserve_kv_lease_extensions", "Lapsed KV leases renewed because "
                                           "their prefill worker's process was heard meanwhile (busy, not hung)",
                                           ["worker"], registry=r)
        self.kv_path_transfers = Counter("pdserve_kv_path_transfers", "KV transfers a prefill worker started, by "
                                         "the transport path chosen for them (--transport auto)", ["worker", "path"],
                                         registry=r)
        self.kv_path_state = Gauge("pdserve_kv_path_state", "A prefill worker's KV path breaker to a decode worker "
                                   "(0 closed, 1 half-open: one probe goes, 2 open: it takes no new transfers)",
                                   ["worker", "peer", "path"], registry=r)
        self.kv_path_transitions = Counter("pdserve_kv_path_transitions", "KV path breaker transitions, by the "
                                           "state entered", ["worker", "peer", "path", "to"], registry=r)
        self.kv_send_failures = Counter("pdserve_kv_send_failures", "KV transfers a prefill worker's sends failed, "
                                        "by reason (path_open: refused at once by an open breaker; send_timeout: "
                                        "a send or connect failed or passed its bounded deadline)",
                                        ["worker", "reason"], registry=r)
        self.kv_protected_bytes = Counter("pdserve_kv_protected_bytes", "KV payload bytes a prefill worker sent, by "
                                          "path and protection (aead: encrypted and authenticated, mac: "
                                          "authenticated, plain: neither; by sensitivity label and whether the "
                                          "path crosses hosts)", ["path", "mode"], registry=r)
        self.kv_auth_failures = Counter("pdserve_kv_auth_failures", "KV records a decode worker refused: tampered, "
                                        "replayed, reordered, foreign or protected less than their label asks "
                                        "(their transfer fails; the prompt is recomputed)", ["path"], registry=r)
        self.kv_idle_prewarms = Counter("pdserve_kv_idle_prewarms", "Hot prompt prefixes an idle prefill worker "
                                        "computed ahead (outcome: done or dropped)", ["worker", "outcome"],
                                        registry=r)
        self.fallbacks = Counter("pdserve_fallbacks", "Fallbacks taken, by kind", ["kind"], registry=r)
        self.routing_prefix_disagreements = Counter(
            "pdserve_routing_prefix_disagreements", "Routed requests whose chosen worker's cached prefix, as the "
            "gateway guessed it (what it sent there), differs from the worker's own kv_cache reports", ["role"],
            registry=r)
        self.routing_reported_blocks = Gauge(
            "pdserve_routing_reported_blocks", "KV blocks a worker holds by its own kv_cache reports, as routing "
            "knows them", ["worker", "tier"], registry=r)
        self.conductor_stale_events = Counter(
            "pdserve_conductor_stale_events", "Worker events the conductor had nothing to do with: for a request "
            "it no longer tracks (ended, or moved off that worker) or a transfer it replaced, by event type",
            ["event"], registry=r)
        self.production_paused = Counter("pdserve_production_paused_seconds", "Time a prefill worker produced no "
                                         "KV although it had prompts, because its links had more queued than "
                                         "--delivery-backlog-s of sending (backpressure)", ["worker"], registry=r)
        self.cadence_held = Counter("pdserve_decode_cadence_held_seconds", "Time a decode worker held its steps' "
                                    "tokens past the step's end, to send them at its steady period "
                                    "(--decode-cadence steady)", ["worker"], registry=r)
        self.cadence_period = Gauge("pdserve_decode_cadence_period_seconds", "A decode worker's step period under "
                                    "--decode-cadence steady (0 while its recent steps are too few)", ["worker"],
                                    registry=r)
        self.production_paced = Counter("pdserve_production_paced", "Prefill chunks a link's delivery backlog cut "
                                         "short (outcome capped) or held back while other links' prompts ran "
                                         "(outcome held): production paced per link", ["worker", "outcome"],
                                         registry=r)
        self.kv_recovery = Counter("pdserve_kv_recovery", "Prompts whose prefill worker died or stalled: moved to another "
                                   "prefill worker (redispatch) or recomputed by their decode worker (recompute)",
                                   ["choice"], registry=r)
        self.kv_recomputed_tokens = Counter("pdserve_kv_recomputed_tokens", "Prompt tokens a decode worker computed "
                                            "because their KV did not come from the prefill worker, by reason "
                                            "(usage.kv_transfer.recompute_reason, pdserve.core.pd.kv_arrival)",
                                            ["reason"], registry=r)
        self.streams_cut = Counter("pdserve_streams_cut", "Responses cut because the client took no data for "
                                   "--stream-timeout-s (it stopped reading); their requests were aborted",
                                   registry=r)
        self.rejected_connections = Counter("pdserve_rejected_connections", "Connections refused because the peer "
                                            "did not prove it belongs to this deployment (kv_tcp: no valid "
                                            "hello)", ["endpoint"], registry=r)
        self.worker_deaths = Counter("pdserve_worker_deaths", "Worker processes that died", ["worker"], registry=r)
        self.workers_joined = Counter("pdserve_workers_joined", "Workers that joined the running deployment "
                                      "(pdserve worker --join)", ["role"], registry=r)
        self.workers_left = Counter("pdserve_workers_left", "Workers that left the deployment: drained (released "
                                    "with nothing left) or handed_off (what they still had moved to the others)",
                                    ["role", "how"], registry=r)
        self.workers_unplaced = Counter("pdserve_workers_unplaced", "Worker actors Ray could not place (--cluster "
                                        "ray): timeout (pending for --ready-timeout-s, given up) or infeasible (no "
                                        "node has what it asks for: refused)", ["role", "reason"], registry=r)
        self.role_switches = Counter("pdserve_role_switches", "Workers the role planner moved to another role "
                                     "(--role-switching auto), by the role they moved to", ["role"], registry=r)
        self.role_move_seconds = Histogram("pdserve_role_move_seconds", "Role moves, from the planner's decision "
                                           "(the worker drains) until a worker serves in the new role, by that "
                                           "role: what the planner weighs a move's cost by", ["role"],
                                           buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600), registry=r)
        self.role_demand = Gauge("pdserve_role_demand_tokens_per_second", "The role planner's forecast demand "
                                 "(--role-switching auto): prompt tokens/s to compute, output tokens/s to emit, "
                                 "the backlog to clear within its horizon included", ["role"], registry=r)
        self.role_capacity = Gauge("pdserve_role_capacity_tokens_per_second", "What the role planner counts one "
                                   "worker of the role for (from the workers' step-time fits; decode at the "
                                   "largest batch meeting the tightest TPOT SLO)", ["role"], registry=r)
        self.role_utilization = Gauge("pdserve_role_utilization", "The role planner's demand / (workers x "
                                      "capacity) per role, workers moving to the role counted", ["role"], registry=r)
        self.joins_refused = Counter("pdserve_worker_joins_refused", "Workers refused when they tried to join (a "
                                     "role the deployment's mode has no use for, another model, a name in use)",
                                     registry=r)
        self.kv_checkpoints = Counter("pdserve_kv_checkpoints", "KV checkpoints recorded: a live request's KV on "
                                      "a worker's disk grew (where it resumes should the worker die)",
                                      ["worker"], registry=r)
        self.requests_migrated = Counter("pdserve_requests_migrated", "Requests moved to another worker when theirs "
                                         "died, their KV rebuilt by recomputing prompt + outputs (source "
                                         "recompute) or from a checkpoint (source checkpoint)",
                                         ["reason", "source"], registry=r)
        self._totals: dict[tuple[str, str], float] = {}

    def _lifecycle_gauges(self, r: CollectorRegistry, prices: dict[str, float] | None) -> None:
        """The KV lifecycle's metrics over the last LIFECYCLE_WINDOW_S seconds (`pdserve.core.lifecycle_metrics`:
        the simulator's report computes them with the same code), and what serving cost (`pdserve.core.cost`)."""
        self.lifecycle = LifecycleWindow(LIFECYCLE_WINDOW_S)
        self.cost_meter = CostMeter(prices) if prices else None
        self.kv_predictability = Gauge(
            "pdserve_kv_schedule_predictability", "Of the delivered KV blocks whose first consumption was checked "
            "over the last LIFECYCLE_WINDOW_S seconds, the share consumed within +-5 ms of the conductor's "
            "prediction (a tier with no check in the window has no sample)", ["service_tier"], registry=r)
        self.kv_wasted_ratio = Gauge(
            "pdserve_kv_wasted_transfer_ratio", "KV bytes decode workers received (verified) and will never consume "
            "/ KV bytes they received, over the last LIFECYCLE_WINDOW_S seconds (NaN: nothing received)", registry=r)
        self.jitter_p99 = Gauge(
            "pdserve_inter_token_jitter_p99_seconds", "Of the requests that ended in the last LIFECYCLE_WINDOW_S "
            "seconds, each gap between two of its tokens' arrivals at the gateway minus its own mean gap, in "
            "absolute value, pooled: the 99th percentile (as `pdserve bench` and the simulator; past 4096 gaps per "
            "tier in 3 s, of a uniform sample of them)", ["service_tier"], registry=r)
        self.cost_usd = Counter(
            "pdserve_cost_usd", "Worker-hours at --price-per-hour, split between the service tiers by the work each "
            "worker's role did for them over the last LIFECYCLE_WINDOW_S seconds (prefill: computed prompt tokens; "
            "decode: output tokens); time with no such work: service_tier=idle (`pdserve.core.cost`)",
            ["service_tier"], registry=r)
        self._lifecycle_tiers: dict[str, set] = {"predictability": set(), "jitter": set()}

    def _inc_total(self, counter, key: tuple[str, str], total: float, **labels) -> float:
        """Count a worker's running total's growth; -> the increment."""
        delta = total - self._totals.get(key, 0)
        if delta > 0:
            counter.labels(**labels).inc(delta)
            self._totals[key] = total
            return delta
        return 0.0

    def observe_worker_stats(self, s: dict) -> None:
        w = s["worker"]
        self.running.labels(worker=w).set(s["running"])
        self.waiting.labels(worker=w).set(s["waiting"] + s.get("waiting_for_kv", 0) + s.get("pending_reservations", 0))
        self.blocks_used.labels(worker=w).set(s["blocks_used"])
        self.blocks_total.labels(worker=w).set(s["blocks_total"])
        self._observe_tiers(w, s.get("kv"))
        if s.get("prefill_cap") is not None:
            self.prefill_cap.labels(worker=w).set(s["prefill_cap"])
            self._inc_total(self.capped_steps, (w, "capped"), s.get("capped_steps", 0), worker=w)
            self._inc_total(self.fallbacks, (w, "step_budget_cold_start"), s.get("step_budget_cold_starts", 0),
                            kind="step_budget_cold_start")
        self._inc_total(self.fallbacks, (w, "bad_command"), s.get("bad_commands", 0), kind="bad_command")
        calibration = s.get("calibration")
        if calibration:
            self.calibration_steps.labels(worker=w, source=calibration["source"]).set(calibration["steps"])
            self._inc_total(self.fallbacks, (w, "calibration"), calibration["fallbacks"], kind="calibration")
        self._inc_total(self.prefix_queries, (w, "queries"), s["prompt_tokens"], worker=w)
        self._inc_total(self.prompt_computed, (w, "computed"), s.get("prompt_tokens_computed", 0), worker=w)
        self._inc_total(self.fallbacks, (w, "grammar_error"), s.get("grammar_errors", 0), kind="grammar_error")
        for tier, n in s.get("preemptions_by_tier", {}).items():
            self._inc_total(self.preemptions, (w, f"preempt:{tier}"), n, worker=w, service_tier=tier)
        for tier, n in s.get("prefill_yields_by_tier", {}).items():
            self._inc_total(self.prefill_yields, (w, f"yield:{tier}"), n, worker=w, service_tier=tier)
        now = time.monotonic()
        self._accrue_cost(w, s.get("role"), now)
        self.lifecycle.delivered(now, self._inc_total(self.kv_transfer_bytes, (w, "bytes"),
                                                      s.get("kv_bytes_received", 0), worker=w))
        self._inc_total(self.kv_transcoded, (w, "transcoded"), s.get("kv_chunks_transcoded", 0), worker=w)
        if "kv_lease_renewals" in s:  # a decode worker
            self._inc_total(self.kv_renewals, (w, "renewals"), s["kv_lease_renewals"], worker=w)
        for reason, n in s.get("kv_wasted_bytes", {}).items():  # decode: delivered; prefill: staged
            wasted = self._inc_total(self.kv_wasted, (w, f"wasted:{reason}"), n, reason=reason)
            if s.get("role") == "decode":  # (a prefill worker's staged KV never went over a link)
                self.lifecycle.wasted(now, wasted)
        if "cadence_held_s" in s:  # a decode worker under --decode-cadence steady
            self._inc_total(self.cadence_held, (w, "cadence_held"), s["cadence_held_s"], worker=w)
            self.cadence_period.labels(worker=w).set(s["cadence_period_s"])
        for tier, report in s.get("tier_weights", {}).items():
            self.tier_weight.labels(worker=w, service_tier=tier).set(report["weight"])
            for name, value in report.items():
                if name != "weight" and value is not None:
                    self.tier_weight_input.labels(worker=w, service_tier=tier, input=name).set(value)
        if "kv_transfers_lent" in s:  # a prefill worker
            self._observe_links(w, s.get("kv_links", {}))
            for key, n in s.get("kv_wire_bytes", {}).items():
                tier, _, fmt = key.partition(":")
                self._inc_total(self.kv_wire_bytes, (w, f"wire:{key}"), n, service_tier=tier, format=fmt)
            self.kv_lent.labels(worker=w).set(s["kv_transfers_lent"])
            self.kv_staged_now.labels(worker=w).set(s.get("kv_staged_now", 0))
            self._inc_total(self.production_paused, (w, "paused"), s.get("production_paused_s", 0.0), worker=w)
            for outcome, n in s.get("production_paced", {}).items():
                self._inc_total(self.production_paced, (w, f"paced:{outcome}"), n, worker=w, outcome=outcome)
            for mode in ("in_place", "payload"):
                self._inc_total(self.kv_chunks, (w, mode), s[f"kv_chunks_{mode}"], worker=w, mode=mode)
            for path, n in s.get("kv_path_transfers", {}).items():  # --transport auto
                self._inc_total(self.kv_path_transfers, (w, f"path:{path}"), n, worker=w, path=path)
            self._inc_total(self.fallbacks, (w, "kv_path_failover"), s.get("kv_path_failovers", 0),
                            kind="kv_path_failover")
            self._observe_breakers(w, s)
        for endpoint, n in s.get("rejected_connections", {}).items():
            self._inc_total(self.rejected_connections, (w, f"rejected:{endpoint}"), n, endpoint=endpoint)
        for key, n in s.get("kv_protected_bytes", {}).items():  # {"tcp:aead": bytes}
            path, mode = key.split(":")
            self._inc_total(self.kv_protected_bytes, (w, f"protected:{key}"), n, path=path, mode=mode)
        for path, n in s.get("kv_auth_failures", {}).items():
            self._inc_total(self.kv_auth_failures, (w, f"auth:{path}"), n, path=path)
        # model calls that ran the torch path instead of a compiled kernel (summed over workers)
        self._inc_total(self.fallbacks, (w, "kernel"), s.get("kernel_fallbacks", 0), kind="kernel_torch_path")
        # a prepared-weights cache file found unusable (truncated, corrupt: rebuilt) or not writable at load
        cache = s.get("weights_cache", {})
        self._inc_total(self.fallbacks, (w, "weights_cache_rebuilt"), cache.get("rebuilds", 0),
                        kind="weights_cache_rebuilt")
        self._inc_total(self.fallbacks, (w, "weights_cache_unwritable"), cache.get("write_failures", 0),
                        kind="weights_cache_unwritable")
        # KV bookkeeping structures made in Python: the compiled module could not be built or loaded
        self._inc_total(self.fallbacks, (w, "native"), s.get("native_fallbacks", 0), kind="native_kv_core")
        # a shared KV pool whose pages could not be populated up front (Linux < 5.14): they fault in on use
        self._inc_total(self.fallbacks, (w, "prefault"), s.get("kv_pool_prefault_fallbacks", 0), kind="kv_pool_prefault")
        self._inc_total(self.fallbacks, (w, "checkpoint"), s.get("kv_checkpoint_fallbacks", 0),
                        kind="kv_checkpoint_missing")
        # int4: a sequence whose residual window slot went to another (more live sequences than slots) reads
        # the earlier tokens of its current block through the codec
        self._inc_total(self.fallbacks, (w, "residual"), s.get("kv_residual_evictions", 0),
                        kind="kv_residual_window_evicted")

    def _observe_breakers(self, w: str, s: dict) -> None:
        """A prefill worker's KV path breakers (`pdserve.core.pd.breaker`) and its failed sends by reason."""
        for key, report in s.get("kv_path_breakers", {}).items():  # {"peer|path": {state, transitions}}
            peer, _, path = key.rpartition("|")
            self.kv_path_state.labels(worker=w, peer=peer, path=path).set(STATE_CODES[report["state"]])
            for to, n in report["transitions"].items():
                self._inc_total(self.kv_path_transitions, (w, f"breaker:{key}:{to}"), n, worker=w, peer=peer,
                                path=path, to=to)
        for reason, n in s.get("kv_send_failures", {}).items():
            self._inc_total(self.kv_send_failures, (w, f"send_failed:{reason}"), n, worker=w, reason=reason)

    def _observe_links(self, w: str, links: dict) -> None:
        now = time.monotonic()
        for dest, totals in links.items():
            link = f"{w}->{dest}"
            history = self._link_history.setdefault(link, deque())
            history.append((now, totals))
            while len(history) > 2 and now - history[1][0] >= LINK_WINDOW_S:
                history.popleft()  # the oldest sample kept is the last one at least a window old
            t0, old = history[0]
            if now > t0:
                self.kv_link_util.labels(link=link).set(min((totals["busy_s"] - old["busy_s"]) / (now - t0), 1.0))
            demand = totals["demand_s"] - old["demand_s"]
            if demand > 0 and totals.get("capacity"):
                sent = totals["bytes"] - old["bytes"]
                self.kv_link_effective.labels(link=link).set(min(sent / (totals["capacity"] * demand), 1.0))
            self._inc_total(self.kv_link_bytes, (w, f"link:{dest}"), totals["bytes"], link=link)
            self._inc_total(self.kv_link_chunks, (w, f"chunks:{dest}"), totals.get("chunks", 0), link=link)

    def _observe_tiers(self, w: str, kv: dict | None) -> None:
        if not kv:
            return
        for tier, stages in kv["stages"].items():
            for stage, n in stages.items():
                self.tier_blocks.labels(worker=w, tier=tier, stage=stage).set(n)
        for tier, n in kv["capacity"].items():
            self.tier_capacity.labels(worker=w, tier=tier).set(n)
            self.prefix_hits.labels(worker=w, tier=tier)  # every tier's series exists from the start
            self.tier_corrupt.labels(worker=w, tier=tier)
        for tier, n in kv["hits"].items():
            self._inc_total(self.prefix_hits, (w, f"hits:{tier}"), n, worker=w, tier=tier)
        for direction in ("in", "out"):
            for tier, n in kv[f"bytes_{direction}"].items():
                self._inc_total(self.tier_bytes, (w, f"bytes:{tier}:{direction}"), n, worker=w, tier=tier,
                                direction=direction)
        for tier, n in kv["corrupt"].items():
            self._inc_total(self.tier_corrupt, (w, f"corrupt:{tier}"), n, worker=w, tier=tier)
        self._inc_total(self.fallbacks, (w, "kv_disk_full"), kv["disk_full"], kind="kv_disk_full")
        self._inc_total(self.fallbacks, (w, "kv_disk_key_mismatch"), kv.get("disk_key_mismatch", 0),
                        kind="kv_disk_key_mismatch")  # its disk folder was sealed under another key: emptied
        self._inc_total(self.fallbacks, (w, "kv_secret_off_disk"), kv.get("secret_off_disk", 0),
                        kind="kv_secret_off_disk")  # secret blocks kept off a disk tier with no key
        for kind in ("secret_off_remote", "remote_skipped", "remote_down", "remote_slow"):  # the shared pool
            # (`--kv-remote`): secret blocks kept off it with no key, blocks not written (too many writes under way),
            # times it was found down (served from the local tiers meanwhile), lookups that stopped waiting for it
            self._inc_total(self.fallbacks, (w, f"kv_{kind}"), kv.get(kind, 0), kind=f"kv_{kind}")
        for why, n in kv.get("unservable", {}).items():  # stale or in another codec: dropped, recomputed
            self._inc_total(self.fallbacks, (w, f"kv_unservable:{why}"), n, kind=f"kv_unservable_{why}")
        placement = kv.get("placement")
        if placement:
            for m in placement["moves"]:
                labels = {k: m[k] for k in ("kind", "stage", "src", "dst")}
                self._inc_total(self.tier_moves, (w, "move:" + ":".join(labels.values())), m["blocks"], worker=w,
                                **labels)
            for outcome, n in placement["prefetch"].items():
                self.kv_prefetch.labels(worker=w, outcome=outcome)  # every outcome's series, from the start
                self._inc_total(self.kv_prefetch, (w, f"prefetch:{outcome}"), n, worker=w, outcome=outcome)

    def count(self, metric: str, labels: tuple) -> None:
        """A `Count` action of the conductor core."""
        getattr(self, metric).labels(**dict(labels)).inc()

    def observe(self, metric: str, labels: tuple, value: float, weight: int = 1) -> None:
        """An `Observe` action of the conductor core (`weight` observations of `value`)."""
        if metric == "kv_consumption_error":  # a transfer's `weight` blocks checked against the prediction
            self.lifecycle.consumed(time.monotonic(), dict(labels).get("service_tier", "default"), value, weight)
        histogram = getattr(self, metric)
        histogram = histogram.labels(**dict(labels)) if labels else histogram
        for _ in range(weight):
            histogram.observe(value)

    def observe_tokens(self, tier: str, prompt_computed: int, output: int) -> None:
        """Tokens a request of `tier` was served just now: prompt tokens computed (not found cached), output
        tokens (what the workers' costs are split by)."""
        now = time.monotonic()
        if prompt_computed > 0:
            self.lifecycle.tokens(now, "prompt", tier, prompt_computed)
        if output > 0:
            self.lifecycle.tokens(now, "output", tier, output)

    def observe_stream(self, tier: str, token_times: list[float]) -> None:
        """A request's token arrival times at the gateway, once it ended (inter-token jitter)."""
        self.lifecycle.stream(time.monotonic(), tier, token_times)

    def _accrue_cost(self, worker: str, role: str, now: float) -> None:
        if self.cost_meter is None:
            return
        for tier, usd in self.cost_meter.accrue(worker, role, now, self.lifecycle.token_counts(now)).items():
            self.cost_usd.labels(service_tier=tier).inc(usd)

    def refresh(self) -> None:
        """Set the lifecycle gauges from the window as it is now (before each scrape of /metrics)."""
        now = time.monotonic()
        ratio = self.lifecycle.wasted_ratio(now)
        self.kv_wasted_ratio.set(float("nan") if ratio is None else ratio)
        self._set_tiers(self.kv_predictability, "predictability", self.lifecycle.predictability(now))
        self._set_tiers(self.jitter_p99, "jitter", self.lifecycle.jitter_p99_s(now))

    def _set_tiers(self, gauge: Gauge, key: str, values: dict[str, float]) -> None:
        """A per-tier gauge: the tiers with a value now; a tier that had one and has none left loses its sample."""
        for tier in self._lifecycle_tiers[key] - values.keys():
            gauge.remove(tier)
        for tier, v in values.items():
            gauge.labels(service_tier=tier).set(v)
        self._lifecycle_tiers[key] = set(values)

    def observe_backlog(self, backlog: dict) -> None:
        for worker, b in backlog.items():
            for rank, name in ((0, "guaranteed"), (1, "elastic")):
                self.backlog.labels(worker=worker, tier_class=name).set(b.tokens[rank])

    def observe_prefill(self, e) -> None:
        """A `prefilled` event (`pdserve.conductor.wire.Prefilled`)."""
        if e.queue_s is not None:
            self.queue.labels(worker_role="prefill").observe(e.queue_s)
        if e.prefill_s is not None:
            self.prefill.labels(worker_role="prefill").observe(e.prefill_s)

    def observe_kv_arrival(self, kv: dict) -> None:
        """How a request's prompt KV reached its decode worker (a first token's `kv`, `usage.kv_transfer`)."""
        if kv["recomputed_tokens"]:
            self.kv_recomputed_tokens.labels(reason=kv["recompute_reason"] or "unknown").inc(kv["recomputed_tokens"])

    def observe_first_token(self, item: dict, role: str) -> None:
        if item.get("queue_s") is not None:
            self.queue.labels(worker_role=role).observe(item["queue_s"])
        if item.get("prefill_s") is not None:
            self.prefill.labels(worker_role=role).observe(item["prefill_s"])

    def observe_transfer(self, e) -> None:
        """A `transfer` event (`pdserve.conductor.wire.Transfer`)."""
        if e.outcome == "held" and e.lapses > 1:
            return  # a renewed lease lapsing again: its transfer's failure is counted (and timed) once
        self.kv_transfer_time.labels(outcome=e.outcome).observe(e.seconds)
        if e.outcome != "delivered":
            self.kv_transfer_failures.labels(reason=e.state, outcome=e.outcome).inc()
