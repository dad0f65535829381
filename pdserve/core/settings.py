"""Settings shared by `pdserve serve`, `pdserve worker` and `pdserve simulate`: one frozen dataclass per concern
(delivery, admission, decode cadence, KV storage tiers, KV codec, supervision), each field carrying its default
and its help. A setting is declared here once: the serve config, the engine config, the worker spec and the
simulator's cluster spec take their fields from these (`shared`), and every command generates the setting's flag
from the same field (`pdserve.flags.add_config_args`), so a flag has one name, one default and one help.

Service tiers (SLA classes: priority, default, flex; `pdserve.core.service_tiers.SERVICE_TIERS`) and storage
tiers (where KV lives: device, host, disk; `KvTierSettings`) are different things; their names say which.
Pure: no torch; the checks import what they need when they run.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, field, fields

from pdserve.core.kvstore import kv_codecs
from pdserve.core.pd.wire_format import check_wire_dtype
from pdserve.core.sched.decode_cadence import check_cadence
from pdserve.core.service_tiers import SERVICE_TIERS
from pdserve.errors import InvalidRequestError

DELIVERY_MODES = ("scheduled", "fifo")
CALIBRATION_MODES = ("cached", "fresh", "off")
DEFAULT_SHARES = {"priority": 0.5, "default": 0.4, "flex": 0.1}  # service tier -> link share (`--link-share`)


def setting(default, help: str) -> Field:  # noqa: A002 - argparse's word
    """A slice's field: its default and the help text of its flag."""
    return field(default=default, metadata={"help": help})


def default_of(slice_cls, name: str):
    """The default of setting `name`, read from its slice (without building one)."""
    return slice_cls.__dataclass_fields__[name].default


def shared(slice_cls, name: str, default=MISSING) -> Field:
    """A field of a flat config (serve config, engine config, worker spec, cluster spec) that is a slice's
    setting: the slice's default (or `default`, where a command's default differs) and help."""
    f = slice_cls.__dataclass_fields__[name]
    return field(default=f.default if default is MISSING else default, metadata=f.metadata)


def pick(slice_cls, config):
    """The slice of `config` (any object with attributes of the slice's field names); building it checks it."""
    return slice_cls(**{f.name: getattr(config, f.name) for f in fields(slice_cls)})


def _require(ok: bool, message: str, param: str) -> None:
    """A setting's check: `message` (naming the flag) as a one-line error unless `ok`."""
    if not ok:
        raise InvalidRequestError(message, param=param)


def _require_one_of(param: str, value, choices: tuple[str, ...]) -> None:
    """A setting's check that `value` is one of `choices`: else a one-line error listing them."""
    _require(value in choices, f"--{param.replace('_', '-')} must be one of {', '.join(choices)}, got {value!r}", param)


WEIGHT_FORMATS = ("auto", "fp32", "q8_0", "q4")


@dataclass(frozen=True)
class WeightSettings:
    """How a worker keeps the model's linear-layer weights (`pdserve.model.quant`, CPU only)."""
    weights: str = setting("fp32", "Linear-layer weights: fp32 (exact: token for token with transformers), q8_0 "
                           "(int8 blocks of 32, one scale each), q4 (4-bit blocks of 32: a GGUF file's own Q4_0/Q4_1 "
                           "blocks, else requantized at load to Q4_1) or auto (the format measured fastest for "
                           "this CPU's instruction set, logged at start). Quantized formats run compiled CPU "
                           "kernels on the blocks (fp32 CPU models only).")
    weights_cache: str = setting("auto", "Where a CPU load keeps the weights it prepares (packed kernel panels, "
                                 "quantized blocks, fused projections) for the next load of the same model and "
                                 "format (`pdserve.model.weight_cache`): a directory; auto: $PDSERVE_WEIGHTS_CACHE, "
                                 "else ~/.cache/pdserve/weights; off: prepare them at every load, write nothing.")

    def __post_init__(self) -> None:
        _require_one_of("weights", self.weights, WEIGHT_FORMATS)


