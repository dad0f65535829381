"""Measure the real engine's step times over batch shapes and fit the simulator's time model to them.

    pdserve profile [--model PATH] [--num-threads N] --output fit.json

Prefill steps: one prefill-only request of T prompt tokens per step (T from 16 to the token budget), as a
PD prefill worker runs it (sampling the first token at the end, like a colocated prefill), timed around
`LLMEngine.step()` — so scheduling and batch building are inside, as in the serving loop.
Decode steps: B requests whose prompts (C tokens each) are already computed, timed over several steps.
Fitted (DistServe-style, least squares on relative error over the medians):

    prefill_s = a + b * sum(tokens) + c * sum(tokens^2)
    decode_s  = a + b * sum(context) + c * batch

The JSON holds the coefficients, the samples they came from, and the machine and model they describe.
`merge_profiles` fits over the samples of several such files together (e.g. profiles taken before and after
a run, so the model describes the machine over the run rather than at one moment).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import replace

import numpy as np

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.config import EngineConfig

PREFILL_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DECODE_CONTEXTS = (64, 256, 1024)


def _prompt(n: int, salt: int) -> list[int]:
    rng = np.random.default_rng(salt)
    return rng.integers(100, 30000, size=n).tolist()


def _timed_step(engine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def _prefill_step(engine, tokens: int, salt: int) -> float:
    """Time one prefill-only step, as a PD prefill worker runs it (the prompt, then the first token sampled)."""
    engine.add_request(_prompt(tokens, salt), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                       prefill_only=True)
    seconds = _timed_step(engine)
    while engine.has_unfinished():
        engine.step()
    return seconds


def profile_prefill(engine, shapes=PREFILL_TOKENS, repeats: int = 3, salt: int = 0) -> list[dict]:
    budget = engine.scheduler.config.max_num_batched_tokens
    samples = []
    for tokens in [t for t in shapes if t <= budget]:
        times = [_prefill_step(engine, tokens, salt + r) for r in range(repeats + 1)]  # the first: warm-up
        salt += repeats + 1
        samples.append({"kind": "prefill", "tokens": [tokens], "seconds": statistics.median(times[1:])})
    return samples


def profile_decode(engine, batches=DECODE_BATCHES, contexts=DECODE_CONTEXTS, steps: int = 6,
                   salt: int = 10_000) -> list[dict]:
    samples = []
    for context in contexts:
        for batch in batches:
            if batch * (context + steps + 1) > engine.block_manager.num_blocks * engine.block_manager.block_size:
                continue
            params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
            ids = [engine.add_request(_prompt(context, salt + i), params) for i in range(batch)]
            salt += batch
            while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
                engine.step()
            times = [_timed_step(engine) for _ in range(steps)]
            engine.abort(ids)
            samples.append({"kind": "decode", "batch": batch, "context_sum": batch * (context + 1 + steps // 2),
                            "seconds": statistics.median(times[1:])})
    return samples


def fit(samples: list[dict]) -> dict:
    pre = [s for s in samples if s["kind"] == "prefill"]
    dec = [s for s in samples if s["kind"] == "decode"]
    a_pre = np.array([[1.0, sum(s["tokens"]), sum(t * t for t in s["tokens"])] for s in pre])
    a_dec = np.array([[1.0, s["context_sum"], s["batch"]] for s in dec])
    coef_pre = _relative_lstsq(a_pre, np.array([s["seconds"] for s in pre]))
    coef_dec = _relative_lstsq(a_dec, np.array([s["seconds"] for s in dec]))
    return {"prefill": dict(zip("abc", map(float, coef_pre))), "decode": dict(zip("abc", map(float, coef_dec)))}


def _relative_lstsq(a: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Least squares on relative error (rows divided by the measured time): a 60 ms step is fitted as
    closely as a 5 s one, instead of the big steps dominating and the small ones -- most of a serving
    run's steps -- absorbing the error."""
    return np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)[0]


def run_profile(config: EngineConfig, prefill_tokens=PREFILL_TOKENS, decode_batches=DECODE_BATCHES,
                decode_contexts=DECODE_CONTEXTS) -> dict:
    from pdserve.engine.llm import build_engine
    engine = build_engine(replace(config, enable_prefix_caching=False))
    samples = profile_prefill(engine, prefill_tokens) + profile_decode(engine, decode_batches, decode_contexts)
    if {s["kind"] for s in samples} != {"prefill", "decode"}:
        from pdserve.errors import PdserveError
        raise PdserveError("no prefill or no decode shape fits the engine's token budget and KV pool: "
                           "choose smaller --prefill-tokens / --decode-batches / --decode-contexts")
    return {"model": config.model or "SmolLM2-135M-Instruct (embedded)", "threads": config.num_threads or os.cpu_count(),
            "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus".strip(),
            "block_size": config.block_size, "weights": engine.executor.info.weights,  # `--weights`, auto resolved
            "units": "seconds; tokens; context tokens; requests",
            **fit(samples), "samples": samples}


def merge_profiles(paths: list[str]) -> dict:
    """One fit over the samples of several profiles of the same model, threads and block size."""
    import json
    from pathlib import Path

    from pdserve.errors import PdserveError
    profiles = []
    for path in paths:
        try:
            profiles.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            raise PdserveError(f"cannot read profile {path}: {getattr(e, 'strerror', None) or e}") from None
    keys = {(p.get("model"), p.get("threads"), p.get("block_size"), p.get("weights", "fp32")) for p in profiles}
    if len(keys) != 1 or any("samples" not in p for p in profiles):
        raise PdserveError("profiles to merge must carry samples of one model, thread count, block size and "
                           "weight format")
    samples = [s for p in profiles for s in p["samples"]]
    try:
        coefficients = fit(samples)
    except (KeyError, TypeError, ValueError) as e:
        raise PdserveError(f"profiles to merge hold malformed samples ({e})") from None
    return {**{k: v for k, v in profiles[0].items() if k not in ("prefill", "decode", "samples")},
            "merged_from": [str(p) for p in paths], **coefficients, "samples": samples}
