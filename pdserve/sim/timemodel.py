"""Time models: how long one engine step takes, from the shape of its batch.

Every model implements `TimeModel.step_time(shape) -> seconds`, where `StepShape` summarizes a
`SchedulerOutput` in the few numbers step time depends on. A chunk of one token is decode-like (it attends
over `start_pos + 1` tokens of context); a longer chunk is a prefill chunk.

* `RooflineTimeModel`: per step, max(FLOPs / reachable FLOP/s, bytes / reachable bandwidth) over `tp` GPUs,
  plus the tensor-parallel all-reduces. FLOPs: 2 x weights x tokens (linear layers), 4 x layers x q-width x
  attended token pairs (attention), 2 x vocab x hidden per sampled row (lm head). Bytes: weights once, KV of
  the attended context read, new KV written, all KV at the model's `kv_cache_dtype` size (scales included);
  decoding the codes costs the codec's `dequant_overhead` share of the KV-read term (read bytes x (1 + it)),
  the weights and the KV writes none.
* `FittedTimeModel`: DistServe's form, fitted to measurements of the real engine:
  prefill `a + b * sum(tokens) + c * sum(tokens^2) + d * sum(tokens x prefix)`, decode
  `a + b * sum(context) + c * batch` (the terms: `pdserve.core.sched.online_fit.prefill_terms` / `decode_terms`,
  the form the workers' step budget fits too). `d` is the attention of a chunk over the KV cached before it (a
  reused prefix, earlier chunks of its prompt); a model without it (older JSON) has `d` = 0.
  A mixed batch (colocated chunked prefill) costs the prefill part plus the decode part without its `a`.
  Optionally a wake-up table: the first step after the engine idled g seconds takes `wake_time(g)` longer
  (interpolated between measured gaps; on the shared VM this project is measured on, an engine whose
  weights sat untouched for seconds runs its next step up to several hundred ms slower;
  `benchmarks/bench_fidelity.py` measures the table on the idle real server). JSON: `"wake": [[gap_s, extra_s]]`,
  and optionally `"wake_decode"` for pure decode steps (else they use `wake` too).
  Coefficients live in JSON (see `FittedTimeModel.to_json`); `fit_time_model` fits them with least squares.
  KV codecs (`fitted_for_codec`): the fit was measured with one KV dtype (its JSON's `kv_cache_dtype`, else
  `auto`); simulating another scales the one term that reads cached KV, the decode context term `b`, by the
  ratio of the codecs' bytes per token and of their (1 + dequant_overhead), and so the one prefill term that
  reads it, the prefix term `d`; the other prefill terms stay as measured (the quadratic term is attention
  compute within the chunk).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np

from pdserve.core.sched.online_fit import decode_terms, prefill_terms
from pdserve.core.sched.schedule import SchedulerOutput
from pdserve.core.kvstore import kv_codecs
from pdserve.errors import InvalidRequestError
from pdserve.sim.hardware import GPUSpec, ModelSpec

ALLREDUCE_LATENCY_S = 8e-6  # per all-reduce, on top of the bandwidth term


@dataclass(frozen=True)
class StepShape:
    prefill_tokens: int = 0  # tokens of multi-token chunks
    prefill_sq: int = 0  # sum over prefill chunks of tokens^2 (DistServe's quadratic term)
    prefill_pairs: int = 0  # sum over prefill chunks of attended (query, key) pairs, causal
    prefill_context: int = 0  # sum over prefill chunks of keys attended (prefix + chunk): KV read once
    decode_seqs: int = 0  # one-token chunks
    decode_context: int = 0  # sum of their context lengths (keys attended)
    sampled: int = 0  # rows that go through the lm head
    prefill_prefix: int = 0  # sum over prefill chunks of tokens x prefix (keys cached before the chunk)

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    @staticmethod
    def of(scheduled: SchedulerOutput) -> StepShape:
        pt = sq = pairs = pctx = ds = ctx = sampled = pre = 0
        for c in scheduled.chunks:
            n = c.num_tokens
            sampled += c.sample
            if n == 1:
                ds += 1
                ctx += c.start_pos + 1
            else:
                pt += n
                sq += n * n
                pairs += n * c.start_pos + n * (n + 1) // 2
                pctx += c.start_pos + n
                pre += n * c.start_pos
        return StepShape(pt, sq, pairs, pctx, ds, ctx, sampled, pre)

    @staticmethod
    def decode(num_seqs: int, context: int) -> StepShape:
        """A pure decode batch (what `of` returns for `num_seqs` sampling one-token chunks)."""
        return StepShape(0, 0, 0, 0, num_seqs, context, num_seqs)


class TimeModel(Protocol):
    def step_time(self, shape: StepShape) -> float: ...

    def wake_time(self, idle_s: float, decode: bool = False) -> float:
        """Extra time of the first step (a pure decode step if `decode`) after `idle_s` seconds without one."""
        ...


class RooflineTimeModel:
    def __init__(self, model: ModelSpec, gpu: GPUSpec, tp: int = 1, overhead_s: float = 0.0005) -> None:
        self.model, self.gpu, self.tp, self.overhead_s = model, gpu, tp, overhead_s
        m = model
        self._linear_flops = 2.0 * m.num_layers * m.layer_params  # per token
        self._attn_flops = 4.0 * m.num_layers * m.num_heads * m.hd  # per (query, key) pair
        self._head_flops = 2.0 * m.vocab * m.hidden  # per sampled row
        self._flops_s = tp * gpu.bf16_flops * gpu.mfu
        self._bytes_s = tp * gpu.mem_bw * gpu.mbu
        self._weight_bytes = m.weight_bytes
        self._kv_token_bytes = m.kv_bytes_per_token  # written per new token
        dq = m.kv_dequant_overhead  # read per attended key, decoding the codes included (auto: exact ints)
        self._kv_read_bytes = self._kv_token_bytes * (1.0 + dq) if dq else self._kv_token_bytes
        allreduces = 2 * m.num_layers if tp > 1 else 0  # two per layer (attention out, MLP out)
        self._comm = allreduces * (2 * (tp - 1) / tp) * m.hidden * m.dtype_bytes / gpu.nvlink_bw
        self._fixed_s = overhead_s + allreduces * ALLREDUCE_LATENCY_S

    def step_time(self, shape: StepShape) -> float:
        tokens = shape.num_tokens
        if tokens == 0:
            return 0.0
        flops = (self._linear_flops * tokens + self._attn_flops * (shape.prefill_pairs + shape.decode_context)
                 + self._head_flops * shape.sampled)
        nbytes = (self._weight_bytes + self._kv_read_bytes * (shape.decode_context + shape.prefill_context)
                  + self._kv_token_bytes * tokens)
        return max(flops / self._flops_s, nbytes / self._bytes_s) + self._comm * tokens + self._fixed_s

    def wake_time(self, idle_s: float, decode: bool = False) -> float:
        return 0.0

    def decode_times(self, num_seqs: int, context: int, k: int) -> np.ndarray:
        """`step_time(StepShape.decode(num_seqs, context + num_seqs * i))` for i = 1..k, bit for bit the same
        float operations, vectorized (the fast-forward plans hundreds of steps at once)."""
        n = num_seqs
        ctx = context + n * np.arange(1, k + 1, dtype=np.int64)
        flops = self._linear_flops * n + self._attn_flops * ctx + self._head_flops * n
        nbytes = self._weight_bytes + self._kv_read_bytes * ctx + self._kv_token_bytes * n
        return np.maximum(flops / self._flops_s, nbytes / self._bytes_s) + self._comm * n + self._fixed_s


@dataclass(frozen=True)
class Coefficients:
    a: float
    b: float
    c: float
    d: float = 0.0  # prefill: per token x prefix token (none in a model fitted before it; decode: unused)


def _wake_table(entries) -> list[tuple[float, float]]:
    table = sorted((float(g), float(x)) for g, x in (entries or []))
    if any(g < 0 or x < 0 for g, x in table):
        raise InvalidRequestError("wake-up table entries need gap >= 0 and extra seconds >= 0")
    return table


def _spread(spread) -> dict[str, list[float]] | None:
    if not spread:
        return None
    if not isinstance(spread, dict):
        raise InvalidRequestError("a time model's spread is {prefill: [ratios], decode: [ratios]}")
    out = {k: [float(x) for x in v] for k, v in spread.items() if k in ("prefill", "decode") and v}
    if any(x <= 0 for v in out.values() for x in v):
        raise InvalidRequestError("a time model's spread holds ratios of measured to fitted step time: all > 0")
    return out or None


class FittedTimeModel:
    def __init__(self, prefill: Coefficients, decode: Coefficients, meta: dict | None = None,
                 wake: list[tuple[float, float]] | None = None,
                 wake_decode: list[tuple[float, float]] | None = None,
                 spread: dict[str, list[float]] | None = None) -> None:
        self.prefill, self.decode, self.meta = prefill, decode, meta or {}
        # per step kind, measured / fitted time of served steps at evenly spaced quantiles (`pdserve.sim.jitter`)
        self.spread = _spread(spread)
        self.wake, self.wake_decode = _wake_table(wake), None if wake_decode is None else _wake_table(wake_decode)
        self._wake_points = {decode: ([0.0] + [g for g, _ in table], [0.0] + [x for _, x in table])
                             for decode, table in ((False, self.wake), (True, self.wake_decode or []))}

    def wake_time(self, idle_s: float, decode: bool = False) -> float:
        """Linear between measured gaps (0 at a gap of 0), the last value beyond the longest gap."""
        gaps, extra = self._wake_points[decode and self.wake_decode is not None]
        if len(gaps) == 1 or idle_s <= 0:
            return 0.0
        return float(np.interp(idle_s, gaps, extra))

    def step_time(self, shape: StepShape) -> float:
        t = 0.0
        if shape.prefill_tokens:
            p = self.prefill
            t += p.a + p.b * shape.prefill_tokens + p.c * shape.prefill_sq + p.d * shape.prefill_prefix
        if shape.decode_seqs:
            d = self.decode
            t += (0.0 if shape.prefill_tokens else d.a) + d.b * shape.decode_context + d.c * shape.decode_seqs
        return max(t, 0.0)

    def decode_times(self, num_seqs: int, context: int, k: int) -> np.ndarray:
        """Pure decode steps i = 1..k at context `context + num_seqs * i`, as `step_time` computes them."""
        d = self.decode
        ctx = context + num_seqs * np.arange(1, k + 1, dtype=np.int64)
        return np.maximum(0.0 + (d.a + d.b * ctx + d.c * num_seqs), 0.0)

    def to_json(self) -> str:
        return json.dumps({"kind": "fitted", "form": "distserve", **self.meta, "prefill": asdict(self.prefill),
                           "decode": _abc(self.decode), "wake": [list(w) for w in self.wake],
                           **({} if self.wake_decode is None else
                              {"wake_decode": [list(w) for w in self.wake_decode]}),
                           **({"spread": self.spread} if self.spread else {})}, indent=1)

    @staticmethod
    def from_json(text: str) -> FittedTimeModel:
        d = json.loads(text)
        try:
            meta = {k: v for k, v in d.items()
                    if k not in ("prefill", "decode", "kind", "form", "wake", "wake_decode", "spread", "samples",
                                 "steps")}
            return FittedTimeModel(Coefficients(**d["prefill"]), Coefficients(**_abc(d["decode"])), meta,
                                   [(g, x) for g, x in d.get("wake") or []],
                                   None if d.get("wake_decode") is None else [(g, x) for g, x in d["wake_decode"]],
                                   d.get("spread"))
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidRequestError(f"fitted time model JSON needs prefill {{a, b, c[, d]}}, decode {{a, b, c}} "
                                      f"and an optional wake [[gap_s, extra_s], ...]: {e}") from None


def _abc(decode) -> dict:
    """A decode side's coefficients, a dict or `Coefficients`, without `d` (its form has no fourth term)."""
    d = decode if isinstance(decode, dict) else asdict(decode)
    if d.get("d"):
        raise ValueError("decode has no fourth term d")
    return {k: v for k, v in d.items() if k != "d"}