@dataclass(frozen=True)
class RoutingSettings:
    """Where the conductor sends requests and how it keeps its workers' roles in balance
    (`pdserve.conductor.routing`, `pdserve.conductor.hot_prefixes`, `pdserve.core.role_planner`)."""
    routing: str = setting("prefix-affinity", "Routing policy: prefix-affinity (fewest outstanding requests, a "
                           "cached prefix worth two), least-loaded, or predicted-ttft (pd mode: the prefill and decode "
                           "pair with the least predicted queueing + prefill + KV transfer over their link + first "
                           "decode step; pdserve.conductor.ttft_routing).")
    idle_prewarm: bool = setting(True, "An idle prefill worker (simulate: engine) computes the hot prompt prefixes "
                                 "(shared by several recent requests) it lacks, so prefix-affine routing can spread "
                                 "their requests (pd mode, --delivery scheduled).")
    role_switching: str = setting("off", "auto (pd mode): the conductor's role planner moves workers (simulate: "
                                  "engines) between prefill and decode as the load shifts (drain, stop, start in "
                                  "the other role; `pdserve.core.role_planner`); off: the split stays as started.")

    def __post_init__(self) -> None:
        _require(self.role_switching in ("auto", "off"),
                 f"--role-switching must be auto or off, got {self.role_switching!r}", "role_switching")


@dataclass(frozen=True)
class KvBlockSettings:
    """How a worker's device KV pool is cut into blocks (`pdserve.core.kvstore.block_manager`). A block is the unit
    of prefix reuse, delivery and the storage tiers, so every worker of a deployment has the same block size."""
    block_size: int = setting(16, "Tokens per KV block (the same on every worker of a deployment, joined ones too).")
    num_kv_blocks: int | None = setting(None, "KV blocks in each worker's device pool (simulate: each engine's); "
                                        "default: what --kv-cache-gb holds (simulate: what fits beside the weights).")

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_blocks"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"{name} must be positive, got {value!r}", name)


@dataclass(frozen=True)
class DeliverySettings:
    """How KV moves on a link from a prefill worker to a decode worker (`pdserve.core.pd.delivery`)."""
    delivery: str = setting("scheduled", "KV delivery order on each link: scheduled (by service tier share, "
                            "earliest predicted consumption first within a tier) or fifo (as produced).")
    link_share: str | None = setting(None, "Bandwidth shares of the service tiers on a link under --delivery "
                                     "scheduled, e.g. priority=0.5,default=0.4,flex=0.1 (the default); unused share "
                                     "goes to the tiers with demand.")
    delivery_backlog_s: float = setting(2.0, "Backpressure: a prefill worker produces no more KV while its links "
                                        "would need longer than this to send what is queued (0: never pause).")
    link_gbps: float | None = setting(None, "Bandwidth of each KV link (prefill -> decode), Gbit/s: serve throttles "
                                      "each link to it, to emulate a slower network (default: as fast as the "
                                      "transport goes); simulate gives each engine's port this rate (default: tp x "
                                      "the GPU preset's network bandwidth).")
    kv_wire_dtype: str = setting("pool", "The KV format on the links: pool (the prefill worker's pool format, exact), "
                                 "a codec (fp16, bf16, fp8_e4m3, int8, int4: every transfer re-encoded into it), or "
                                 "auto: priority KV exact, default and flex KV as int8 when the link would not "
                                 "deliver it exact before its predicted consumption (`pdserve.core.pd.wire_format`). "
                                 "The decode worker decodes it into its own pool's format.")

    def __post_init__(self) -> None:
        check_wire_dtype(self.kv_wire_dtype)
        check_mode(self.delivery)
        parse_link_share(self.link_share)
        _require(self.delivery_backlog_s >= 0, "--delivery-backlog-s must be >= 0", "delivery_backlog_s")
        _require(self.link_gbps is None or self.link_gbps > 0, f"--link-gbps must be positive, got {self.link_gbps}",
                 "link_gbps")


MOONCAKE_PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True)
class MooncakeTransportSettings:
    """How `--transport mooncake` moves KV (`pdserve.transfer.mooncake`)."""
    mooncake_protocol: str = setting("tcp", "The protocol Mooncake Transfer Engine moves KV over under --transport "
                                     "mooncake: tcp, or rdma where the hosts have RDMA NICs.")

    def __post_init__(self) -> None:
        _require(self.mooncake_protocol in MOONCAKE_PROTOCOLS,
                 f"--mooncake-protocol must be {' or '.join(MOONCAKE_PROTOCOLS)}, got {self.mooncake_protocol!r}",
                 "mooncake_protocol")


