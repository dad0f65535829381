"""What share of a workload no deployment can serve, and why: the bound on SLO attainment, known before any
candidate is simulated (`pdserve plan` and `pdserve simulate` print it first and keep it in their JSON).

A request is out of reach of every deployment when (each request counted under the first reason that holds):
* `context`: its prompt leaves no room for output in the model's context (`leaves_no_room`, the rule
  `Scheduler.check_new` refuses it by): every engine refuses it;
* `ttft_floor`: the TTFT SLO is below the time its prompt alone takes to prefill on the fastest TP tried: the
  simulator's time model over the steps the scheduler gives a lone prompt (chunks of the prefill budget,
  shaped by `StepShape.of`), from the longest prefix the trace's earlier requests could have left cached;
* `tpot_floor`: the TPOT SLO is below the mean of its own decode steps alone (batch 1) on the fastest TP
  tried (`decode_times`, the steps the simulator's fast-forward plans); only for requests that decode two
  tokens or more (a TPOT needs two).
Each floor leaves out everything else a request waits for (queueing, KV transfer, control messages), so it
is a floor: the best attainment possible is 1 - (their share). Also counted, as they change what is served
but not whether: prompts clipped by `--max-input-len`, and requests whose prompt fits but prompt + output
does not (their output stops at the context).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from pdserve.core.sampling_params import SamplingParams
from pdserve.core.sched.schedule import ScheduledChunk, SchedulerOutput
from pdserve.core.sched.scheduler import leaves_no_room
from pdserve.sim.hardware import MODELS, ModelSpec, get_gpu, get_model
from pdserve.sim.timemodel import StepShape, make_time_model
from pdserve.workloads.prompts import block_size
from pdserve.workloads.spec import RequestSpec, Workload

_PARAMS = SamplingParams()


@dataclass(frozen=True)
class Feasibility:
    """The counts and floors of one workload on one model (all requests, whatever the rate)."""

    model: str
    context_len: int
    tps: tuple[int, ...]  # the TP degrees the floors were taken over (the fastest per request)
    num_requests: int
    over_context: int  # prompts at or over the context: refused by every engine
    ttft_floor: int  # TTFT SLO below the prompt's own prefill (of those within the context)
    tpot_floor: int  # TPOT SLO below its own decode steps at batch 1 (of the rest)
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    ttft_floor_ms: float | None  # the highest prefill floor among `ttft_floor`'s: a TTFT SLO of it serves them
    tpot_floor_ms: float | None  # likewise for `tpot_floor`
    longest_prompt: int
    median_output: int
    cut_short: int  # prompt fits, prompt + output does not: served, the output stops at the context
    max_input_len: int | None
    clipped_input: int  # prompts `--max-input-len` clipped

    @property
    def unservable(self) -> int:
        return self.over_context + self.ttft_floor + self.tpot_floor

    @property
    def best_attainment(self) -> float:
        return 1.0 - self.unservable / self.num_requests if self.num_requests else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "unservable": self.unservable, "best_attainment": self.best_attainment}


def prefill_floor_s(tm, prompt: int, cached: int, budget: int) -> float:
    """Seconds to prefill a lone prompt of `prompt` tokens whose first `cached` are cached: the scheduler's
    chunks of at most `budget` tokens, each a step of its own, timed by `tm`."""
    total, pos = 0.0, cached
    while pos < prompt:
        n = min(budget, prompt - pos)
        chunk = ScheduledChunk("floor", range(n), pos, (), pos + n == prompt, _PARAMS)
        total += tm.step_time(StepShape.of(SchedulerOutput((chunk,))))
        pos += n
    return total


def decode_floor_s(tm, prompt: int, output: int, context_len: int) -> float | None:
    """A lone request's TPOT floor: the mean of its decode steps at batch 1 (contexts prompt + 1 on), the
    output stopped at the context; None when it decodes fewer than two tokens (no TPOT)."""
    gaps = min(output, context_len - prompt) - 1
    return float(np.mean(tm.decode_times(1, prompt, gaps))) if gaps >= 1 else None


def cached_bounds(workload: Workload, block_tokens: int) -> list[int]:
    """Per request, the most prompt tokens a prefix cache could hold when it arrives: the leading hash blocks
    (Mooncake `hash_ids`, `block_size` tokens each) an earlier request's prompt began with, at most all but
    the last prompt token (which is always computed). 0 without hash ids."""
    block = block_size(workload, block_tokens)
    seen: set[int] = set()
    out = []
    for r in workload.requests:
        chain, hit, chains = 0, 0, []
        for j, h in enumerate((r.hash_ids or ())[:-(-r.input_len // block)]):
            chain = hash((chain, h))
            hit = j + 1 if hit == j and chain in seen else hit
            chains.append(chain)
        seen.update(chains)
        out.append(min(hit * block, r.input_len - 1))
    return out


def feasibility(workload: Workload, model: ModelSpec, time_models: dict[int, object], budget: int,
                slo_ttft_ms: float | None, slo_tpot_ms: float | None, block_tokens: int = 512) -> Feasibility:
    """The bound for `workload` on `model`, the floors taken at each TP of `time_models` ({tp: time model})
    with prefill chunks of `budget` tokens (see the module docstring)."""
    reqs, ctx = workload.requests, model.max_model_len
    within = [i for i, r in enumerate(reqs) if not leaves_no_room(r.input_len, ctx)]
    ttft_over, ttft_top = _ttft_below(reqs, within, workload, time_models, budget, slo_ttft_ms, block_tokens)
    rest = [i for i in within if i not in ttft_over]
    tpot_over, tpot_top = _tpot_below(reqs, rest, time_models, ctx, slo_tpot_ms)
    desc = workload.description
    return Feasibility(
        model=model.name, context_len=ctx, tps=tuple(sorted(time_models)), num_requests=len(reqs),
        over_context=len(reqs) - len(within), ttft_floor=len(ttft_over), tpot_floor=len(tpot_over),
        slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, ttft_floor_ms=ttft_top, tpot_floor_ms=tpot_top,
        longest_prompt=max((r.input_len for r in reqs), default=0),
        median_output=int(np.median([r.output_len for r in reqs])) if reqs else 0,
        cut_short=sum(reqs[i].input_len + reqs[i].output_len > ctx for i in within),
        max_input_len=desc.get("max_input_len"), clipped_input=int(desc.get("clipped_input") or 0))


def from_args(args, workload: Workload, tps, budget: int) -> Feasibility:
    """`feasibility` for the flags of `pdserve plan` / `simulate`: their model, GPU and time model at each TP."""
    model, gpu = get_model(args.model, args.kv_cache_dtype), get_gpu(args.gpu)
    time_models = {tp: make_time_model(args.time_model, model, gpu, tp) for tp in sorted(set(tps))}
    return feasibility(workload, model, time_models, budget, args.slo_ttft_ms, args.slo_tpot_ms, args.block_tokens)


def _ttft_below(reqs: list[RequestSpec], idx: list[int], workload, time_models, budget, slo_ms, block_tokens
                ) -> tuple[set[int], float | None]:
    """(requests among `idx` whose prefill floor exceeds the TTFT SLO, the highest such floor in ms)."""
    if slo_ms is None or not time_models:
        return set(), None
    cached = cached_bounds(workload, block_tokens)
    floors = {i: min(prefill_floor_s(tm, reqs[i].input_len, cached[i], budget) for tm in time_models.values())
              for i in idx}
    return _over(floors, slo_ms)


def _tpot_below(reqs: list[RequestSpec], idx: list[int], time_models, ctx: int, slo_ms
                ) -> tuple[set[int], float | None]:
    if slo_ms is None or not time_models:
        return set(), None
    floors = {}
    for i in idx:
        each = [decode_floor_s(tm, reqs[i].input_len, reqs[i].output_len, ctx) for tm in time_models.values()]
        if each[0] is not None:
            floors[i] = min(each)
    return _over(floors, slo_ms)


def _over(floors_s: dict[int, float], slo_ms: float) -> tuple[set[int], float | None]:
    over = {i for i, f in floors_s.items() if f * 1000 > slo_ms}
    return over, max((floors_s[i] * 1000 for i in over), default=None)


def _share(n: int, total: int) -> str:
    return f"{n:,} of {total:,} ({n / total:.1%})" if total else "0"


def summary_lines(f: Feasibility) -> list[str]:
    """What no deployment can serve and why, and the best attainment possible: printed before any search."""
    n, tps = f.num_requests, ",".join(map(str, f.tps))
    lines = []
    if f.clipped_input:
        lines.append(f"--max-input-len {f.max_input_len}: {f.clipped_input:,} prompts clipped to it")
    if f.over_context:
        lines.append(f"{_share(f.over_context, n)} requests have prompts at or over {f.model}'s {f.context_len:,}-"
                     f"token context (the longest: {f.longest_prompt:,}): every engine refuses them")
    if f.ttft_floor:
        lines.append(f"{_share(f.ttft_floor, n)} need a TTFT under {f.slo_ttft_ms:g} ms, below their prompt's own "
                     f"prefill on the fastest TP tried ({tps}): floors up to {f.ttft_floor_ms:,.0f} ms")
    if f.tpot_floor:
        lines.append(f"{_share(f.tpot_floor, n)} need a TPOT under {f.slo_tpot_ms:g} ms, below their own decode "
                     f"steps at batch 1 on the fastest TP tried ({tps}): floors up to {f.tpot_floor_ms:.1f} ms")
    if f.cut_short:
        lines.append(f"{f.cut_short:,} fit their prompt but not prompt + output: served, their output stops at the "
                     "context")
    what = "best SLO attainment possible" if f.slo_ttft_ms or f.slo_tpot_ms else "share any deployment can serve"
    head = (f"{what}: {f.best_attainment:.1%}" + (
        f" ({f.unservable:,} requests no deployment can serve)" if f.unservable else
        " (every request is within reach of some deployment)"))
    return [head, *(f"  {line}" for line in lines)]


def advice_lines(f: Feasibility, best_reached: float, required: float, gpus: int) -> list[str]:
    """What would change a 'no deployment meets the SLOs' verdict, given the best attainment reached."""
    out = []
    if f.best_attainment < required:
        out.append(f"  even a perfect deployment serves at most {f.best_attainment:.1%} < {required:.0%}; to serve "
                   "the rest:")
        out.extend(_fixes(f))
    if best_reached < min(f.best_attainment, required) - 0.005:
        out.append(f"  {f.best_attainment - best_reached:.1%} of the workload is within reach but was missed: "
                   f"limited by load (more GPUs than --gpus {gpus}, or a lower rate)")
    return out


def _fixes(f: Feasibility) -> list[str]:
    out = []
    if f.over_context:
        longer = sorted(m.name for m in MODELS.values() if m.max_model_len > f.longest_prompt)
        models = f"presets holding {f.longest_prompt:,} tokens: {', '.join(longer)}" if longer else (
            f"no preset holds {f.longest_prompt:,} tokens")
        cap = max(1, f.context_len - f.median_output)
        out.append(f"    the {f.over_context:,} prompts at or over the {f.context_len:,}-token context: a model with a "
                   f"longer context ({models}), or --max-input-len {cap} to clip them (the context less the median "
                   "output)")
    if f.ttft_floor:  # (flags rounded up: the floor itself must pass)
        out.append(f"    the {f.ttft_floor:,} below the prefill floor: --slo-ttft-ms {math.ceil(f.ttft_floor_ms)} or "
                   "more (the highest floor), or a faster GPU")
    if f.tpot_floor:
        tpot = math.ceil(f.tpot_floor_ms * 10) / 10
        out.append(f"    the {f.tpot_floor:,} below the decode floor: --slo-tpot-ms {tpot:g} or more (the highest "
                   "floor), or a faster GPU")
    return out