def fit_time_model(samples: list[tuple[StepShape, float]], meta: dict | None = None,
                   relative: bool = False) -> FittedTimeModel:
    """Fit of the DistServe form to (shape, measured seconds) pairs of pure prefill and pure decode steps (mixed
    steps are ignored); each side needs at least three samples. Least squares on seconds, or with `relative` on
    errors relative to the predicted time (`_relative_fit`): short steps count as much as long ones. The
    prefix term is fitted from the steps' `prefill_prefix`; with none among them it is 0 (minimum-norm
    least squares of an all-zero column), the other terms as a fit without it; fitted below 0 (a few noisy
    steps) it is refitted as 0."""
    pre = [(s, t) for s, t in samples if s.prefill_tokens and not s.decode_seqs]
    dec = [(s, t) for s, t in samples if s.decode_seqs and not s.prefill_tokens]
    if len(pre) < 3 or len(dec) < 3:
        raise InvalidRequestError("need at least 3 pure prefill and 3 pure decode steps to fit")
    solve = _relative_fit if relative else (lambda x, t: np.linalg.lstsq(x, t, rcond=None)[0])
    x, t = np.array([prefill_terms(s.prefill_tokens, s.prefill_sq, s.prefill_prefix) for s, _ in pre]), \
        np.array([t for _, t in pre])
    cp = solve(x, t)
    if cp[3] < 0:  # attention over cached KV takes time: a negative share (a few noisy steps) is refitted as none
        cp = np.append(solve(x[:, :3], t), 0.0)
    cd = solve(np.array([decode_terms(s.decode_context, s.decode_seqs) for s, _ in dec]), np.array([t for _, t in dec]))
    return FittedTimeModel(Coefficients(*map(float, cp)), Coefficients(*map(float, cd)), meta)


