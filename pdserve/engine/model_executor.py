"""The real executor: the model its architecture names (`pdserve.model.registry`), its KV block pool and the
sampler, on one device."""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.core.sched.schedule import ExecutorOutput, SchedulerOutput
from pdserve.engine.config import EngineConfig
from pdserve.engine.heap import keep_freed_memory
from pdserve.errors import InvalidRequestError
from pdserve.kv.codec import KVCodec
from pdserve.kv.device_pool import DeviceKVPool, blocks_for_budget
from pdserve.kv.residual import ResidualWindow
from pdserve.kv.tier_io import build_tier_io
from pdserve.model.config import ModelConfig
from pdserve.model.input_batch import CacheLayout, build_input_batch, order_chunks
from pdserve.model import logprobs
from pdserve.model.grammar import GrammarMasks
from pdserve.model.loader import gguf_source, load_safetensors_dir, resolve_dtype
from pdserve.model.quant import QuantLoader, quant_loader, resolve_weights
from pdserve.model.weight_cache import open_cache
from pdserve.model.registry import model_class
from pdserve.model.sampler import Sampler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExecutorInfo:
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    dtype: str
    device: str
    kv_cache_dtype: str = "auto"
    weights: str = "fp32"  # the linear layers' format (`--weights`, auto resolved)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise InvalidRequestError(f"unknown device {name!r}; choose auto, cpu or cuda", param="device")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError("device cuda was asked for but torch sees no CUDA device", param="device")
    return torch.device(name)


