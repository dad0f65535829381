"""A worker's time model calibrated at load: a few profile steps, timed once per host, model and engine config.

Why: admission (`pdserve.conductor.admission`) and the step budget (`pdserve.core.sched.step_budget`) predict
step times from steps the worker ran. A fresh worker has run none, so a fresh server admitted every request of
a first burst (no prediction) and capped no step. Here a worker times a few steps before it says it is ready
and hands them to both models through the paths its live steps take: its first `stats` event carries them to
the conductor (`steps`, as every step it runs), and its step budget `learn`s them.

What is timed, through a probe engine around the worker's own executor (same weights, same KV pool, no prefix
cache, no storage tiers, so nothing of it outlives the profile), each step timed around `LLMEngine.step()` as
the worker's loop times its steps:

* prefill (prefill and colocated workers): one prompt of 16 to 2,048 tokens per step, and steps of four
  prompts (the quadratic term is per prompt);
* decode (decode and colocated workers): decode steps of 16, 4, 2 and 1 requests over contexts of mixed length
  (one long, the rest short), so batch size and context vary apart. Their prompts' prefill is set-up, not
  reported: a PD decode worker's live steps are decode steps, and admission reads the share of a worker's
  recent time spent on prefill as colocated interference.

A warm-up step goes first, unreported; shapes beyond the token budget, the batch or the KV pool are left out.
Of each kind, the first `MIN_SAMPLES` steps (what a fit needs: 944 prefill tokens, 9 decode steps after 368
tokens of set-up) always run; the others only while their predicted end is within `BUDGET_S` of the start. The
worker's startup log says how many steps it timed, and how long that took.

Cache: `$PDSERVE_CALIBRATION_CACHE`, else `$XDG_CACHE_HOME/pdserve/calibration`, else
`~/.cache/pdserve/calibration`; one JSON file per key (the key is in it): the CPU (vendor, model, flags; the GPU's
name on CUDA), the model (`model_fingerprint`), dtype, device, KV codec, block size, token budget, torch
threads, role, torch's and pdserve's versions and `VERSION` (of these shapes). `--calibration cached` (default)
reads it, else profiles and writes it; `fresh` profiles and rewrites it; `off` profiles nothing. A cache that
cannot be read or written is a line in the log and a count (`cache_errors`, reported in the worker's stats).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pdserve.core.sampling_params import SamplingParams
from pdserve.core.sched.online_fit import MIN_SAMPLES, StepRow, nonnegative_lstsq

VERSION = 1  # of the shapes and the file: a change re-profiles every host
BUDGET_S = 10.0  # past each kind's first MIN_SAMPLES steps, no step starts that is predicted to end past this
PREFILL_SHARE = 0.6  # of the budget, a colocated worker's prefill steps' (then its decode steps')
# the first MIN_SAMPLES always run (a fit needs as many; 944 tokens), the others while the budget allows
PREFILL_SHAPES = ((16,), (32,), (64,), (128,), (256,), (16,) * 4, (32,) * 4, (64,) * 4,
                  (512,), (128,) * 4, (1024,), (256,) * 4, (2048,), (512,) * 4)
DECODE_CONTEXTS = (128,) + (16,) * 15  # one long context, 15 short: batch size and context vary apart
DECODE_BATCHES = (16, 4, 2, 1)  # the first N of the contexts decode together
DECODE_STEPS = 3  # timed per batch, after one untimed (the batch changed)
CACHE_ENV = "PDSERVE_CALIBRATION_CACHE"


@dataclass(frozen=True)
class Calibration:
    """A worker's profile steps and where they came from: `profiled` (timed now), `cached` (read from `path`)
    or `off`. `seconds`: the time spent on them at this start."""
    steps: tuple[StepRow, ...] = ()
    source: str = "off"
    seconds: float = 0.0
    path: Path | None = None
    cache_errors: int = 0  # a cache that could not be read or written (a fallback: counted in the metrics)
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        """The worker's startup log line."""
        if self.source == "off":
            return "time model not calibrated (--calibration off): admission predicts once 8 steps have run"
        how = "read from the cache" if self.source == "cached" else "profiled"
        kinds = f"{sum(1 for s in self.steps if s.prefill_tokens)} prefill, " \
                f"{sum(1 for s in self.steps if not s.prefill_tokens)} decode"
        lines = [f"time model calibrated: {len(self.steps)} profile steps ({kinds}) {how} in {self.seconds:.2f} s"
                 + (f" ({self.path})" if self.path else "")] + list(self.notes)
        return "; ".join(lines)