RELATIVE_ROUNDS = 10  # reweighting rounds of `_relative_fit`


def _relative_fit(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Least squares of (t - x @ coef) / (x @ coef), by reweighting (each row divided by its last prediction,
    the first round by its measured time): the mean time of each shape when a step's scatter grows with its
    length (a gamma model). Dividing by the measured time alone would fit below the mean, a slow step's
    residual shrunk by its own length -- and a request's TPOT is the mean of its steps."""
    scale = t
    for _ in range(RELATIVE_ROUNDS):
        coef = np.linalg.lstsq(x / scale[:, None], t / scale, rcond=None)[0]
        scale = np.maximum(x @ coef, 0.05 * t.min())  # (a prediction near or below 0: floored)
    return coef


def codec_decode_scale(model: ModelSpec, measured: str) -> float:
    """How much longer (or shorter) `model`'s cached-KV reads take in its `kv_cache_dtype` than in the
    `measured` codec: the bytes-per-token ratio times the ratio of (1 + dequant_overhead)."""
    def cost(name: str) -> float:
        return (kv_codecs.token_bytes(name, model.hd, model.dtype_bytes)
                * (1.0 + kv_codecs.CODECS[name].dequant_overhead))
    return cost(model.kv_cache_dtype) / cost(measured)


def fitted_for_codec(fitted: FittedTimeModel, model: ModelSpec) -> FittedTimeModel:
    """`fitted` (measured with its meta's `kv_cache_dtype`, else auto) for `model`'s KV codec: the decode
    context term scaled by `codec_decode_scale`; the same model when the codecs cost the same. The scale and
    what it touched are recorded in the meta (`kv_codec_scaling`)."""
    measured = kv_codecs.check(str(fitted.meta.get("kv_cache_dtype", "auto")), "fitted time model kv_cache_dtype")
    scale = codec_decode_scale(model, measured)
    if scale == 1.0:
        return fitted
    meta = {**fitted.meta, "kv_codec_scaling": {"measured": measured, "simulated": model.kv_cache_dtype,
                                                "decode_context_scale": scale, "prefill_prefix_scale": scale}}
    return FittedTimeModel(replace(fitted.prefill, d=fitted.prefill.d * scale),
                           replace(fitted.decode, b=fitted.decode.b * scale), meta,
                           fitted.wake, fitted.wake_decode, fitted.spread)


def make_time_model(spec: str, model: ModelSpec, gpu: GPUSpec, tp: int) -> TimeModel:
    """`roofline` or `fitted:PATH.json` (for `model`'s KV codec, `fitted_for_codec`)."""
    if spec == "roofline":
        return RooflineTimeModel(model, gpu, tp)
    if spec.startswith("fitted:"):
        path = Path(spec.split(":", 1)[1])
        try:
            return fitted_for_codec(FittedTimeModel.from_json(path.read_text()), model)
        except OSError as e:
            raise InvalidRequestError(f"cannot read {path}: {e.strerror or e}", param="time_model") from None
    raise InvalidRequestError(f"unknown time model {spec!r}: roofline | fitted:PATH.json", param="time_model")
