"""The KV codec correctness gate: a fixed text run through exact KV (`auto`) and through a codec's KV, in this
process (`pdserve.LLM`, the real engine: prefill writes the coded pool and attention reads it back), and the
codec refused when this model loses too much under it (`pdserve check-kv`; `pdserve serve` at start for every
codec it would use, `--kv-codec-gate on|off`).

Measured on the first `TOKENS` tokens of the text, in one prefill (prompt logprobs, top 1):

- perplexity change: exp(mean NLL) of the text under the codec / under exact KV - 1;
- top-1 agreement (teacher-forced greedy agreement): the share of the text's positions where the codec's most
  likely next token is exact KV's;
- free-running greedy agreement (reported, not gated): `GREEDY_TOKENS` greedy tokens after the text's first
  `GREEDY_PROMPT` tokens, the share of positions equal to exact KV's. One near-tie early makes the rest of an
  answer differ (docs/benchmarks.md "KV codecs": fp8 keeps 96.8% teacher-forced but 20.9% free-running), so it says
  little about a codec on its own and is not a threshold.

Thresholds (`Thresholds`, documented in docs/guides/kv-codecs.md): from the shipped codecs' numbers on the default
model (docs/benchmarks.md "KV codecs", the gate columns: 512 tokens of gpl-3.0.txt) with margin. The worst shipped
codec, int4, costs +2.1% perplexity and keeps 92.6% top-1 agreement; fp8_e4m3 +1.0% and 92.4%; int8 +0.1% and 98.2%.
So a codec passes within +4% perplexity (about twice int4's loss) and at >= 85% top-1 agreement (7 points under the
worst shipped codec: what one model's near-ties move between hosts and kernels stays inside it). The test-only
broken codec (`kv_codecs.TEST_CODEC_ENV`) lands at +124,000% and 0.8%.

The text: `../shared/texts/gpl-3.0.txt` beside the repository when it is there (a fixed public text), else a short
text shipped here (`pdserve.engine.gate_text`); the result names the one used. Results are cached per host,
model, codec and text in the calibration cache's folder (`pdserve.engine.calibration`'s `read_keyed` /
`write_keyed`), so a second `pdserve serve` with the same codec does not measure again.
"""

from __future__ import annotations

import hashlib
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.errors import PdserveError

VERSION = 1  # of the measurement: a change measures every host again
TOKENS = 512  # of the text, scored in one prefill
GREEDY_PROMPT = 64  # free-running: the text's first tokens as the prompt,
GREEDY_TOKENS = 32  # then this many greedy tokens
SHARED_TEXT = Path(__file__).resolve().parents[3] / "shared" / "texts" / "gpl-3.0.txt"
GATE_MODES = ("on", "off")
EXACT = "auto"
# torch threads of the gate's runs: one, so its numbers do not depend on the host's core count (reduction order)
# and other processes on the cores do not stall it (2 threads beside busy workers on this 2-core host: 32 decode
# steps in 30-38 s; 1 thread: 3.5-4 s)
THREADS = 1


@dataclass(frozen=True)
class Thresholds:
    """What a codec must keep of exact KV on the gate's text (see the module's doc for why these)."""
    max_perplexity_change: float = 0.04  # +4%
    min_top1_agreement: float = 0.85

    def failures(self, r: "GateResult") -> list[str]:
        out = []
        if r.perplexity_change > self.max_perplexity_change:
            out.append(f"perplexity {r.perplexity_change:+.1%} > +{self.max_perplexity_change:.0%}")
        if r.top1_agreement < self.min_top1_agreement:
            out.append(f"top-1 agreement {r.top1_agreement:.1%} < {self.min_top1_agreement:.0%}")
        return out


