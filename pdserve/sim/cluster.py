"""Build a simulated cluster (N prefill + M decode engines, or N colocated ones) and replay a workload on it.

    spec = ClusterSpec(mode="pd", num_prefill=8, num_decode=8, tp=4)
    run = simulate(workload, spec, get_model("llama-3-70b"), get_gpu("h100"), time_model)

Each engine is a real `LLMEngine` on `tp` GPUs whose KV pool holds what fits after the weights
(`hardware.kv_pool_blocks`), with a host KV tier of `host_kv_gb` GiB (and a disk tier of `disk_kv_gb`) below
it: the real tier code, whose copies take the time the GPU's host link and the node's NVMe drives need
(`hardware.GPUSpec`, `tp` times per engine; `pdserve.sim.tier_io`). Each engine has one network port of
`tp x net_bw` bytes/s; KV flows from a prefill engine's port to a decode engine's. Requests arrive at their workload times; the prompts are built
one at a time by the workloads package (Mooncake `hash_ids` become shared token blocks, so prefix hits are
real hits in the real block managers).

With `kv_remote_pool_gb`, one shared KV pool (`pdserve.sim.kv_pool.SimKVPool`, as Mooncake Store under the real
workers' `--kv-remote`) lies below every engine's host tier: each engine's real `TieredKV` publishes its host
blocks there and probes and fetches what its own tiers miss, over a link of `kv_remote_gbps` (default: the
engine's port) and `kv_remote_rtt_us` per operation.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.bench.metrics import RequestRecord
from pdserve.conductor.admission import Admission
from pdserve.conductor.routing_policies import make_routing_policy
from pdserve.core.sched.decode_cadence import DecodeCadence
from pdserve.core.pd.delivery import DeliveryPolicy, WaterLevel
from pdserve.core.kvstore import kv_codecs
from pdserve.core.pd.wire_format import WireFormat
from pdserve.core.kvstore.kv_meta import STORAGE_TIERS
from pdserve.core.role_planner import RolePlanner
from pdserve.core.sched.schedule import SchedulerConfig
from pdserve.core.service_tiers import ServiceTiers
from pdserve.core.settings import (AdmissionSettings, CadenceSettings, CodecSettings, DeliverySettings, KvBlockSettings,
                                   KvTierSettings, RoutingSettings, default_of, parse_link_share, pick, shared)
from pdserve.errors import InvalidRequestError
from pdserve.sim.conductor import Lifecycle, SimConductor
from pdserve.sim.engine import SimEngine
from pdserve.sim.events import MESSAGE, EventLoop
from pdserve.sim.hardware import GB, GPUSpec, ModelSpec, kv_pool_blocks
from pdserve.sim.jitter import jittered
from pdserve.sim.kv_pool import SimKVPool
from pdserve.sim.kv_push import SimWire
from pdserve.sim.link import LinkModel
from pdserve.sim.roles import SimRoleSwitching
from pdserve.sim.tier_io import TierSpec, tier_spec
from pdserve.sim.timemodel import TimeModel
from pdserve.workloads import Workload
from pdserve.workloads.prompts import iter_prompt_arrays

MODES = ("pd", "colocated")
# A modelled GPU node's storage tiers: 512 GiB of host memory per engine, no disk tier unless asked (the real
# worker's defaults, `KvTierSettings`, fit one small CPU host).
SIM_KV_TIERS = KvTierSettings(kv_host_gb=512.0, kv_disk_gb=0.0)


@dataclass(frozen=True)
class ClusterSpec:
    mode: str = "pd"
    num_prefill: int = 1
    num_decode: int = 1
    num_instances: int = 1  # colocated
    tp: int = 1
    block_size: int = shared(KvBlockSettings, "block_size")
    num_kv_blocks: int | None = shared(KvBlockSettings, "num_kv_blocks")  # per engine (default: what fits)
    max_num_seqs: int = 256
    tier_weights: str = default_of(SchedulerConfig, "tier_weights")  # the elastic tiers' weights
    prefill_budget: int = 8192  # max_num_batched_tokens of prefill engines
    decode_budget: int = 2048  # of decode and colocated engines
    routing: str = shared(RoutingSettings, "routing")
    link_latency_s: float = 20e-6
    control_latency_s: float = 0.0  # each gateway <-> worker message (command, reply, token event); a burst's
    # requests (gateway intake) and landings (a decode engine's take-in) this far apart (`pdserve.sim.conductor`)
    host_kv_gb: float = SIM_KV_TIERS.kv_host_gb  # --kv-host-gb: host KV tier per engine, GiB (0: none)
    disk_kv_gb: float = SIM_KV_TIERS.kv_disk_gb  # --kv-disk-gb: disk KV tier per engine (0: none; needs a host tier)
    kv_eviction_policy: str = shared(KvTierSettings, "kv_eviction_policy")  # in every tier
    kv_placement: str = shared(KvTierSettings, "kv_placement")
    kv_max_age_s: float = shared(KvTierSettings, "kv_max_age_s")
    kv_host_cache_dtype: str | None = shared(CodecSettings, "kv_host_cache_dtype")  # default: the pool's
    kv_disk_cache_dtype: str | None = shared(CodecSettings, "kv_disk_cache_dtype")  # default: the host tier's
    host_link_gb_s: float | None = None  # per GPU, GB/s each way; None: the GPU preset's
    disk_read_gb_s: float | None = None  # per GPU; None: the GPU preset's
    disk_write_gb_s: float | None = None  # per GPU; None: the GPU preset's
    kv_remote_pool_gb: float = 0.0  # --kv-remote-pool-gb: one KV pool shared by every engine, GiB in all (0: none)
    kv_remote_gbps: float | None = None  # each engine's link to it, Gbit/s each way; None: the engine's port's
    kv_remote_rtt_us: float = 200.0  # one pool operation's round trip (a probe; a fetch or publish plus its bytes)
    fast_forward: bool = True
    ttft_timeout_s: float | None = None
    transfer_failure_rate: float = 0.0
    seed: int = 0
    service_tiers: tuple[str, ...] = ()  # `--service-tier` specs, as the server's
    admission: str | None = shared(AdmissionSettings, "admission")
    admission_margin: float = shared(AdmissionSettings, "admission_margin")
    delivery: str = shared(DeliverySettings, "delivery")
    link_share: str | None = shared(DeliverySettings, "link_share")
    link_gbps: float | None = shared(DeliverySettings, "link_gbps")  # per engine; None: tp x the GPU preset's
    delivery_backlog_s: float = shared(DeliverySettings, "delivery_backlog_s")
    kv_wire_dtype: str = shared(DeliverySettings, "kv_wire_dtype")
    decode_cadence: str = shared(CadenceSettings, "decode_cadence")
    idle_prewarm: bool = shared(RoutingSettings, "idle_prewarm")
    role_switching: str = shared(RoutingSettings, "role_switching")  # auto: moved engines (pdserve.sim.roles)
    role_switch_s: float = 20.0  # a moved engine is out this long after it drained (weights reloaded)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidRequestError(f"mode must be one of {MODES}, got {self.mode!r}", param="mode")
        counts = (self.num_prefill, self.num_decode) if self.mode == "pd" else (self.num_instances,)
        if min(counts) < 1 or self.tp < 1:
            raise InvalidRequestError("engine counts and tp must be positive")
        # the shared settings' own checks (pdserve.core.settings), then the simulator's
        pick(KvBlockSettings, self)
        KvTierSettings(self.host_kv_gb, self.disk_kv_gb, self.kv_eviction_policy, self.kv_placement,
                       self.kv_max_age_s)
        if self.disk_kv_gb and not self.host_kv_gb:
            raise InvalidRequestError("a disk KV tier needs a host tier: set --kv-host-gb > 0", param="kv_disk_gb")
        ServiceTiers.from_specs(self.service_tiers)  # a bad spec fails here, in one line
        AdmissionSettings(admission=self.admission, admission_margin=self.admission_margin)
        pick(DeliverySettings, self)
        pick(CadenceSettings, self)
        pick(RoutingSettings, self)
        if self.role_switching == "auto" and self.mode != "pd":
            raise InvalidRequestError("role switching moves engines between prefill and decode: it needs pd mode",
                                      param="role_switching")
        if not self.role_switch_s >= 0:
            raise InvalidRequestError("role_switch_s must be >= 0", param="role_switch_s")
        for name in ("host_link_gb_s", "disk_read_gb_s", "disk_write_gb_s", "kv_remote_gbps"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise InvalidRequestError(f"{name} must be positive, got {value!r}", param=name)
        self._check_pool()

    def _check_pool(self) -> None:
        for name in ("kv_remote_pool_gb", "kv_remote_rtt_us"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):
                raise InvalidRequestError(f"{name} must be >= 0 and finite, got {value!r}", param=name)
        if self.kv_remote_pool_gb and not self.host_kv_gb:
            raise InvalidRequestError("a shared KV pool needs a host tier to stage through: set --kv-host-gb > 0",
                                      param="kv_remote_pool_gb")

    @property
    def num_engines(self) -> int:
        return self.num_prefill + self.num_decode if self.mode == "pd" else self.num_instances

    @property
    def num_gpus(self) -> int:
        return self.num_engines * self.tp


@dataclass
class SimRun:
    spec: ClusterSpec
    records: list[RequestRecord]
    duration_s: float
    wall_s: float
    life: Lifecycle
    links: dict
    engines: list[dict] = field(default_factory=list)
    num_events: int = 0
    role_switches: list[dict] = field(default_factory=list)  # --role-switching auto: engines moved
    kv_pool: dict | None = None  # the shared pool's own counters (`SimKVPool.stats`); None: no pool


def engine_tiers(spec: ClusterSpec, gpu: GPUSpec, model: ModelSpec) -> TierSpec | None:
    """One engine's host and disk tiers: sizes from the spec, in blocks of each tier's codec
    (`kv_codecs.tier_codecs`, as the real worker's), bandwidths from the GPU preset (or the spec's overrides)
    times `tp` (each GPU has its own host link and, as in a DGX node, its own NVMe drive)."""
    def bw(override: float | None, preset: float) -> float:
        return spec.tp * (override * GB if override is not None else preset)
    codecs = kv_codecs.tier_codecs(model.kv_cache_dtype, spec.kv_host_cache_dtype, spec.kv_disk_cache_dtype)
    host_bytes, disk_bytes = (spec.block_size * kv_codecs.kv_bytes_per_token(
        name, model.num_layers, model.num_kv_heads, model.hd, model.dtype_bytes) for name in codecs)
    return tier_spec(spec.host_kv_gb, spec.disk_kv_gb, host_bytes, bw(spec.host_link_gb_s, gpu.host_link_bw),
                     bw(spec.disk_read_gb_s, gpu.disk_read_bw), bw(spec.disk_write_gb_s, gpu.disk_write_bw),
                     disk_bytes, codecs)


def sim_wire(spec: ClusterSpec, model: ModelSpec) -> SimWire:
    """The wire format policy of the run (`--kv-wire-dtype`), with each format's bytes per pool byte."""
    def ratio(fmt: str) -> float:
        return kv_codecs.kv_bytes_per_token(fmt, model.num_layers, model.num_kv_heads, model.hd,
                                            model.dtype_bytes) / model.kv_bytes_per_token
    return SimWire(WireFormat(spec.kv_wire_dtype), model.kv_cache_dtype, ratio)


