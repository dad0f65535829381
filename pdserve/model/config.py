"""Model shape read from a Hugging Face `config.json` (pure Python: the simulator uses it too)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pdserve.errors import ModelNotFoundError, UnsupportedModelError
from pdserve.model.registry import architecture_of


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    rope_scaling: tuple[tuple[str, object], ...] | None = None  # frozen form of the HF dict
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    architecture: str = "LlamaForCausalLM"  # its entry in `pdserve.model.registry`: the class that runs it

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def num_params(self) -> int:
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> ModelConfig:
        arch = architecture_of(cfg)  # the registry's entry (an unknown architecture: one line)
        family = arch.family
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("Llama models with mlp_bias=true are not supported")
        heads = cfg["num_attention_heads"]
        rope_scaling, rope_theta = _rope_settings(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            family=family, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=rope_theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias, o_bias=family == "llama" and attention_bias,
            rope_scaling=tuple(sorted(rope_scaling.items())) if rope_scaling else None,
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"), architecture=arch.name)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ModelNotFoundError(f"no config.json in model directory {str(path)!r}")
        return cls.from_hf_dict(json.loads(config_path.read_text()))


def _rope_settings(cfg: dict) -> tuple[dict | None, float]:
    """(scaling, theta) from either `rope_scaling` + `rope_theta` (transformers 4 and most checkpoints)
    or `rope_parameters` (transformers 5, which folds theta into it)."""
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return None, theta
    if kind not in ("llama3", "linear"):
        raise UnsupportedModelError(f"unsupported rope scaling type {kind!r} (supported: llama3, linear)")
    return scaling, theta


def model_fingerprint(path: str | Path) -> str:
    """Which model a directory holds, to compare across hosts: a hash of its config.json and its tokenizer
    (weights are not read: hashing gigabytes would add seconds to every start). Workers that join a
    deployment must match the gateway's."""
    import hashlib
    digest = hashlib.sha256()
    for name in ("config.json", "tokenizer.json"):
        file = Path(path) / name
        digest.update(file.read_bytes() if file.is_file() else b"")
    return digest.hexdigest()[:16]
