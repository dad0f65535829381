"""What the simulator knows about hardware and models: GPU specs, model shapes, prices.

Numbers are public datasheet values (dense bf16 tensor FLOP/s, HBM bandwidth, memory, NVLink and per-GPU
network bandwidth) with an efficiency factor per GPU: the share of peak compute (`mfu`) and of memory
bandwidth (`mbu`) a good serving engine reaches. The KV tiers below the device pool move bytes over the
GPU's host link and the node's NVMe drives (`host_link_bw`, `disk_read_bw`, `disk_write_bw`; sources and
assumptions next to the table). Prices are indicative on-demand cloud rates in USD per GPU-hour; pass your
own with `--price-per-gpu-hour`. Model presets hold only what the time model needs; a Hugging Face
`config.json` path works too, of an architecture the engine runs (`pdserve.model.registry`). A model's
`kv_cache_dtype` (`pdserve.core.kvstore.kv_codecs`, `auto` = the weights' dtype) sizes its KV bytes per token, hence
the device pool, the KV link and the host/disk tier blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from pdserve.core.kvstore import kv_codecs
from pdserve.errors import InvalidRequestError
from pdserve.model.config import ModelConfig

GB = 1e9


@dataclass(frozen=True)
class GPUSpec:
    name: str
    bf16_flops: float  # dense peak, FLOP/s
    mem_bw: float  # HBM bytes/s
    mem_bytes: float
    nvlink_bw: float  # bytes/s per GPU inside a node (tensor-parallel all-reduce)
    net_bw: float  # bytes/s per GPU across nodes (KV delivery between engines)
    mfu: float = 0.5  # reachable share of peak FLOP/s
    mbu: float = 0.8  # reachable share of memory bandwidth
    price_per_hour: float = 2.0  # USD per GPU-hour
    # KV tiers (`pdserve.sim.tier_io`), per GPU; an engine on `tp` GPUs has `tp` times these.
    host_link_bw: float = 25 * GB  # bytes/s each way, GPU <-> pinned host memory (PCIe)
    disk_read_bw: float = 6 * GB  # bytes/s, NVMe sequential read (the disk tier's prefetches)
    disk_write_bw: float = 3.5 * GB  # bytes/s, NVMe sequential write (the disk tier's flushes)


# Host link: the effective bandwidth of a pinned-memory copy (cudaMemcpyAsync, as `bandwidthTest` measures it),
# about 80% of the PCIe x16 link's theoretical rate per direction: Gen4 x16 (A100, A800, L40S) is 31.5 GB/s
# theoretical, ~25 GB/s measured; Gen5 x16 (H100 SXM, H200) is 63 GB/s theoretical, ~50-55 GB/s measured.
# Disk: one datacenter Gen4 NVMe drive per GPU (a DGX A100/H100 node has 8 U.2 drives for 8 GPUs), e.g.
# Samsung PM1733 / Micron 7450 class: ~6-7 GB/s sequential read and ~3.5-4 GB/s sequential write on the
# datasheets; we take 6 and 3.5 GB/s (KV blocks are MB-sized, so sequential rates apply). These are
# assumptions of this table, not measurements of a given server: override them with --host-link-gb-s,
# --disk-read-gb-s and --disk-write-gb-s.
GEN4_LINK, GEN5_LINK = 25 * GB, 50 * GB


GPUS: dict[str, GPUSpec] = {g.name: g for g in (
    GPUSpec("a100-80g", 312e12, 2.039e12, 80 * GB, 300 * GB, 25 * GB, 0.55, 0.80, 1.80, host_link_bw=GEN4_LINK),
    GPUSpec("a800", 312e12, 2.039e12, 80 * GB, 200 * GB, 25 * GB, 0.55, 0.80, 1.50, host_link_bw=GEN4_LINK),
    GPUSpec("h100", 989e12, 3.35e12, 80 * GB, 450 * GB, 50 * GB, 0.45, 0.80, 2.90, host_link_bw=GEN5_LINK),
    GPUSpec("h200", 989e12, 4.8e12, 141 * GB, 450 * GB, 50 * GB, 0.45, 0.80, 3.70, host_link_bw=GEN5_LINK),
    GPUSpec("l40s", 362e12, 0.864e12, 48 * GB, 32 * GB, 12.5 * GB, 0.50, 0.75, 1.00, host_link_bw=GEN4_LINK),
)}
GPU_ALIASES = {"a100": "a100-80g", "h100-80g": "h100", "h100-sxm": "h100", "h200-141g": "h200"}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int = 0  # 0: hidden // num_heads
    tied_embeddings: bool = False
    dtype_bytes: int = 2  # bf16 weights (and KV under kv_cache_dtype auto)
    max_model_len: int = 131072
    kv_cache_dtype: str = "auto"  # a `pdserve.core.kvstore.kv_codecs` name: how the KV pool, links and tiers code KV

    def __post_init__(self) -> None:
        kv_codecs.token_bytes(self.kv_cache_dtype, self.hd, self.dtype_bytes)  # a bad name or head size: one line

    @classmethod
    def from_config(cls, config: ModelConfig, name: str) -> ModelSpec:
        """What the time model needs of a model the engine runs (`ModelConfig`, of an architecture in
        `pdserve.model.registry`)."""
        return cls(name, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
                   config.intermediate_size, config.vocab_size, head_dim=config.head_dim,
                   tied_embeddings=config.tie_word_embeddings, dtype_bytes=_DTYPE_BYTES.get(config.torch_dtype, 2),
                   max_model_len=config.max_position_embeddings)

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.num_heads

    @property
    def layer_params(self) -> int:
        attn = self.hidden * self.hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        return attn + 3 * self.hidden * self.intermediate

    @property
    def num_params(self) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.num_layers * self.layer_params + embed

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token, every layer and KV head, coded in `kv_cache_dtype` (scales included)."""
        return kv_codecs.kv_bytes_per_token(self.kv_cache_dtype, self.num_layers, self.num_kv_heads, self.hd,
                                            self.dtype_bytes)

    @property
    def kv_format(self) -> str:
        """The codec the KV blocks record (`auto`: the model's dtype), as the real worker names it."""
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        return {1: "float8", 2: "bfloat16", 4: "float32"}.get(self.dtype_bytes, "bfloat16")

    @property
    def kv_dequant_overhead(self) -> float:
        """Decoding the KV codes, as a share of the time attention takes to read their bytes."""
        return kv_codecs.CODECS[self.kv_cache_dtype].dequant_overhead

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes


MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, max_model_len=8192),
    ModelSpec("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, max_model_len=4096),
    ModelSpec("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, max_model_len=131072),
    ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, max_model_len=131072),
    ModelSpec("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, max_model_len=131072),
)}


def get_gpu(name: str) -> GPUSpec:
    key = GPU_ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        raise InvalidRequestError(f"unknown GPU {name!r}; choose from {', '.join(sorted(GPUS))}", param="gpu")
    return GPUS[key]


def get_model(name: str, kv_cache_dtype: str = "auto") -> ModelSpec:
    """A preset by name, or a Hugging Face `config.json` (or the directory holding it), its KV coded in
    `kv_cache_dtype`."""
    kv_codecs.check(kv_cache_dtype)
    if name.lower() in MODELS:
        return replace(MODELS[name.lower()], kv_cache_dtype=kv_cache_dtype)
    path = Path(name)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise InvalidRequestError(f"unknown model {name!r}: not a preset ({', '.join(sorted(MODELS))}) "
                                  "nor a config.json path", param="model")
    model = model_from_hf_config(json.loads(path.read_text()), name=path.parent.name or name)
    return replace(model, kv_cache_dtype=kv_cache_dtype)


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # a config's torch_dtype: its weights' and KV's bytes


def model_from_hf_config(cfg: dict, name: str = "hf-model") -> ModelSpec:
    """A config.json read as the engine reads it (`ModelConfig.from_hf_dict`: an architecture the model registry
    does not hold is a one-line error). Where it is silent the simulator assumes a GPU deployment's bf16 weights
    and 131072 positions (the engine: fp32 on CPU, 2048)."""
    try:
        config = ModelConfig.from_hf_dict(cfg)
    except KeyError as e:
        raise InvalidRequestError(f"config.json of {name} lacks {e.args[0]}", param="model") from None
    return replace(ModelSpec.from_config(config, name), dtype_bytes=_DTYPE_BYTES.get(cfg.get("torch_dtype"), 2),
                   max_model_len=cfg.get("max_position_embeddings", 131072))


def kv_pool_blocks(model: ModelSpec, gpu: GPUSpec, tp: int, block_size: int, mem_util: float = 0.9,
                   max_num_seqs: int = 256) -> int:
    """KV blocks that fit on `tp` GPUs after the weights (vLLM-style: `mem_util` of memory, minus weights,
    minus a 5% activation reserve, minus a codec's residual windows for `max_num_seqs` sequences). Raises when
    the weights alone do not fit."""
    window = kv_codecs.residual_bytes_per_seq(model.kv_cache_dtype, model.num_layers, model.num_kv_heads, model.hd,
                                              block_size)
    free = tp * gpu.mem_bytes * (mem_util - 0.05) - model.weight_bytes - window * max_num_seqs
    blocks = int(free // (model.kv_bytes_per_token * block_size))
    if blocks < 1:
        raise InvalidRequestError(f"{model.name} ({model.weight_bytes / GB:.0f} GB of weights) does not fit on "
                                  f"{tp} x {gpu.name}; raise --tp", param="tp")
    return blocks
