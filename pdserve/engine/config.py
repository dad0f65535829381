"""Engine configuration: one frozen dataclass, its field help reused by the CLI."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    """Hugging Face model directory or .gguf file; default: the embedded SmolLM2-135M-Instruct."""
    dtype: str = "auto"
    """auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    kv_cache_dtype: str = "auto"
    """KV cache codec: auto (the model dtype), fp16, bf16, fp8_e4m3, int8 or int4 (scales per token and head,
    inside each block; the pool, delivery and the host and disk tiers hold the coded blocks). int4 also keeps
    each running sequence's last block in fp16 (a residual window, out of --kv-cache-gb)."""
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_gb: float = 2.0
    """Memory for the KV block pool, in GiB."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks (overrides --kv-cache-gb)."""
    max_model_len: int | None = None
    """Longest prompt + output; default: the model's context length."""
    max_num_seqs: int = 128
    """Most requests decoding at once."""
    max_num_batched_tokens: int = 2048
    """Token budget per step; longer prompts are prefilled in chunks of this size."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""
    kv_host_gb: float = 4.0
    """Host-memory KV tier per worker, in GiB (0: none). Full blocks are copied there as they are produced
    (on a background thread), so a block evicted from the device pool is loaded back instead of recomputed."""
    kv_disk_dir: str | None = None
    """Disk KV tier directory (none: no disk tier). Blocks in host are copied there too; it survives restarts."""
    kv_disk_gb: float = 16.0
    """Disk KV tier size per worker, in GiB (with --kv-disk-dir)."""
    kv_checkpoint_tokens: int = 256
    """With a disk tier (`pdserve serve`): a decode worker reports a request's KV checkpoint (its leading blocks,
    written through to disk) each time it grew by this many tokens; when the worker dies, the request resumes
    on another from there, computing only the rest (0: never; such requests are recomputed in full)."""
    kv_hot_window_tokens: int = 4096
    """Long contexts: the most KV tokens one request keeps on the device (at most half the pool); its older
    blocks are read from the host tier layer by layer, so a context may outgrow the device pool (needs a
    host tier; colocated workers and LLM only)."""
    kv_eviction_policy: str = "lru"
    """Which cached KV block leaves a full tier first: lru or heat (decayed use count)."""
    queue_policy: str = "tiered"
    """Waiting-queue and preemption order: tiered (by service tier, FCFS within one), fcfs or priority (the
    request's integer priority, lowest first)."""
    service_tiers: tuple[str, ...] = ()
    """Service tiers (`--service-tier NAME:ttft_ms=X,tpot_ms=Y[,share=Z]`, repeatable): their SLOs and the
    priority tier's reserved share of every worker."""
    seed: int | None = None
    """Seed of the sampler for requests without their own seed."""
    num_threads: int | None = None
    """CPU threads for torch; default: all cores."""

    def __post_init__(self) -> None:
        # Checked here so a bad flag is a one-line error before any model is loaded.
        from pdserve.errors import InvalidRequestError
        positive = {"block_size": self.block_size, "kv_cache_gb": self.kv_cache_gb,
                    "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                    "num_kv_blocks": self.num_kv_blocks, "max_model_len": self.max_model_len,
                    "num_threads": self.num_threads, "kv_hot_window_tokens": self.kv_hot_window_tokens}
        for name, value in positive.items():
            if value is not None and not value > 0:
                raise InvalidRequestError(f"{name} must be positive, got {value!r}", param=name)
        self._check_tiers()
        from pdserve.core.kv_codecs import check
        check(self.kv_cache_dtype)

    def _check_tiers(self) -> None:
        from pdserve.core.kv_meta import EVICTION_POLICIES
        from pdserve.errors import InvalidRequestError
        if not self.kv_host_gb >= 0:
            raise InvalidRequestError(f"kv_host_gb must be >= 0, got {self.kv_host_gb!r}", param="kv_host_gb")
        if not self.kv_checkpoint_tokens >= 0:
            raise InvalidRequestError(f"kv_checkpoint_tokens must be >= 0, got {self.kv_checkpoint_tokens!r}",
                                      param="kv_checkpoint_tokens")
        if not self.kv_disk_gb > 0:
            raise InvalidRequestError(f"kv_disk_gb must be positive, got {self.kv_disk_gb!r}", param="kv_disk_gb")
        if self.kv_eviction_policy not in EVICTION_POLICIES:
            raise InvalidRequestError(f"unknown kv_eviction_policy {self.kv_eviction_policy!r}; choose from "
                                      f"{sorted(EVICTION_POLICIES)}", param="kv_eviction_policy")
        if self.kv_disk_dir is not None:
            if self.kv_host_gb == 0:
                raise InvalidRequestError("a disk KV tier (kv_disk_dir) needs a host tier: set kv_host_gb > 0",
                                          param="kv_disk_dir")
            from pdserve.kv.disk_store import check_writable
            check_writable(self.kv_disk_dir)


def field_help(cls) -> dict[str, str]:
    """Attribute docstrings of a config dataclass, for generated CLI help."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)
    return {f.name: docs.get(f.name, "") for f in fields(cls)}