@dataclass(frozen=True)
class GateResult:
    codec: str
    model: str
    text: str
    tokens: int
    perplexity_exact: float
    perplexity_coded: float
    top1_agreement: float
    greedy_agreement: float
    seconds: float
    source: str = "measured"  # or "cached"
    failures: tuple[str, ...] = field(default=(), compare=False)  # what `thresholds` found (`_judged`)
    thresholds: Thresholds = field(default=Thresholds(), compare=False)

    @property
    def perplexity_change(self) -> float:
        return self.perplexity_coded / self.perplexity_exact - 1

    @property
    def passed(self) -> bool:
        return not self.failures

    def line(self) -> str:
        """The one line `pdserve check-kv` prints and `pdserve serve` refuses with."""
        thresholds = self.thresholds
        verdict = "pass" if self.passed else "FAIL (" + "; ".join(self.failures) + ")"
        return (f"kv codec {self.codec} on {self.model}: {verdict}: perplexity {self.perplexity_exact:.3f} -> "
                f"{self.perplexity_coded:.3f} ({self.perplexity_change:+.2%}), top-1 agreement "
                f"{self.top1_agreement:.1%}, free-running greedy agreement {self.greedy_agreement:.1%} "
                f"[thresholds: perplexity <= +{thresholds.max_perplexity_change:.0%}, top-1 agreement >= "
                f"{thresholds.min_top1_agreement:.0%}; {self.tokens} tokens of {self.text}, {self.source}]")

    def as_json(self) -> dict:
        return {**asdict(self), "failures": list(self.failures), "passed": self.passed,
                "perplexity_change": self.perplexity_change}


def gate_text() -> tuple[str, str]:
    """(its name, the text): the shared public text when it is there, else the one shipped in the package."""
    if SHARED_TEXT.is_file():
        return SHARED_TEXT.name, SHARED_TEXT.read_text()
    from pdserve.engine.gate_text import NAME, TEXT
    return NAME, TEXT


def check_codecs(engine_config, codecs: list[str], thresholds: Thresholds = Thresholds(),
                 use_cache: bool = True) -> list[GateResult]:
    """The gate's result for each of `codecs` (not `auto`) on `engine_config`'s model: cached ones read, the
    others measured (exact KV run once for them all) and cached."""
    from pdserve.engine.calibration import read_keyed, write_keyed
    name, text = gate_text()
    keys = {c: _cache_key(engine_config, c, text) for c in codecs}
    results: dict[str, GateResult] = {}
    errors: list[str] = []
    for codec in codecs:
        data = read_keyed(_cache_path(keys[codec]), keys[codec], errors, "kv codec gate cache") if use_cache else None
        if data is not None:
            results[codec] = GateResult(**{**_measured(data["result"]), "source": "cached"})
    todo = [c for c in codecs if c not in results]
    if todo:
        for codec, result in _measure(engine_config, todo, name, text).items():
            write_keyed(_cache_path(keys[codec]), keys[codec], {"result": _measured(asdict(result))}, errors,
                        "kv codec gate cache")
            results[codec] = result
    return [_judged(results[c], thresholds) for c in codecs]


def _judged(r: GateResult, thresholds: Thresholds) -> GateResult:
    from dataclasses import replace
    return replace(r, failures=tuple(thresholds.failures(r)), thresholds=thresholds)


def _measured(row: dict) -> dict:
    """What a cache file holds of a result: the measurement (the verdict is the thresholds' of the reader)."""
    return {k: v for k, v in row.items() if k not in ("failures", "thresholds")}


def _measure(engine_config, codecs: list[str], text_name: str, text: str) -> dict[str, GateResult]:
    from pdserve.model.loader import resolve_model_dir
    model_dir = resolve_model_dir(engine_config.model)
    start = time.perf_counter()
    exact, tokens = _run(engine_config, EXACT, text)
    spent = time.perf_counter() - start
    out = {}
    for codec in codecs:
        start = time.perf_counter()
        coded, _ = _run(engine_config, codec, text)
        out[codec] = GateResult(
            codec=codec, model=Path(model_dir).name, text=text_name, tokens=tokens,
            perplexity_exact=_perplexity(exact["nll"]), perplexity_coded=_perplexity(coded["nll"]),
            top1_agreement=_agreement(exact["top1"], coded["top1"]),
            greedy_agreement=_agreement(exact["greedy"], coded["greedy"]),
            seconds=spent + time.perf_counter() - start)
    return out


