"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from pdserve.errors import InvalidRequestError

MAX_LOGPROBS = 20  # most alternatives returned per token (OpenAI's chat top_logprobs bound)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. top_k 0 or -1 means no top-k cut. `seed` makes sampling reproducible per
    request regardless of what else is in the batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # each sampled token's logprob and this many top alternatives (None: none)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (no prefix cache)
    # structured output: an llguidance grammar (`pdserve.server.structured` builds it; `pdserve.model.grammar`
    # masks the sampler's logits by it); None: unconstrained
    grammar: str | None = None
    # the prompt's last `grammar_replay` tokens are outputs the grammar already took (a request that moved
    # mid-stream to another worker computes them as prompt there; its matcher starts after them)
    grammar_replay: int = 0

    def __post_init__(self) -> None:
        # Accept lists from callers (JSON, CLI) but store tuples so the object stays hashable and frozen.
        stop = () if self.stop is None else ((self.stop,) if isinstance(self.stop, str) else self.stop)
        stop_ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidRequestError("stop must be a string or a list of non-empty strings", param="stop")
        if not isinstance(stop_ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in stop_ids):
            raise InvalidRequestError("stop_token_ids must be a list of non-negative integers",
                                      param="stop_token_ids")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(stop_ids))
        self._validate()

    def _validate(self) -> None:
        for name in ("temperature", "top_p"):
            if not _is_number(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be a number, got {getattr(self, name)!r}", param=name)
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}",
                                      param="max_tokens")
        if not 0.0 <= float(self.temperature) <= 2.0:
            raise InvalidRequestError(f"temperature must be in [0, 2], got {self.temperature!r}",
                                      param="temperature")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}",
                                          param=name)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}",
                                      param="top_k")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# The sampling fields a model's generation config may give defaults for (those of vLLM's that pdserve samples with)
DEFAULTABLE = ("temperature", "top_p", "top_k")


@dataclass(frozen=True)
class SamplingDefaults:
    """What the sampling fields a request leaves unset take (`--generation-config`; vLLM's default sampling params).

    `values` holds only the fields the model recommends; a field it does not name keeps the caller's own default
    (OpenAI's over HTTP: `SamplingParams`' defaults). `source` says where the values came from; `ignored` names the
    fields of the model's file pdserve does not sample with (said at start, never silently dropped)."""

    values: dict = field(default_factory=dict)
    source: str = "none from the model (--generation-config vllm)"
    ignored: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = set(self.values) - set(DEFAULTABLE)
        if unknown:
            raise InvalidRequestError(f"no sampling default for {sorted(unknown)}; only {', '.join(DEFAULTABLE)}",
                                      param="generation_config")
        SamplingParams(**self.values)  # in range, else the same one-line error a request would get

    def fill(self, **given) -> dict:
        """`given` (None: the request left it unset) with the unset fields the model recommends filled in; fields
        still unset are left out, so whoever builds the `SamplingParams` applies its own default."""
        return {k: self.values[k] if v is None else v for k, v in given.items() if v is not None or k in self.values}

    def in_force(self) -> dict:
        """The value each defaultable field of a request that sets none gets over HTTP (OpenAI's where the model
        names none), and where the model's came from: what GET /v1/models reports."""
        neutral = {f.name: f.default for f in fields(SamplingParams) if f.name in DEFAULTABLE}
        return {**neutral, **self.values, "source": self.source}

    def line(self) -> str:
        """One line saying which defaults are in force (printed at start, as vLLM does)."""
        ignored = f"; not applied (pdserve does not do them): {', '.join(self.ignored)}" if self.ignored else ""
        if not self.values:
            return (f"Default sampling parameters: OpenAI's (temperature 1.0, top_p 1.0) for the fields a request "
                    f"leaves unset: {self.source}{ignored}")
        given = ", ".join(f"{k}={v}" for k, v in self.values.items())
        return (f"Default sampling parameters have been overridden by {self.source}: {given} for the fields a "
                f"request leaves unset{ignored}. If this is not intended, start with --generation-config vllm.")


def params_dict(params: SamplingParams) -> dict:
    """`params` as a worker command carries them (msgpack-able: lists, not tuples); `SamplingParams(**d)` reads
    them back."""
    d = asdict(params)
    d["stop"] = []  # stop strings are the gateway's business (it detokenizes)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