def parse_link_share(text: str | None) -> dict[str, float]:
    """`priority=0.5,default=0.4,flex=0.1` -> shares normalized to sum to 1; tiers not named get none
    (they still get what the named ones leave unused)."""
    if not text:
        return dict(DEFAULT_SHARES)
    shares: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in SERVICE_TIERS:
            raise InvalidRequestError(f"--link-share wants TIER=SHARE[,...] with TIER one of "
                                      f"{', '.join(SERVICE_TIERS)}; got {part.strip()!r}", param="link_share")
        try:
            share = float(value)
        except ValueError:
            share = -1.0
        if not share >= 0.0 or share == float("inf"):
            raise InvalidRequestError(f"--link-share: {name}'s share must be a number >= 0, got {value!r}",
                                      param="link_share")
        shares[name] = share
    total = sum(shares.values())
    if total <= 0:
        raise InvalidRequestError("--link-share: the shares must not all be zero", param="link_share")
    return {name: share / total for name, share in shares.items()}


def check_mode(mode: str) -> str:
    if mode not in DELIVERY_MODES:
        raise InvalidRequestError(f"delivery must be one of {', '.join(DELIVERY_MODES)}, got {mode!r}",
                                  param="delivery")
    return mode


@dataclass(frozen=True)
class AdmissionSettings:
    """Whether the conductor refuses a request it predicts will miss its SLO (`pdserve.conductor.admission`)."""
    admission: str | None = setting(None, "Prediction-based admission: predict (refuse at once, with 429 "
                                    "slo_unattainable, a request whose predicted TTFT or TPOT misses its service "
                                    "tier's SLO) or off; default: predict when any tier has an SLO.")
    admission_margin: float = setting(-0.1, "How far (a fraction of the SLO) a prediction may exceed the SLO before "
                                      "the request is refused (0: past its SLO; the default -0.1, past 90% of it, is "
                                      "headroom for the time model's error, 5-10 percent in a burst on a 2-core host); negative: how far below the SLO it must stay (headroom "
                                      "for a host whose speed varies: -0.3 refuses past 0.7 of the SLO).")
    max_outstanding: int = setting(4096, "Most requests one worker may have in flight; more are refused (429 "
                                   "queue_full), whatever their tier.")

    def __post_init__(self) -> None:
        _require(self.admission in (None, "predict", "off"),
                 f"--admission must be predict or off, got {self.admission!r}", "admission")
        _require(self.admission_margin > -1, "--admission-margin must be > -1", "admission_margin")
        _require(self.max_outstanding >= 1, "--max-outstanding must be positive", "max_outstanding")


@dataclass(frozen=True)
class CalibrationSettings:
    """How a worker's time model starts (`pdserve.engine.calibration`): calibrated by profile steps at load, so
    admission predicts from the first request."""
    calibration: str = setting("cached", "A worker's time model at start: cached (time a few profile steps at "
                               "load -- prefill of a few lengths, decode at a few batch sizes: ~10 s, 30 at most -- once "
                               "per host, model and engine config, then reuse them from the user cache), fresh "
                               "(profile again and rewrite the cache) or off (no profile: admission predicts nothing, "
                               "and admits everything, until a worker has run 8 steps).")

    def __post_init__(self) -> None:
        _require_one_of("calibration", self.calibration, CALIBRATION_MODES)


@dataclass(frozen=True)
class CadenceSettings:
    """When a decode worker sends its step's tokens (`pdserve.core.sched.decode_cadence`)."""
    decode_cadence: str = setting("off", "steady: a decode worker sends each step's tokens a steady period after "
                                  "the step began (the recent steps' 99th-percentile time, at most 1.25x the step's "
                                  "own), so every stream's inter-token gaps stay even as requests join and leave its "
                                  "batch; tokens wait up to that long. off: as soon as the step ends (pd mode).")

    def __post_init__(self) -> None:
        check_cadence(self.decode_cadence)