def kv_pool(spec: ClusterSpec, tiers: TierSpec | None, port_bw: float) -> SimKVPool | None:
    """The cluster's shared KV pool (None without `kv_remote_pool_gb`): blocks in the host tier's codec, a link
    per engine of `kv_remote_gbps` (default `port_bw`, the engine's network port)."""
    if not spec.kv_remote_pool_gb or tiers is None:
        return None
    bw = spec.kv_remote_gbps * 1e9 / 8 if spec.kv_remote_gbps else port_bw
    return SimKVPool(kv_codecs.tier_blocks(spec.kv_remote_pool_gb, tiers.block_bytes), bw,
                     spec.kv_remote_rtt_us * 1e-6, tiers.block_bytes)


def build(spec: ClusterSpec, model: ModelSpec, gpu: GPUSpec, time_model: TimeModel
          ) -> tuple[EventLoop, SimConductor, list[SimEngine]]:
    loop = EventLoop()
    links = LinkModel(loop, spec.link_latency_s, DeliveryPolicy(spec.delivery, parse_link_share(spec.link_share)))
    block_bytes = model.kv_bytes_per_token * spec.block_size
    blocks = spec.num_kv_blocks or kv_pool_blocks(model, gpu, spec.tp, spec.block_size,
                                                max_num_seqs=spec.max_num_seqs)
    tiers = engine_tiers(spec, gpu, model)
    roles = {"prefill": spec.num_prefill, "decode": spec.num_decode} if spec.mode == "pd" else {
        "colocated": spec.num_instances}
    engines: dict[str, list[SimEngine]] = {}
    port_bw = spec.link_gbps * 1e9 / 8 if spec.link_gbps else spec.tp * gpu.net_bw
    pool = kv_pool(spec, tiers, port_bw)
    service_tiers = ServiceTiers.from_specs(spec.service_tiers)
    predict = spec.admission == "predict" or (spec.admission is None and service_tiers.any_slo)
    conductor = SimConductor(spec.mode, make_routing_policy(spec.routing), links, spec.block_size, block_bytes,
                             spec.transfer_failure_rate, spec.ttft_timeout_s, spec.seed, spec.control_latency_s,
                             service_tiers, Admission(spec.admission_margin, predict=predict),
                             WaterLevel(spec.delivery_backlog_s), spec.idle_prewarm)
    conductor.kv.wire = sim_wire(spec, model)
    steps = jittered(time_model)  # the engines' steps scatter as measured (a fitted model's spread)

    def make_engine(name: str, role: str) -> SimEngine:
        budget = spec.prefill_budget if role == "prefill" else spec.decode_budget
        cfg = SchedulerConfig(max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=budget,
                              max_model_len=model.max_model_len, service_tiers=tuple(spec.service_tiers),
                              tier_weights=spec.tier_weights)
        return SimEngine(name, role, loop, steps, cfg, blocks, spec.block_size, block_bytes, tiers, conductor,
                         spec.fast_forward, vocab_size=max(model.vocab, 1024),
                         kv_eviction_policy=spec.kv_eviction_policy, kv_placement=spec.kv_placement,
                         kv_max_age_s=spec.kv_max_age_s, kv_format=model.kv_format,
                         cadence=DecodeCadence() if role == "decode" and spec.decode_cadence == "steady" else None,
                         kv_pool=pool)

    for role, n in roles.items():
        engines[role] = [make_engine(f"{role}-{i}", role) for i in range(n)]
    conductor.attach(engines, port_bw)
    if spec.role_switching == "auto":
        # a move costs an engine for its drain and `role_switch_s`: no second one sooner than 3 x that
        conductor.core.roles = RolePlanner(interval_s=5.0, hold_s=15.0, cooldown_s=max(3 * spec.role_switch_s, 30.0),
                                           move_s=spec.role_switch_s)
        conductor.roles = SimRoleSwitching(conductor, make_engine, switch_s=spec.role_switch_s)
        conductor.roles.start()
    return loop, conductor, [e for es in engines.values() for e in es]