class ModelExecutor:
    def __init__(self, model_dir: Path, model_config: ModelConfig, config: EngineConfig,
                 shared_kv: bool = False, worker: str = "llm") -> None:
        torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        self.device = pick_device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # `pdserve.engine.heap`: prefill activations reused, not faulted in again
        self.dtype = resolve_dtype(config.dtype, model_config.torch_dtype, self.device)
        self.block_size = config.block_size
        self.vocab_size = model_config.vocab_size
        max_len = config.max_model_len or model_config.max_position_embeddings
        model = model_class(model_config.architecture)  # `pdserve.model.registry`: LlamaModel for every family today
        fmt = resolve_weights(config.weights, self.device, self.dtype)
        cache = open_cache(config.weights_cache, model_dir, gguf_source(config.model), fmt, self.device, self.dtype)
        # a hit has the quantized blocks already: the GGUF file's blocks are not read (seconds of parsing)
        quant = None if fmt == "fp32" else QuantLoader(fmt) if cache.hit else \
            quant_loader(fmt, config.model, self.device, self.dtype)
        self.model = model(model_config, load_safetensors_dir(model_dir), self.dtype, self.device,
                           max_positions=max_len, attention=config.attention_backend, quant=quant, cache=cache)
        self.weights_cache = {"state": cache.state, "rebuilds": cache.rebuilds, "write_failures": cache.write_failures}
        log.info("pdserve: prepared weights: %s%s", cache.state, "" if cache.path is None else f" ({cache.path})")
        if quant is not None:
            log.info("pdserve: %s", quant.summary())
        self.codec = KVCodec(config.kv_cache_dtype, model_config.head_dim, self.dtype)
        # a codec's residual window (int4: each running sequence's last block in fp16) comes out of the budget
        self.residual = ResidualWindow(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim,
                                       config.block_size, config.max_num_seqs, self.device) \
            if self.codec.spec.residual else None
        budget = int(config.kv_cache_gb * 2**30) - (0 if self.residual is None else self.residual.data.nbytes)
        num_blocks = config.num_kv_blocks or blocks_for_budget(model_config, config.block_size, budget, self.codec)
        self.kv_pool = DeviceKVPool(model_config, num_blocks, config.block_size, self.codec, self.device,
                                    shared=shared_kv)
        # host and disk tiers below the pool (`worker` names this worker's folder in the disk tier)
        self.kv_io = build_tier_io(config, model_config, model_dir, self.kv_pool.layers, self.codec, worker)
        if self.kv_io is not None:  # its thread (and the host tier's memory) ends with this executor
            weakref.finalize(self, self.kv_io.close)
        self.layout = CacheLayout(config.block_size, num_blocks, model_config.num_kv_heads)
        self.sampler = Sampler(config.seed)
        self._model_dir, self._eos = model_dir, model_config.eos_token_ids
        self.grammar: GrammarMasks | None = None  # built on the first request with a grammar
        self.outputs_of: Callable[[str], list[int]] = lambda request_id: []  # (the engine sets it)
        # Called as `layer_observer(scheduled, layer_index)` once a layer's KV of the step is in the pool
        # (a prefill worker delivers it from there while the next layers compute).
        self.layer_observer: Callable[[SchedulerOutput, int], None] | None = None
        self.info = ExecutorInfo(num_blocks, config.block_size, max_len, str(self.dtype).removeprefix("torch."),
                                 str(self.device), self.codec.name, "fp32" if quant is None else quant.fmt)

    def execute(self, scheduled: SchedulerOutput) -> ExecutorOutput:
        for request_id in scheduled.finished_request_ids:
            self.sampler.release(request_id)
            if self.grammar is not None:
                self.grammar.release(request_id)
        if self.residual is not None:
            self.residual.release(scheduled.finished_request_ids + scheduled.preempted_request_ids)
        if scheduled.kv_loads or scheduled.kv_loads_ahead:  # host tier hits: into the blocks this step reads,
            self.kv_io.load(scheduled.kv_loads + scheduled.kv_loads_ahead)  # and a reservation's (ahead)
        if scheduled.is_empty:
            return ExecutorOutput()
        host_kv, host_codec = (None, None) if self.kv_io is None else (self.kv_io.host.data, self.kv_io.host.codec)
        ordered = order_chunks(scheduled.chunks)
        windows = None if self.residual is None else self.residual.plan(ordered)
        batch = build_input_batch(ordered, self.layout, self.device, self.dtype, host_kv, self.codec, self.residual,
                                  windows, host_codec)
        observer = self.layer_observer
        hidden = self.model.forward(batch.input_ids, batch.positions, self.kv_pool.layers, batch.meta,
                                    None if observer is None else lambda i: observer(scheduled, i))
        out = ExecutorOutput(prompt_logprobs=self._prompt_logprobs(ordered, hidden))
        if not batch.sample_chunks:
            return out
        logits = self.model.logits(hidden[batch.sample_rows])
        ids = [c.request_id for c in batch.sample_chunks]
        grammars = [c.sampling_params.grammar for c in batch.sample_chunks]
        constrained = self._constrain(logits, ids, grammars)
        tokens = self.sampler.sample(constrained, ids, [c.sampling_params for c in batch.sample_chunks],
                                     [c.start_pos + c.num_tokens for c in batch.sample_chunks])
        if constrained is not logits:
            self.grammar.advance(ids, grammars, tokens)
        out.sampled_token_ids.update(zip(ids, tokens))
        for row, (c, token) in enumerate(zip(batch.sample_chunks, tokens)):
            k = c.sampling_params.logprobs
            if k is not None:  # (the model's own logprobs, before any grammar's mask, as vLLM gives them)
                out.logprobs[c.request_id] = logprobs.entries(logits[row:row + 1], [token], k)[0]
        return out

    def _constrain(self, logits: torch.Tensor, ids: list[str], grammars: list) -> torch.Tensor:
        """The logits to sample from: masked to each grammar row's allowed tokens (a copy), or as they are."""
        if not any(g is not None for g in grammars):
            return logits
        if self.grammar is None:
            tokenizer_json = (Path(self._model_dir) / "tokenizer.json").read_text()
            self.grammar = GrammarMasks(tokenizer_json, self._eos, self.outputs_of)
            weakref.finalize(self, self.grammar.close)
        masked = logits.clone()
        self.grammar.apply(masked, ids, grammars)
        return masked

    def _prompt_logprobs(self, ordered: list, hidden: torch.Tensor) -> dict[str, list]:
        """The entries of the prompt tokens each chunk's rows predict, for the requests that asked."""
        found, row = {}, 0
        for c in ordered:
            if c.prompt_targets:
                found[c.request_id] = logprobs.prompt_entries(
                    lambda rows: self.model.logits(hidden[rows.to(hidden.device)]), row, c.prompt_targets,
                    c.sampling_params.prompt_logprobs)
            row += c.num_tokens
        return found