def calibrate(engine, role: str, mode: str, model_dir: str) -> Calibration:
    """The profile steps of a worker in `role` whose engine is `engine` (before it serves: the probe uses its KV
    pool), per `mode` (`pdserve.core.settings.CalibrationSettings`)."""
    if mode == "off":
        return Calibration()
    start = time.perf_counter()
    key = cache_key(engine, role, model_dir)
    path = cache_path(key)
    errors: list[str] = []
    steps = _read(path, key, errors) if mode == "cached" else None
    if steps is not None:
        return Calibration(steps, "cached", time.perf_counter() - start, path, len(errors), tuple(errors))
    steps = profile(engine, role, start + BUDGET_S)
    _write(path, key, steps, errors)
    short = [f"only {len(steps)} profile steps fitted in {BUDGET_S:g} s (admission needs {MIN_SAMPLES})"
             ] if len(steps) < MIN_SAMPLES else []
    return Calibration(steps, "profiled", time.perf_counter() - start, path, len(errors), tuple(errors + short))


def profile(engine, role: str, deadline: float) -> tuple[StepRow, ...]:
    """Time the role's profile steps on a probe engine around `engine`'s executor, until `deadline`
    (`time.perf_counter()`)."""
    executor = engine.executor
    outputs_of = getattr(executor, "outputs_of", None)
    probe = _probe_engine(engine)  # (it points the executor's `outputs_of` at itself: given back below)
    try:
        start = time.perf_counter()
        _warm_up(probe)
        rows: list[StepRow] = []
        if role in ("prefill", "colocated"):
            share = PREFILL_SHARE if role == "colocated" else 1.0
            rows += _prefill_rows(probe, start + share * (deadline - start))
        if role in ("decode", "colocated"):
            rows += _decode_rows(probe, deadline)
        return tuple(rows)
    finally:
        probe.abort(list(probe.scheduler.requests))
        probe.step()  # the executor releases what it kept for the probe's requests (sampler, residual window)
        if outputs_of is not None:
            executor.outputs_of = outputs_of


def _probe_engine(engine):
    from pdserve.core.sched.schedule import SchedulerConfig
    from pdserve.engine.llm_engine import LLMEngine
    config = engine.scheduler.config
    sched = SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                            max_model_len=config.max_model_len)
    return LLMEngine(engine.executor, sched, engine.block_manager.num_blocks, enable_prefix_caching=False)


def _timed_step(probe) -> StepRow:
    start = time.perf_counter()
    probe.step()
    return StepRow.of(probe.last_scheduled, time.perf_counter() - start)


def _prompt(n: int, salt: int) -> list[int]:
    return [100 + (salt * 7919 + i * 104729) % 20000 for i in range(n)]