def simulate(workload: Workload, spec: ClusterSpec, model: ModelSpec, gpu: GPUSpec, time_model: TimeModel, *,
             vocab_size: int = 32000, block_tokens: int = 512, prompt_seed: int = 0,
             progress: Callable[[int, float], None] | None = None, until_s: float = float("inf"),
             tiers: list[str] | None = None) -> SimRun:
    """Replay `workload`; `progress(num_finished, sim_time)` is called now and then. The simulation stops at
    simulated time `until_s`; requests not finished by then are marked unfinished. `tiers`: each request's
    service tier (`pdserve bench serve --tier-mix`'s assignment), else none."""
    wall0 = time.perf_counter()
    loop, conductor, engines = build(spec, model, gpu, time_model)
    prompts = iter_prompt_arrays(workload, vocab_size, block_tokens=block_tokens, seed=prompt_seed)
    reqs = workload.requests
    records: list[RequestRecord] = []

    def arrive(i: int) -> None:
        spec_i = reqs[i]
        prompt = array("q")
        prompt.frombytes(next(prompts).astype("int64", copy=False).tobytes())
        rec = RequestRecord(start_s=loop.now, prompt_tokens=spec_i.input_len)
        records.append(rec)
        conductor.submit(f"r{i}", prompt, spec_i.output_len, rec, tier=tiers[i] if tiers else None)
        if i + 1 < len(reqs):
            loop.at(reqs[i + 1].arrival_s, arrive, i + 1, prio=MESSAGE)

    if reqs:
        loop.at(reqs[0].arrival_s, arrive, 0, prio=MESSAGE)
    loop.run(until_s, on_tick=(lambda t: progress(conductor.num_finished, t)) if progress else None)
    end = max([r.end_s or 0.0 for r in records] + [loop.now])
    duration = max(end - (reqs[0].arrival_s if reqs else 0.0), 1e-9)
    for r in records:
        if r.end_s is None and r.error is None:
            r.error = "unfinished at the end of the simulation"
    return SimRun(spec, records, duration, time.perf_counter() - wall0, conductor.life,
                  conductor.links.stats(duration), [_engine_stats(e, duration) for e in conductor.by_name.values()],
                  loop.num_events, [{"at_s": t, "left": a, "joined": b} for t, a, b in
                                    getattr(getattr(conductor, "roles", None), "switches", [])],
                  _pool_stats(engines))


