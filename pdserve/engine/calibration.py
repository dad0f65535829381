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

Workers that start together on one host profile one at a time (the cache folder's lock: side by side, each
would time the other's steps too), and a worker that waited reads what one of its kind just wrote. A prefill
worker's shared KV pool is populated first (`pdserve.kv.device_pool` does it in the background; it would take
the cores the profile is timed on). A warm-up step goes first, unreported. Shapes beyond the token budget, the
batch or the KV pool are left out (the batches are cut to the engine's; with few shapes left, they are timed
again). Each row is the fastest of `REPEATS` timings of its shape (a moment another process held the cores is
not the host's speed; a host that stays that busy shows in the live steps, which replace the profile's in the
fits' windows). Of each kind, the first `MIN_SAMPLES` rows (what a fit needs: 2 x 944 prefill tokens; 16
decode steps after 368 tokens of set-up) are timed unless `LIMIT_S` has passed, the others only while their
predicted end is within `BUDGET_S` of the start. A profile without a fit's worth of each kind is used but not
cached. The worker's startup log says how many rows it has, and how long they took.

Cache: `$PDSERVE_CALIBRATION_CACHE`, else `$XDG_CACHE_HOME/pdserve/calibration`, else
`~/.cache/pdserve/calibration`; one JSON file per key (the key is in it): the CPU (vendor, model, flags; the GPU's
name on CUDA), the model (`model_fingerprint`), dtype, device, KV codec, block size, token budget, torch
threads, role, torch's and pdserve's versions and `VERSION` (of these shapes). `--calibration cached` (default)
reads it, else profiles and writes it; `fresh` profiles and rewrites it; `off` profiles nothing. A cache that
cannot be read or written is a line in the log and a count (`fallbacks`, reported in the worker's stats).
"""

from __future__ import annotations

import contextlib
import fcntl
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

VERSION = 3  # of the shapes and the file: a change re-profiles every host
BUDGET_S = 10.0  # past each kind's first MIN_SAMPLES rows, no step starts that is predicted to end past this
LIMIT_S = 30.0  # nor any step at all past this (a host too slow for even a fit's worth: noted, fewer rows)
PREFILL_SHARE = 0.6  # of the budget, a colocated worker's prefill steps' (then its decode steps')
# the first MIN_SAMPLES always run (a fit needs as many; 944 tokens), the others while the budget allows
PREFILL_SHAPES = ((16,), (32,), (64,), (128,), (256,), (16,) * 4, (32,) * 4, (64,) * 4,
                  (512,), (128,) * 4, (1024,), (256,) * 4, (2048,), (512,) * 4)
DECODE_CONTEXTS = (128,) + (16,) * 15  # one long context, 15 short: batch size and context vary apart
DECODE_BATCHES = (16, 4, 2, 1)  # the first N of the contexts decode together (at most the engine's batch)
# each row is the fastest of this many timings of its shape: what the host does when no other process holds its
# cores (a moment when one did is not its speed; the live steps show a host that stays that busy)
REPEATS = 2
CACHE_ENV = "PDSERVE_CALIBRATION_CACHE"
LOCK_WAIT_S = 60.0  # the longest a worker waits for another's profile on its host


@dataclass(frozen=True)
class Calibration:
    """A worker's profile steps and where they came from: `profiled` (timed now), `cached` (read from `path`)
    or `off`. `seconds`: the time spent on them at this start (a wait for the KV pool's population included)."""
    steps: tuple[StepRow, ...] = ()
    source: str = "off"
    seconds: float = 0.0
    path: Path | None = None
    fallbacks: int = 0  # a cache not read or not written, a lock not had (counted in the metrics; said in `notes`)
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        """The worker's startup log line."""
        if self.source == "off":
            return f"time model not calibrated (--calibration off): admission predicts once {MIN_SAMPLES} steps ran"
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
    errors: list[str] = []  # fallbacks: a cache not read or not written, a lock not had
    source = "cached"
    steps = _read(path, key, errors) if mode == "cached" else None
    if steps is None:
        with _alone(path.parent, errors):
            # (a worker of the same kind that held the lock may have just written it: then it is read)
            steps = _read(path, key, []) if mode == "cached" else None
            if steps is None:
                _populated(engine.executor)
                steps = profile(engine, role)
                if _complete(steps, role):
                    _write(path, key, steps, errors)
                source = "profiled"
    short = [] if _complete(steps, role) else [
        f"only {len(steps)} profile steps in {LIMIT_S:g} s (a fit needs {MIN_SAMPLES} of each kind): not cached"]
    return Calibration(steps, source, time.perf_counter() - start, path, len(errors), tuple(errors + short))


def _complete(steps: tuple[StepRow, ...], role: str) -> bool:
    """A fit's worth of rows of each kind the role profiles (else it is not cached: the next start tries again)."""
    prefill = sum(1 for s in steps if s.prefill_tokens)
    return (role == "decode" or prefill >= MIN_SAMPLES) and (role == "prefill" or len(steps) - prefill >= MIN_SAMPLES)


@contextlib.contextmanager
def _alone(folder: Path, errors: list[str]):
    """Hold the cache folder's lock: workers starting together on one host profile one after the other (timed
    side by side, each would time the other's steps too: 2x slower on a 2-core host than either alone). After
    `LOCK_WAIT_S` it profiles anyway (noted in `errors`)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / ".profile.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        errors.append(f"calibration cache {folder} has no lock ({e.strerror or e}): profiled beside others")
        yield
        return
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while not _locked(fd):
            if time.monotonic() > deadline:
                errors.append(f"calibration cache {folder}: another profile held its lock {LOCK_WAIT_S:g} s: "
                              "profiled beside it")
                break
            time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _locked(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _populated(executor) -> None:
    """A shared KV pool is populated in the background at start (`pdserve.kv.device_pool`): that takes seconds
    of the cores the profile would be timed on, so the profile waits for it (at most `BUDGET_S`)."""
    prefault = getattr(getattr(executor, "kv_pool", None), "prefault", None)
    if prefault is not None:
        prefault.thread.join(BUDGET_S)


def profile(engine, role: str) -> tuple[StepRow, ...]:
    """Time the role's profile steps on a probe engine around `engine`'s executor (`BUDGET_S`, `LIMIT_S`)."""
    executor = engine.executor
    outputs_of = getattr(executor, "outputs_of", None)
    probe = _probe_engine(engine)  # (it points the executor's `outputs_of` at itself: given back below)
    try:
        start = time.perf_counter()
        _warm_up(probe)
        rows: list[StepRow] = []
        if role in ("prefill", "colocated"):
            share = PREFILL_SHARE if role == "colocated" else 1.0
            rows += _prefill_rows(probe, start + share * BUDGET_S, start + share * LIMIT_S)
        if role in ("decode", "colocated"):
            rows += _decode_rows(probe, start + BUDGET_S, start + LIMIT_S)
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


def _fits(probe, contexts, decode_steps: int = 0) -> bool:
    """Prompts of these lengths fit one step, the batch, the model's length and the KV pool (each with
    `decode_steps` tokens more to decode)."""
    config, blocks = probe.scheduler.config, probe.block_manager
    room = decode_steps + 2
    return (sum(contexts) <= config.max_num_batched_tokens and len(contexts) <= config.max_num_seqs
            and max(contexts) + room <= config.max_model_len
            and sum(-(-(n + room) // blocks.block_size) for n in contexts) <= blocks.num_blocks)


def _prefill_shapes(probe) -> list[tuple[int, ...]]:
    """The shapes that fit this engine, the first ones again until there are MIN_SAMPLES (a small token budget
    or batch leaves few)."""
    budget = probe.scheduler.config.max_num_batched_tokens
    fitting = [shape for shape in PREFILL_SHAPES if _fits(probe, shape)] or [(min(budget, 16),)]
    return fitting + [fitting[i % len(fitting)] for i in range(MIN_SAMPLES - len(fitting))]


def _prefill_rows(probe, deadline: float, limit: float) -> list[StepRow]:
    """One step per shape: its prompts added, then prefilled together (prefill only, the first token sampled,
    as a PD prefill worker runs them), `REPEATS` times. Past the first MIN_SAMPLES, a shape whose steps a line
    fitted to the rows so far (seconds ~ a + b x tokens) ends past `deadline` is not started."""
    rows: list[StepRow] = []
    for salt, shape in enumerate(_prefill_shapes(probe), 1):
        now = time.perf_counter()
        if now > limit or (len(rows) >= MIN_SAMPLES and now + REPEATS * _line(rows, sum(shape)) > deadline):
            break  # (the shapes after it are no smaller)
        rows.append(min((_prefill_step(probe, shape, salt * 64 + r * 8) for r in range(REPEATS)),
                        key=lambda row: row.seconds))
    return rows


def _prefill_step(probe, shape: tuple[int, ...], salt: int) -> StepRow:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i, n in enumerate(shape):
        probe.add_request(_prompt(n, salt + i), params, prefill_only=True)
    row = _timed_step(probe)
    while probe.has_unfinished():  # (nothing should be left: the shape fits one step)
        probe.step()
    return row


def _line(rows: list[StepRow], tokens: int) -> float:
    """Seconds of a step of `tokens` prefill tokens, by a line fitted to `rows`."""
    x = np.array([[1.0, r.prefill_tokens] for r in rows])
    a, b = nonnegative_lstsq(x, np.array([r.seconds for r in rows]))
    return a + b * tokens


def _decode_plan(probe) -> tuple[list[int], int, tuple[int, ...]] | None:
    """The batches (`DECODE_BATCHES` within the engine's batch), the steps timed per batch (a fit's worth of rows
    in all) and the contexts that fit (the long one shortened if need be); None: none fit."""
    batches = sorted({min(b, probe.scheduler.config.max_num_seqs) for b in DECODE_BATCHES}, reverse=True)
    per_batch = REPEATS * -(-MIN_SAMPLES // len(batches))
    steps = (per_batch + 1) * len(batches)
    for contexts in (DECODE_CONTEXTS[:batches[0]], (16,) * batches[0]):
        if _fits(probe, contexts, steps):
            return batches, per_batch, contexts
    return None


def _decode_rows(probe, deadline: float, limit: float) -> list[StepRow]:
    """Decode steps of each batch (the first N requests; the others aborted), a row per `REPEATS` steps (the
    fastest). Past the first MIN_SAMPLES rows, a batch whose steps would end past `deadline` (at the slowest
    row yet) is not started."""
    plan = _decode_plan(probe)
    if plan is None:
        return []
    batches, per_batch, contexts = plan
    params = SamplingParams(temperature=0, max_tokens=(per_batch + 1) * len(batches) + 2, ignore_eos=True)
    ids = [probe.add_request(_prompt(n, 5000 + i), params) for i, n in enumerate(contexts)]
    requests = probe.scheduler.requests
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in requests.values()):
        probe.step()  # their prompts: set-up, not reported
    rows: list[StepRow] = []
    for batch in batches:
        slowest, now = max((r.seconds for r in rows), default=0.0), time.perf_counter()
        if now > limit or (len(rows) >= MIN_SAMPLES and now + (per_batch + 1) * slowest > deadline):
            break
        probe.abort(ids[batch:])
        probe.step()  # the batch changed: untimed
        steps = [_timed_step(probe) for _ in range(per_batch)]
        rows += [min(steps[i:i + REPEATS], key=lambda row: row.seconds) for i in range(0, per_batch, REPEATS)]
    return rows


# ---- the cache --------------------------------------------------------------------------------------------
def cache_key(engine, role: str, model_dir: str) -> dict:
    """What the profile's times depend on: the host's processor, the model, the engine's config, the role, and the
    code that runs the forward (the compiled kernels' build and `pdserve/model`'s sources: a change to a kernel or
    a kernel rule re-profiles, else a profile timed before it would be read as this code's times)."""
    import torch

    from pdserve.version import __version__
    from pdserve.cbuild import cpu_signature
    from pdserve.model.config import model_fingerprint
    info = engine.executor.info
    device = info.device
    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else ""
    return {"version": VERSION, "machine": platform.machine(),
            "cpu": hashlib.sha256(cpu_signature().encode()).hexdigest()[:16], "gpu": gpu,
            "model": model_fingerprint(model_dir), "dtype": info.dtype, "weights": info.weights, "device": device,
            "kv_cache_dtype": info.kv_cache_dtype, "block_size": info.block_size,
            "max_num_batched_tokens": engine.scheduler.config.max_num_batched_tokens,
            "threads": torch.get_num_threads(), "role": role, "torch": torch.__version__, "pdserve": __version__,
            "code": _forward_code()}


def _forward_code() -> str:
    """A digest of what the step times come from besides the config: the kernels library's build (its path names
    its sources, flags, compiler and CPU) and the model package's Python sources."""
    import xxhash

    from pdserve.model import kernels
    from pdserve.model.kernels import build
    h = xxhash.xxh3_64(str(build.build()).encode() if kernels.available() else b"no kernels")
    for source in sorted((Path(__file__).parents[1] / "model").glob("*.py")):
        h.update(source.read_bytes())
    return h.hexdigest()


def cache_path(key: dict) -> Path:
    from pdserve.cbuild import user_cache
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return user_cache("calibration", CACHE_ENV) / f"{key['role']}-{digest}.json"


def _read(path: Path, key: dict, errors: list[str]) -> tuple[StepRow, ...] | None:
    """The cached steps for `key`, or None (none cached; or unreadable: noted in `errors`, profiled again)."""
    data = read_keyed(path, key, errors, "calibration cache")
    try:
        return None if data is None else tuple(StepRow(**row) for row in data["steps"])
    except (KeyError, TypeError) as e:
        errors.append(f"calibration cache {path} unreadable ({e}): profiled again")
        return None


def _write(path: Path, key: dict, steps: tuple[StepRow, ...], errors: list[str]) -> None:
    write_keyed(path, key, {"steps": [asdict(s) for s in steps]}, errors, "calibration cache")


def read_keyed(path: Path, key: dict, errors: list[str], what: str) -> dict | None:
    """A cache file's data if it was written for `key` (the calibration's and the KV codec gate's,
    `pdserve.engine.codec_gate`), else None (none cached; or unreadable: noted in `errors`, measured again)."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data["key"] != key:
            raise ValueError("its key differs")
        return data
    except (OSError, ValueError, KeyError, TypeError) as e:
        errors.append(f"{what} {path} unreadable ({e}): measured again")
        return None


def write_keyed(path: Path, key: dict, data: dict, errors: list[str], what: str) -> None:
    """Write `data` under `key` to a temporary name and rename: a worker starting meanwhile reads the old file
    or the new one."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "profiled_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **data}, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        errors.append(f"{what} {path} not written ({e.strerror or e})")
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