def _run(engine_config, codec: str, text: str) -> tuple[dict, int]:
    """The text's per-position NLL and top-1 token, and the free-running greedy tokens, under `codec`."""
    import torch

    from pdserve.core.sampling_params import SamplingParams
    from pdserve.engine.llm import LLM
    bs, threads = engine_config.block_size, torch.get_num_threads()
    try:
        llm = LLM(model=engine_config.model, dtype=engine_config.dtype, device=engine_config.device,
                  weights=engine_config.weights, attention_backend=engine_config.attention_backend,
                  num_threads=THREADS, block_size=bs,
                  kv_cache_dtype=codec, kv_host_gb=0, enable_prefix_caching=False,
                  num_kv_blocks=2 * -(-(TOKENS + GREEDY_PROMPT + GREEDY_TOKENS) // bs) + 8)
        ids = llm.tokenizer.encode(text, add_special_tokens=False)[:TOKENS]
        scored, free = llm.generate(
            [ids, ids[:GREEDY_PROMPT]],
            [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
             SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)])
    finally:
        torch.set_num_threads(threads)  # (the process's own, e.g. the gateway's, as they were)
    entries = scored.prompt_logprobs[1:]
    return {"nll": [-e[0] for e in entries], "top1": [e[2][0][0] for e in entries],
            "greedy": list(free.token_ids)}, len(ids)


def _perplexity(nll: list[float]) -> float:
    return math.exp(sum(nll) / len(nll))


def _agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b)) / max(len(a), 1)


def _cache_key(engine_config, codec: str, text: str) -> dict:
    import torch

    from pdserve.cbuild import cpu_signature
    from pdserve.model.config import model_fingerprint
    from pdserve.model.loader import resolve_model_dir
    from pdserve.version import __version__
    gpu = torch.cuda.get_device_name(0) if engine_config.device != "cpu" and torch.cuda.is_available() else ""
    return {"version": VERSION, "machine": platform.machine(),
            "cpu": hashlib.sha256(cpu_signature().encode()).hexdigest()[:16], "gpu": gpu,
            "model": model_fingerprint(resolve_model_dir(engine_config.model)), "dtype": engine_config.dtype,
            "device": engine_config.device, "weights": engine_config.weights,
            "attention_backend": engine_config.attention_backend,
            "kv_cache_dtype": codec, "text": hashlib.sha256(text.encode()).hexdigest()[:16], "tokens": TOKENS,
            "threads": THREADS,
            "torch": torch.__version__, "pdserve": __version__}


def _cache_path(key: dict) -> Path:
    from pdserve.cbuild import user_cache
    from pdserve.engine.calibration import CACHE_ENV
    digest = hashlib.sha256(repr(sorted(key.items())).encode()).hexdigest()[:16]
    return user_cache("calibration", CACHE_ENV) / f"codec-gate-{digest}.json"


# ---- what `pdserve serve` gates --------------------------------------------------------------------------------
def engine_codecs(engine_config, *more: str | None) -> list[str]:
    """The codecs an engine config (and `more`) codes KV in: the pool's and the storage tiers'; exact (`auto`)
    and unset ones left out, each once."""
    from pdserve.core.kvstore import kv_codecs
    names = [engine_config.kv_cache_dtype, engine_config.kv_host_cache_dtype, engine_config.kv_disk_cache_dtype,
             *more]
    return list(dict.fromkeys(n for n in names if n in kv_codecs.CODECS and n != EXACT))


def served_codecs(engine_config, serve_config) -> list[str]:
    """Every codec a deployment (or a joined worker: its config has no per-role pools) would code KV in: the
    engine's, the pools' per role and the wire's (its `auto` compacts into `wire_format.COMPACT`)."""
    from pdserve.core.pd import wire_format
    wire = serve_config.kv_wire_dtype
    return engine_codecs(engine_config, getattr(serve_config, "prefill_kv_cache_dtype", None),
                         getattr(serve_config, "decode_kv_cache_dtype", None),
                         wire_format.COMPACT if wire == wire_format.AUTO else wire)


def gate_serve(engine_config, serve_config, thresholds: Thresholds = Thresholds()) -> list[GateResult]:
    """The gate of `pdserve serve` and `pdserve worker` (`--kv-codec-gate on`): a one-line error naming the
    first codec that fails. `serve_config`: any object with `kv_codec_gate` and `kv_wire_dtype` (and, for a
    deployment, its per-role pool codecs)."""
    codecs = served_codecs(engine_config, serve_config)
    if serve_config.kv_codec_gate == "off" or not codecs:
        return []
    results = check_codecs(engine_config, codecs, thresholds)
    for r in results:
        if not r.passed:
            raise PdserveError(f"refusing to start: {r.line()} (--kv-codec-gate off skips this check)")
    return results
