"""The Llama-family decoder (Llama 2/3, SmolLM, Mistral without sliding window, Qwen2) over a paged KV cache.

Projections are fused (q|k|v, gate|up) so a layer makes four matmul calls, each through `Linear`, which
picks the fastest kernel for the row count (packed MKL sgemm for decode-sized batches on CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from pdserve.errors import UnsupportedModelError
from pdserve.model import kernels
from pdserve.model.attention import AttentionMetadata, paged_attention, rope_write, select_backend
from pdserve.model.config import ModelConfig
from pdserve.model.fused_decode import FusedDecode
from pdserve.model.hugepages import Arena
from pdserve.model.linear import Linear, mkl_packing_available
from pdserve.model.quant import QuantLinear, QuantLoader
from pdserve.model.rope import RotaryEmbedding
from pdserve.model.weight_cache import WeightCache


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [H]
    qkv: Linear  # H -> (Hq + 2 Hkv) * D
    o: Linear  # Hq * D -> H
    mlp_norm: torch.Tensor  # [H]
    gate_up: Linear  # H -> 2 I
    down: Linear  # I -> H


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused op, bit-identical to the reference formula below in fp32
        return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()  # Hugging Face order: normalize in fp32, cast back, then scale
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, max_positions: int, attention: str = "auto",
                 quant: QuantLoader | None = None, cache: WeightCache | None = None) -> None:
        """`quant`: the linear layers on quantized blocks (`pdserve.model.quant`); None: in `dtype`. `cache`: the
        prepared-weights cache (`pdserve.model.weight_cache`): its tensors on a hit, else filled and saved."""
        self.config = config
        self.quant = quant
        self.cache = cache or WeightCache(None)
        self.prepared: dict[str, dict] = {}  # each linear layer's entry in the cache's metadata
        self.dtype = dtype
        self.device = device
        self.attention = select_backend(attention, device, dtype)  # `pdserve.model.attention`: chosen once, here
        self.scale = config.head_dim ** -0.5
        self.pack = mkl_packing_available(device, dtype)
        self.arena = Arena() if self.pack else None  # the GEMM kernels' panels, on huge pages, in read order
        get = _WeightGetter(weights, dtype, device)
        self.embed = get("model.embed_tokens.weight")  # [V, H]
        self.layers = [self._load_layer(get, i) for i in range(config.num_layers)]
        self.norm = get("model.norm.weight")
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        self.lm_head = self._linear(get, [head])
        self.rope = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                                    config.rope_scaling_dict, dtype, device)
        get.check_all_used()
        self._settle_cache()
        self.fused = None if quant is None else FusedDecode.build(self)  # decode steps in one compiled call

    def _load_layer(self, get: _WeightGetter, i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        qkv_names = [f"{p}self_attn.{n}_proj.weight" for n in "qkv"]
        bqkv = torch.cat([get(f"{p}self_attn.{n}_proj.bias") for n in "qkv"]) if self.config.qkv_bias else None
        gate_up_names = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        bo = get(p + "self_attn.o_proj.bias") if self.config.o_bias else None
        return LayerWeights(
            attn_norm=get(p + "input_layernorm.weight"), qkv=self._linear(get, qkv_names, bqkv),
            o=self._linear(get, [p + "self_attn.o_proj.weight"], bo),
            mlp_norm=get(p + "post_attention_layernorm.weight"),
            gate_up=self._linear(get, gate_up_names),
            down=self._linear(get, [p + "mlp.down_proj.weight"]))

    def _linear(self, get: _WeightGetter, names: list[str], bias: torch.Tensor | None = None):
        """The linear layer of the checkpoint's tensors `names` (stacked): quantized blocks under `quant` (where
        it can: else, as without it,) or `Linear` in the model's dtype; prepared from the checkpoint and put in
        the cache, or read from it on a hit."""
        key, cache = names[0], self.cache
        if cache.hit:
            return self._cached_linear(get, names, bias)
        weight = get.cat(names) if len(names) > 1 else get(key)
        quantized = None if self.quant is None else self.quant.linear(names, weight, bias, self.arena)
        if quantized is not None:
            self.prepared[key] = {"kind": quantized.kind, "n": quantized.n, "k": quantized.k}
            cache.put(key + ".qpanels", quantized.panels)
            return quantized
        linear = Linear(weight, bias, self.pack, self.arena)
        self.prepared[key] = {"kind": "fp32"}
        if len(names) > 1:  # a stack of checkpoint tensors (one tensor: read from the checkpoint again)
            cache.put(key + ".weight", linear.weight)
        if linear.panels is not None:
            cache.put(key + ".panels", linear.panels.panels)
        return linear

    def _cached_linear(self, get: _WeightGetter, names: list[str], bias: torch.Tensor | None):
        key, cache = names[0], self.cache
        entry = cache.meta["linears"][key]
        get.mark(names)
        if entry["kind"] != "fp32":
            return QuantLinear.of_panels(entry["kind"], entry["n"], entry["k"], cache.get(key + ".qpanels"), bias,
                                         self.arena)
        weight = cache.get(key + ".weight") if len(names) > 1 else get(key)
        return Linear(weight, bias, self.pack, self.arena, cache.found.get(key + ".panels"))

    def _settle_cache(self) -> None:
        """A hit: the quantized loader's counts as the load that prepared the tensors had them; a miss: saves."""
        quant = self.quant
        if self.cache.hit:
            if quant is not None:
                quant.sources, quant.nbytes = dict(self.cache.meta["sources"]), self.cache.meta["nbytes"]
            return
        self.cache.save({"linears": self.prepared, "sources": {} if quant is None else quant.sources,
                         "nbytes": 0 if quant is None else quant.nbytes})

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; kv_caches[layer]: [2, Hkv, num_blocks, block_size, D] -> hidden states [T, H].

        `layer_done(i)` runs as soon as layer i's KV is in the cache (prefill workers deliver it from there
        while the next layers compute)."""
        cfg = self.config
        x = self.embed[input_ids]
        cos, sin = self.rope.lookup(positions)
        if self.fused is not None and self.fused.serves(meta, x.shape[0], layer_done):
            self.fused.run(x, cos, sin, kv_caches, meta)
            return rms_norm(x, self.norm, cfg.rms_norm_eps)
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            # CPU fp32: compiled kernels for everything but the four matmuls (counted torch fallback else)
            h = kernels.add_rms_norm(x, None, layer.attn_norm, cfg.rms_norm_eps)
            q, k, v, exact = rope_write(layer.qkv(h), cos, sin, cache, meta, cfg.num_heads, cfg.num_kv_heads, i,
                                        self.attention)
            if layer_done is not None:
                layer_done(i)
            attn = layer.o(paged_attention(q, k, v, cache[0], cache[1], meta, self.scale, i, exact, self.attention))
            h = kernels.add_rms_norm(x, attn, layer.mlp_norm, cfg.rms_norm_eps)  # x += attn, in place
            x.add_(layer.down(kernels.silu_mul(layer.gate_up(h))))
        return rms_norm(x, self.norm, cfg.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, H] (only the rows that sample) -> fp32 logits [S, V]."""
        return self.lm_head(hidden).float()


class _WeightGetter:
    """Fetches HF-named tensors with a clear error for a missing one, and reports unexpected extras."""

    _IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

    def __init__(self, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
        self.weights, self.dtype, self.device = weights, dtype, device
        self.used: set[str] = set()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            raise UnsupportedModelError(f"weight {name!r} missing from the checkpoint")
        self.used.add(name)
        return self.weights[name].to(device=self.device, dtype=self.dtype)

    def cat(self, names: list[str]) -> torch.Tensor:
        return torch.cat([self(n) for n in names])

    def mark(self, names: list[str]) -> None:
        """Counts `names` as used (their prepared form came from the weights cache), checking they exist."""
        for name in names:
            if name not in self.weights:
                raise UnsupportedModelError(f"weight {name!r} missing from the checkpoint")
            self.used.add(name)

    def check_all_used(self) -> None:
        extra = [n for n in self.weights if n not in self.used and not n.endswith(self._IGNORED_SUFFIXES)]
        extra = [n for n in extra if n != "lm_head.weight"]  # tied checkpoints sometimes store it anyway
        if extra:
            raise UnsupportedModelError(f"checkpoint has weights this architecture does not use: {extra[:5]}")