@dataclass(frozen=True)
class KvTierSettings:
    """The KV storage tiers below the device pool (`pdserve.core.kvstore.kv_tiers`). Sizes are per worker (per engine in
    the simulator, whose defaults are `pdserve.sim.cluster.SIM_KV_TIERS`)."""
    kv_host_gb: float = setting(4.0, "Host-memory KV tier per worker (simulate: per engine), in GiB (0: none). Full "
                                "blocks are copied there as they are produced (on a background thread), so a block "
                                "evicted from the device pool is loaded back instead of recomputed.")
    kv_disk_gb: float = setting(16.0, "Disk KV tier size per worker, in GiB (serve, worker: with --kv-disk-dir; "
                                "simulate: per engine, 0 none, needs a host tier).")
    kv_eviction_policy: str = setting("lru", "Which cached KV block leaves a full tier first: lru or heat (decayed "
                                      "use count); under --kv-placement write-through.")
    kv_placement: str = setting("write-through", "How KV moves between the device, host and disk tiers: "
                                "write-through (copied down as produced, evicted by --kv-eviction-policy, nothing "
                                "moved up ahead of a request) or staged (copied down the same way; blocks expected "
                                "back, from their prefix's think time, are prefetched disk -> host -> device ahead "
                                "of that use, and a full tier evicts by stage, class and expected use: decayed, "
                                "one-off and flex blocks first). Default write-through: on the Mooncake "
                                "conversation trace staged is not better (docs/benchmarks.md).")
    kv_max_age_s: float = setting(86400.0, "KV retention limit: a block in the host or disk tier produced longer "
                                  "ago than this is never served (dropped, recomputed), nor restored from an "
                                  "earlier run's disk tier.")

    def __post_init__(self) -> None:
        from pdserve.core.kvstore.kv_meta import EVICTION_POLICIES
        from pdserve.core.kvstore.kv_placement import PLACEMENTS
        _require(self.kv_placement in PLACEMENTS, f"unknown kv_placement {self.kv_placement!r}; choose from "
                 f"{', '.join(PLACEMENTS)}", "kv_placement")
        _require(self.kv_max_age_s > 0, f"kv_max_age_s must be positive, got {self.kv_max_age_s!r}", "kv_max_age_s")
        _require(self.kv_host_gb >= 0, f"kv_host_gb must be >= 0, got {self.kv_host_gb!r}", "kv_host_gb")
        _require(self.kv_disk_gb >= 0, f"kv_disk_gb must be >= 0, got {self.kv_disk_gb!r}", "kv_disk_gb")
        if self.kv_eviction_policy not in EVICTION_POLICIES:
            raise InvalidRequestError(f"unknown kv_eviction_policy {self.kv_eviction_policy!r}; choose from "
                                      f"{sorted(EVICTION_POLICIES)}", param="kv_eviction_policy")


@dataclass(frozen=True)
class CodecSettings:
    """How KV is coded in the pool, on the links and in the storage tiers (`pdserve.core.kvstore.kv_codecs`)."""
    kv_cache_dtype: str = setting("auto", "KV cache codec: auto (the model dtype), fp16, bf16, fp8_e4m3, int8 or int4 "
                                  "(scales per token and head, inside each block; the pool, delivery and the host "
                                  "and disk tiers hold the coded blocks). int4 also keeps each running sequence's "
                                  "last block in fp16 (a residual window, out of --kv-cache-gb). simulate: sizes the "
                                  "KV pool, link and tier bytes and adds the codec's dequant cost to attention.")
    kv_host_cache_dtype: str | None = setting(None, "Codec of the blocks in the host KV tier (the names of "
                                              "--kv-cache-dtype): blocks are encoded into it as they are copied "
                                              "down and decoded back into the pool's codec on load, so a compact "
                                              "one (int8) holds more blocks in the same --kv-host-gb. Default: the "
                                              "pool's (blocks kept as they are).")
    kv_disk_cache_dtype: str | None = setting(None, "Codec of the blocks in the disk KV tier, as "
                                              "--kv-host-cache-dtype (sizes --kv-disk-gb in its blocks). Default: "
                                              "the host tier's.")

    def __post_init__(self) -> None:
        kv_codecs.check(self.kv_cache_dtype)
        kv_codecs.tier_codecs(self.kv_cache_dtype, self.kv_host_cache_dtype, self.kv_disk_cache_dtype)