def _warm_up(probe) -> None:
    probe.add_request(_prompt(16, 0), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while probe.has_unfinished():
        probe.step()


def _fits(probe, contexts) -> bool:
    """Prompts of these lengths fit one step, the batch, the model's length and the KV pool (with room to decode)."""
    config, blocks = probe.scheduler.config, probe.block_manager
    room = (DECODE_STEPS + 1) * len(DECODE_BATCHES) + 2
    return (sum(contexts) <= config.max_num_batched_tokens and len(contexts) <= config.max_num_seqs
            and max(contexts) + room <= config.max_model_len
            and sum(-(-(n + room) // blocks.block_size) for n in contexts) <= blocks.num_blocks)


def _prefill_rows(probe, deadline: float) -> list[StepRow]:
    """One step per shape: its prompts added, then prefilled together (prefill only, the first token sampled,
    as a PD prefill worker runs them). Past the first MIN_SAMPLES, a shape whose step a line fitted to the
    steps so far (seconds ~ a + b x tokens) ends past `deadline` is not started."""
    rows: list[StepRow] = []
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for salt, shape in enumerate(PREFILL_SHAPES, 1):
        if not _fits(probe, shape):
            continue
        if len(rows) >= MIN_SAMPLES and time.perf_counter() + _line(rows, sum(shape)) > deadline:
            break  # (the shapes after it are no smaller)
        for i, n in enumerate(shape):
            probe.add_request(_prompt(n, salt * 64 + i), params, prefill_only=True)
        rows.append(_timed_step(probe))
        while probe.has_unfinished():  # (nothing should be left: the shape fits one step)
            probe.step()
    return rows


def _line(rows: list[StepRow], tokens: int) -> float:
    """Seconds of a step of `tokens` prefill tokens, by a line fitted to `rows`."""
    x = np.array([[1.0, r.prefill_tokens] for r in rows])
    a, b = nonnegative_lstsq(x, np.array([r.seconds for r in rows]))
    return a + b * tokens


def _decode_rows(probe, deadline: float) -> list[StepRow]:
    """Decode steps of each batch of `DECODE_BATCHES` (the first N requests; the others aborted). Past the
    first MIN_SAMPLES steps, a batch whose steps would end past `deadline` (at the slowest step yet) is not
    started."""
    if not _fits(probe, DECODE_CONTEXTS):
        return []
    params = SamplingParams(temperature=0, max_tokens=(DECODE_STEPS + 1) * len(DECODE_BATCHES) + 2, ignore_eos=True)
    ids = [probe.add_request(_prompt(n, 5000 + i), params) for i, n in enumerate(DECODE_CONTEXTS)]
    requests = probe.scheduler.requests
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in requests.values()):
        probe.step()  # their prompts: set-up, not reported
    rows: list[StepRow] = []
    for batch in DECODE_BATCHES:
        slowest = max((r.seconds for r in rows), default=0.0)
        if len(rows) >= MIN_SAMPLES and time.perf_counter() + (DECODE_STEPS + 1) * slowest > deadline:
            break
        probe.abort(ids[batch:])
        probe.step()  # the batch changed: untimed
        rows += [_timed_step(probe) for _ in range(DECODE_STEPS)]
    return rows


# ---- the cache --------------------------------------------------------------------------------------------
def cache_key(engine, role: str, model_dir: str) -> dict:
    """What the profile's times depend on: the host's processor, the model, the engine's config, the role."""
    import torch

    from pdserve.version import __version__
    from pdserve.cbuild import cpu_signature
    from pdserve.model.config import model_fingerprint
    info = engine.executor.info
    device = info.device
    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else ""
    return {"version": VERSION, "machine": platform.machine(),
            "cpu": hashlib.sha256(cpu_signature().encode()).hexdigest()[:16], "gpu": gpu,
            "model": model_fingerprint(model_dir), "dtype": info.dtype, "device": device,
            "kv_cache_dtype": info.kv_cache_dtype, "block_size": info.block_size,
            "max_num_batched_tokens": engine.scheduler.config.max_num_batched_tokens,
            "threads": torch.get_num_threads(), "role": role, "torch": torch.__version__, "pdserve": __version__}


def cache_path(key: dict) -> Path:
    from pdserve.cbuild import user_cache
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return user_cache("calibration", CACHE_ENV) / f"{key['role']}-{digest}.json"


def _read(path: Path, key: dict, errors: list[str]) -> tuple[StepRow, ...] | None:
    """The cached steps for `key`, or None (none cached; or unreadable: noted in `errors`, profiled again)."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            raise ValueError("its key differs")
        return tuple(StepRow(**row) for row in data["steps"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        errors.append(f"calibration cache {path} unreadable ({e}): profiled again")
        return None


def _write(path: Path, key: dict, steps: tuple[StepRow, ...], errors: list[str]) -> None:
    """Write to a temporary name and rename: a worker starting meanwhile reads the old file or the new one."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "profiled_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "steps": [asdict(s) for s in steps]}, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        errors.append(f"calibration cache {path} not written ({e.strerror or e})")
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