def _pool_stats(engines: list[SimEngine]) -> dict | None:
    pool = next((e.kv_io.pool for e in engines if e.kv_io is not None and e.kv_io.pool is not None), None)
    return pool.stats() if pool is not None else None



def kv_tier_stats(e: SimEngine, duration_s: float) -> dict:
    """Per tier: capacity, peak use, prefix-hit tokens, bytes written in and read out; lifecycle stages; the
    tier links' use. From the real engine's `kv_report` (what a real worker's stats carry)."""
    rep = e.engine.kv_report()
    bb = e.block_bytes
    capacity = {t: rep["capacity"].get(t, 0) for t in STORAGE_TIERS}
    peak = {"device": e.device.peak_blocks, **e.peak_tier_blocks}
    return {"block_bytes": bb, "capacity_blocks": capacity,
            "capacity_bytes": {t: n * bb for t, n in capacity.items()},
            "peak_bytes": {t: peak[t] * bb for t in STORAGE_TIERS},
            "hit_tokens": _hit_tokens(rep["hits"]),
            "bytes_in": {t: rep["bytes_in"].get(t, 0) for t in STORAGE_TIERS},
            "bytes_out": {t: rep["bytes_out"].get(t, 0) for t in STORAGE_TIERS},
            "stages": rep["stages"], "placement": rep["placement"],
            # the shared pool, as this engine's real tier code saw it: blocks not written through (too many
            # writes under way), lookups that stopped waiting for a probe's answer
            **({"remote": {"skipped_blocks": rep["remote_skipped"], "slow_probes": rep["remote_slow"]}}
               if "remote" in rep["hits"] else {}),
            "io": e.kv_io.stats(duration_s) if e.kv_io is not None else None}


def _hit_tokens(hits: dict) -> dict:
    """Prefix-hit tokens per storage tier, and those found in the shared pool (`remote`) when there is one."""
    return {t: hits.get(t, 0) for t in (*STORAGE_TIERS, *(("remote",) if "remote" in hits else ()))}


def _engine_stats(e: SimEngine, duration_s: float) -> dict:
    s = e.scheduler.stats
    return {"name": e.name, "role": e.role, "num_blocks": e.engine.block_manager.num_blocks, "steps": e.num_steps,
            "fast_forward_steps": e.num_ff_steps, "busy_fraction": e.busy_s / duration_s,
            "preemptions": s.num_preemptions, "prefill_yields": dict(s.prefill_yields_by_tier), "prompt_tokens": s.num_prompt_tokens,
            "prefix_hit_tokens": s.num_prefix_hit_tokens, "device_kv": e.device.stats(duration_s),
            "kv_tiers": kv_tier_stats(e, duration_s), "kv_series": e.device.series}
