"""The offline Python API: `LLM(model=None).generate(prompts, params)` and `LLM.chat(messages, params)`."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from pdserve.core.sampling_params import DEFAULTABLE, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from pdserve.engine.worker_engine import build_engine_at
from pdserve.errors import InvalidRequestError, check_ttl
from pdserve.model.loader import resolve_model_dir

Prompt = str | list[int]


def build_engine(config: EngineConfig) -> LLMEngine:
    return build_engine_at(resolve_model_dir(config.model), config)


class LLM:
    """Batch generation on one process. Keyword arguments are `EngineConfig` fields; `generation_config` (auto,
    vllm or a path, `pdserve.model.generation_config`) gives the sampling defaults of `generate(params=None)` and
    `get_default_sampling_params`."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        from pdserve.model.generation_config import sampling_defaults
        self.config = EngineConfig(model=model, **kwargs)
        model_dir = resolve_model_dir(self.config.model)
        self.sampling_defaults = sampling_defaults(self.config.generation_config, self.config.model, model_dir)
        self.engine = build_engine_at(model_dir, self.config)
        self.tokenizer = self.engine.tokenizer

    def get_default_sampling_params(self, **fields) -> SamplingParams:
        """`SamplingParams(**fields)`, its sampling fields that `fields` leaves unset (or None) taken from the model's
        defaults (`generation_config`), as vLLM's `LLM.get_default_sampling_params`."""
        sampling = {k: fields.pop(k, None) for k in DEFAULTABLE}
        return SamplingParams(**self.sampling_defaults.fill(**sampling), **fields)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in input order."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(self.get_default_sampling_params() if params is None else params,
                                      len(prompt_list))
        ids: list[str] = []
        try:
            for p, sp in zip(prompt_list, params_list):
                ids.append(self.engine.add_request(p, sp))
        except BaseException:
            self.engine.abort(ids)  # all or nothing: earlier prompts must not linger in the engine
            raise
        return self._run(ids)

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.encode_chat(conv) for conv in conversations]
        return self.generate(prompts, params)

    def prewarm(self, prompt: Prompt, ttl_s: float) -> dict:
        """Compute `prompt`'s KV now and keep its full blocks on the device for `ttl_s` seconds (or until
        `unpin`), so requests that start with it skip that prefill. Returns {"id", "tokens", "blocks"}."""
        check_ttl(ttl_s)
        pin_id = uuid.uuid4().hex
        rid = self.engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), pin=(pin_id, ttl_s))
        out = self._run([rid])[0]
        blocks = self.engine.scheduler.stats.num_pinned_blocks.pop(pin_id, 0)
        return {"id": pin_id, "tokens": len(out.prompt_token_ids), "blocks": blocks}

    def unpin(self, prewarm_id: str) -> bool:
        """End a prewarm's pin early; False for an unknown (or already expired) id."""
        return self.engine.block_manager.unpin(f"prewarm:{prewarm_id}")

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(request_ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
        except BaseException:
            self.engine.abort([r for r in request_ids if r not in done])
            raise
        return [done[r] for r in request_ids]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if not isinstance(prompts, Sequence) or not prompts:
        raise InvalidRequestError("prompts must be a string, token ids, or a non-empty list of them",
                                  param="prompt")
    return list(prompts)


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise InvalidRequestError(f"got {len(params)} sampling params for {n} prompts", param="params")
    return list(params)