@dataclass(frozen=True)
class CodecGateSettings:
    """Whether `pdserve serve` checks its KV codecs on its model before it starts (`pdserve.engine.codec_gate`)."""
    kv_codec_gate: str = setting("on", "on: before starting, run a fixed text through exact KV and through each "
                                 "KV codec it would use (--kv-cache-dtype, per-role, tier and wire dtypes; not auto) "
                                 "and refuse to start, naming the codec and its numbers, when perplexity rises "
                                 "past +4% or top-1 agreement falls under 85% (as `pdserve check-kv`; a few seconds "
                                 "per codec, cached per host, model and codec). off: no check.")

    def __post_init__(self) -> None:
        _require(self.kv_codec_gate in ("on", "off"),
                 f"--kv-codec-gate must be on or off, got {self.kv_codec_gate!r}", "kv_codec_gate")


@dataclass(frozen=True)
class GenerationSettings:
    """What the sampling fields a request leaves unset take (`pdserve.model.generation_config`)."""
    generation_config: str = setting("auto", "Defaults of the sampling fields a request leaves unset (temperature, "
                                     "top_p, top_k): auto (the model's generation_config.json; the embedded "
                                     "SmolLM2-135M-Instruct: its model card's temperature 0.2, top_p 0.9), vllm (none "
                                     "from the model: the command's own, OpenAI's temperature 1 and top_p 1 over "
                                     "HTTP) or PATH (a generation_config.json, or the directory holding one). A field "
                                     "the request sets always wins; serve says at start which defaults are in force "
                                     "and GET /v1/models shows them (sampling_defaults).")

    def __post_init__(self) -> None:
        _require(isinstance(self.generation_config, str) and self.generation_config.strip() != "",
                 f"--generation-config must be auto, vllm or a path, got {self.generation_config!r}",
                 "generation_config")


@dataclass(frozen=True)
class SupervisionSettings:
    """How long the deployment waits on a transfer or a draining worker before it acts."""
    kv_timeout_s: float = setting(30.0, "A KV delivery whose prefill worker sent nothing (not even an `alive` "
                                  "record) for this long lapses: the conductor moves the prompt to another prefill "
                                  "worker, or has the decode worker recompute it.")
    drain_timeout_s: float = setting(30.0, "On SIGTERM (or SIGINT): the longest the requests in flight may take to "
                                     "finish (streams too); serve takes no new connections meanwhile and then stops "
                                     "the workers; a joined worker then leaves, what is left moving to others.")

    # the KV paths' breakers (`pdserve.core.pd.breaker`: one per prefill worker, receiver and transport path)
    kv_send_timeout_s: float = setting(10.0, "One KV connect or send waits at most this long (and at most a third "
                                       "of --kv-timeout-s) before it fails: a blackholed or stalled peer holds a "
                                       "prefill worker's link this long, and a failure this slow opens the path's "
                                       "breaker at once.")
    kv_breaker_failures: int = setting(3, "Failed KV sends in a row (refused, reset) that open a path's breaker: "
                                       "the path takes no new transfers and the conductor routes around it.")
    kv_breaker_cool_s: float = setting(5.0, "An open KV path's breaker lets one probe send through after this "
                                       "long; each reopening without a success in between doubles it (at most "
                                       "60 s).")
    kv_stage_grace_s: float = setting(60.0, "A prompt whose KV delivery failed (its consumer lost, its path open) "
                                      "keeps its KV pinned in the prefill worker's prefix cache this long, so a "
                                      "re-route through that worker finds it instead of recomputing.")

    def __post_init__(self) -> None:
        _require(self.kv_timeout_s > 0, "--kv-timeout-s must be positive", "kv_timeout_s")
        _require(self.drain_timeout_s >= 0, "--drain-timeout-s must be >= 0", "drain_timeout_s")
        _require(self.kv_send_timeout_s > 0, "--kv-send-timeout-s must be positive", "kv_send_timeout_s")
        _require(isinstance(self.kv_breaker_failures, int) and self.kv_breaker_failures >= 1,
                 "--kv-breaker-failures must be an integer >= 1", "kv_breaker_failures")
        _require(self.kv_breaker_cool_s > 0, "--kv-breaker-cool-s must be positive", "kv_breaker_cool_s")
        _require(self.kv_stage_grace_s >= 0, "--kv-stage-grace-s must be >= 0", "kv_stage_grace_s")
