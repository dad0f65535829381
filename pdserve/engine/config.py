"""Engine configuration: one frozen dataclass, its field help reused by the CLI (`pdserve.flags`). The KV block,
KV codec and KV storage tier fields are the slices' of `pdserve.core.settings` (default, help and check there);
the batch fields take their defaults and their check from the scheduler's own config (`SchedulerConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.core.sched.schedule import SchedulerConfig
from pdserve.model import attention_registry
from pdserve.core.settings import (CodecSettings, GenerationSettings, KvBlockSettings, KvTierSettings, WeightSettings,
                                   default_of, pick, shared)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    """Hugging Face model directory or .gguf file; default: the embedded SmolLM2-135M-Instruct."""
    dtype: str = "auto"
    """auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    weights: str = shared(WeightSettings, "weights")
    weights_cache: str = shared(WeightSettings, "weights_cache")
    attention_backend: str = attention_registry.AUTO
    """Which attention backend runs the model: auto (the compiled CPU kernels on CPU; the torch reference on a
    device no other backend serves), cpu_kernels or torch (the reference). A backend named here that cannot run
    the model on this machine (kernels not built, another device or dtype) is an error at load, not a fallback."""
    kv_cache_dtype: str = shared(CodecSettings, "kv_cache_dtype")
    kv_host_cache_dtype: str | None = shared(CodecSettings, "kv_host_cache_dtype")
    kv_disk_cache_dtype: str | None = shared(CodecSettings, "kv_disk_cache_dtype")
    block_size: int = shared(KvBlockSettings, "block_size")
    kv_cache_gb: float = 2.0
    """Memory for the KV block pool, in GiB."""
    num_kv_blocks: int | None = shared(KvBlockSettings, "num_kv_blocks")
    max_model_len: int | None = None
    """Longest prompt + output; default: the model's context length."""
    max_num_seqs: int = default_of(SchedulerConfig, "max_num_seqs")
    """Most requests decoding at once."""
    max_num_batched_tokens: int = default_of(SchedulerConfig, "max_num_batched_tokens")
    """Token budget per step; longer prompts are prefilled in chunks of this size."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""
    kv_host_gb: float = shared(KvTierSettings, "kv_host_gb")
    kv_disk_dir: str | None = None
    """Disk KV tier directory (none: no disk tier). Blocks in host are copied there too; it survives restarts."""
    kv_disk_key_file: str | None = None
    """A file of at least 32 secret bytes: the disk tier's blocks (and so KV checkpoints) are written encrypted
    and authenticated (ChaCha20-Poly1305, a key derived from it; `pdserve.kv.block_seal`). A folder written under
    another key is emptied at start (counted), never read."""
    kv_disk_gb: float = shared(KvTierSettings, "kv_disk_gb")
    kv_remote: str | None = None
    """A KV pool shared by every worker of the deployment, below each one's host and disk tiers: Mooncake Store at
    mooncake://MASTER_HOST:PORT[?metadata=URL] (its metadata server; default: the master's host, port 8080; the
    pool's memory is its store servers', `mooncake_client -global_segment_size=...`), or (`pdserve serve`) local:
    a master and a store server of its own (--kv-remote-pool-gb), started and stopped with it. Blocks are written
    through to it from host and found by every worker, so a prefix computed on one is a hit on all; secret KV goes
    there only sealed (--kv-disk-key-file). Needs pdserve[mooncake] (and Debian's libibverbs1). Default: none."""
    kv_remote_gb: float = 0.0
    """With --kv-remote: memory this worker lends the shared pool besides its store servers', in GiB (0: none; what
    a worker lends goes when it does, with the blocks in it)."""
    kv_checkpoint_tokens: int = 256
    """With a disk tier (`pdserve serve`): a decode worker reports a request's KV checkpoint (its leading blocks,
    written through to disk) each time it grew by this many tokens; when the worker dies, the request resumes
    on another from there, computing only the rest (0: never; such requests are recomputed in full)."""
    kv_hot_window_tokens: int = 4096
    """Long contexts: the most KV tokens one request keeps on the device (at most half the pool); its older
    blocks are read from the host tier layer by layer, so a context may outgrow the device pool (needs a
    host tier; colocated workers and LLM only)."""
    kv_eviction_policy: str = shared(KvTierSettings, "kv_eviction_policy")
    kv_placement: str = shared(KvTierSettings, "kv_placement")
    kv_max_age_s: float = shared(KvTierSettings, "kv_max_age_s")
    queue_policy: str = default_of(SchedulerConfig, "queue_policy")
    """Waiting-queue and preemption order: tiered (by service tier, FCFS within one), fcfs or priority (the
    request's integer priority, lowest first)."""
    tier_weights: str = default_of(SchedulerConfig, "tier_weights")
    """The elastic tiers' (default, flex) weights under the tiered policy: dynamic (scaled each step by SLO
    slack, queue age, transfer progress and decode load; `pdserve.core.sched.tier_weights`) or static."""
    service_tiers: tuple[str, ...] = ()
    """Service tiers (`--service-tier NAME:ttft_ms=X,tpot_ms=Y[,share=Z]`, repeatable): their SLOs and the
    priority tier's reserved share of every worker."""
    seed: int | None = None
    """Seed of the sampler for requests without their own seed."""
    generation_config: str = shared(GenerationSettings, "generation_config")
    num_threads: int | None = None
    """CPU threads for torch; default: all cores."""

    def __post_init__(self) -> None:
        # Checked here so a bad flag is a one-line error before any model is loaded.
        from pdserve.errors import InvalidRequestError
        positive = {"kv_cache_gb": self.kv_cache_gb, "max_model_len": self.max_model_len,
                    "num_threads": self.num_threads, "kv_hot_window_tokens": self.kv_hot_window_tokens}
        for name, value in positive.items():
            if value is not None and not value > 0:
                raise InvalidRequestError(f"{name} must be positive, got {value!r}", param=name)
        pick(KvBlockSettings, self)
        pick(GenerationSettings, self)
        pick(WeightSettings, self)
        attention_registry.check(self.attention_backend)
        SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                        queue_policy=self.queue_policy, tier_weights=self.tier_weights)  # the scheduler's own check
        self._check_tiers()
        pick(CodecSettings, self)

    def _check_remote(self) -> None:
        from pdserve.errors import InvalidRequestError
        from pdserve.kv.remote_store import LOCAL, parse_remote
        if self.kv_remote != LOCAL:  # (local: resolved by `pdserve serve`, which starts the master)
            parse_remote(self.kv_remote)
        if self.kv_host_gb == 0:
            raise InvalidRequestError("a shared KV pool (kv_remote) needs a host tier: set kv_host_gb > 0",
                                      param="kv_remote")
        if not self.kv_remote_gb >= 0:
            raise InvalidRequestError(f"kv_remote_gb must be >= 0, got {self.kv_remote_gb!r}", param="kv_remote_gb")

    def _check_tiers(self) -> None:
        from pdserve.errors import InvalidRequestError
        pick(KvTierSettings, self)
        if not self.kv_checkpoint_tokens >= 0:
            raise InvalidRequestError(f"kv_checkpoint_tokens must be >= 0, got {self.kv_checkpoint_tokens!r}",
                                      param="kv_checkpoint_tokens")
        if not self.kv_disk_gb > 0:
            raise InvalidRequestError(f"kv_disk_gb must be positive, got {self.kv_disk_gb!r}", param="kv_disk_gb")
        if self.kv_disk_dir is not None:
            if self.kv_host_gb == 0:
                raise InvalidRequestError("a disk KV tier (kv_disk_dir) needs a host tier: set kv_host_gb > 0",
                                          param="kv_disk_dir")
            from pdserve.kv.disk_store import check_writable
            check_writable(self.kv_disk_dir)
        if self.kv_remote is not None:
            self._check_remote()
        if self.kv_disk_key_file is not None:
            if self.kv_disk_dir is None and self.kv_remote is None:
                raise InvalidRequestError("kv_disk_key_file seals the disk KV tier (and the shared pool): set "
                                          "kv_disk_dir or kv_remote too", param="kv_disk_key_file")
            from pdserve.kv.block_seal import BlockSeal
            BlockSeal.from_key_file(self.kv_disk_key_file, "")  # readable, long enough: else a one-line error

