"""Build an engine for a resolved model directory: the model executor and an `LLMEngine` around it.

In a worker process the engine has no detokenizer (the gateway detokenizes; workers speak token ids).
"""

from __future__ import annotations

from pathlib import Path

from pdserve.core.sched.schedule import SchedulerConfig
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_executor import ModelExecutor
from pdserve.model.config import ModelConfig
from pdserve.tokenizer import Tokenizer


def build_engine_at(model_dir: Path, config: EngineConfig, detokenize: bool = True,
                    shared_kv: bool = False, worker: str = "llm", long_context: bool = True) -> LLMEngine:
    """`shared_kv`: the KV pool in shared memory, for a prefill worker whose blocks are read in place;
    `worker` names the worker's own folder in a disk KV tier; `long_context`: contexts may outgrow the
    device pool (with a host tier; not on PD workers, whose prompt blocks are delivered whole)."""
    model_config = ModelConfig.from_dir(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir, model_config.eos_token_ids)
    executor = ModelExecutor(model_dir, model_config, config, shared_kv, worker)
    sched = SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                            max_model_len=executor.info.max_model_len, queue_policy=config.queue_policy,
                            tier_weights=config.tier_weights,
                            service_tiers=tuple(config.service_tiers))
    info = executor.info
    engine = LLMEngine(executor, sched, info.num_kv_blocks, tokenizer if detokenize else None,
                       config.enable_prefix_caching, tokenizer.eos_token_ids, config.kv_eviction_policy,
                       kv_placement=config.kv_placement, kv_max_age_s=config.kv_max_age_s,
                       kv_format=info.dtype if info.kv_cache_dtype == "auto" else info.kv_cache_dtype)
    if long_context and engine.tiers is not None:
        engine.scheduler.enable_long_context(config.kv_hot_window_tokens)
    return engine


def build_worker_engine(model_dir: str, engine_fields: dict, shared_kv: bool = False, worker: str = "worker",
                        long_context: bool = False) -> tuple[LLMEngine, ModelExecutor]:
    engine = build_engine_at(Path(model_dir), EngineConfig(**engine_fields), detokenize=False, shared_kv=shared_kv,
                             worker=worker, long_context=long_context)
    return engine, engine.executor
