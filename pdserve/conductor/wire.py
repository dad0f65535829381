"""The control plane's messages: one frozen dataclass per command (gateway -> worker) and per event
(worker -> gateway), and the one mapping to and from the plain dicts they travel as.

The conductor core makes commands (`Send(worker, Reserve(...))`); the gateway's driver, a worker process and
the simulator carry them out and read events through this module alone (`pdserve.worker.wire_codec` packs
them with msgpack on the sockets). A message that does not decode (not a dict, an unknown type, a required
field missing, a field no message of its type has) raises `WireError`: only those are bad events.

Request fields travel as the worker makes its request from them (`LLMEngine.make_request`): the prompt's
token ids, the sampling parameters as a dict (`pdserve.core.sampling_params.params_dict`), the priority, a
prewarm pin `(id, until_s)` and the service tier. Token items (`Tokens.items`) are dicts with `rid`, `i`
(the token's index in the output), `t` (the token id), `fin` (its finish reason or None), `cached`, and with a
first token `queue_s` and `prefill_s`; with logprobs asked for, `lp` (and with the first token `plp`). A
decode or colocated worker's first token carries `kv`: how its prompt KV arrived (`usage.kv_transfer`,
`pdserve.core.pd.kv_arrival`).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from pdserve.core.pd.sensitivity import DEFAULT as DEFAULT_LABEL
from pdserve.core.sched.schedule import SchedulerConfig
from pdserve.core.settings import KvBlockSettings, default_of

KINDS: dict[str, type] = {}


class WireError(ValueError):
    """A message that does not decode."""


def message(kind: str):
    """Register a frozen dataclass as the message of type `kind`."""
    def register(cls: type) -> type:
        cls = dataclass(frozen=True)(cls)
        cls.kind = kind
        KINDS[kind] = cls
        return cls
    return register


def to_dict(msg) -> dict:
    """The plain dict a message travels as: its fields and its `type`."""
    return {"type": msg.kind, **{f.name: getattr(msg, f.name) for f in fields(msg)}}


def from_dict(d: Any):
    """The message a decoded dict carries; `WireError` if it is none."""
    if not isinstance(d, dict):
        raise WireError(f"a message is a map, got {type(d).__name__}")
    cls = KINDS.get(d.get("type"))
    if cls is None:
        raise WireError(f"unknown message type {d.get('type')!r}")
    names = {f.name for f in fields(cls)}
    unknown = set(d) - names - {"type"}
    if unknown:
        raise WireError(f"{cls.kind}: unknown field(s) {sorted(unknown)}")
    missing = [f.name for f in fields(cls) if f.name not in d and f.default is MISSING
               and f.default_factory is MISSING]
    if missing:
        raise WireError(f"{cls.kind}: missing field(s) {missing}")
    return cls(**{k: v for k, v in d.items() if k != "type"})


# ---- commands: gateway -> worker -----------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestFields:
    """What a worker makes a request of (the module docstring); the rest of a command's fields follow."""
    rid: str
    prompt: list
    params: dict
    priority: int = field(default=0, kw_only=True)
    pin: tuple | None = field(default=None, kw_only=True)  # (prewarm id, until_s): its blocks stay cached
    tier: str = field(default="default", kw_only=True)
    sensitivity: str = field(default=DEFAULT_LABEL, kw_only=True)  # its KV's label (`core.pd.sensitivity`)


@message("generate")
class Generate(RequestFields):
    """Colocated: run the whole request here."""
    restore: dict | None = None  # {peer, tokens}: moved off a dead worker whose first tokens' KV it checkpointed


@message("reserve")
class Reserve(RequestFields):
    """Decode: hold blocks for the prompt, then expect its KV as `xfer`."""
    xfer: str
    restore: dict | None = None


@message("prefill")
class Prefill(RequestFields):
    """Prefill: compute the prompt and send its KV from block `first_block` to `dest` as `xfer`."""
    dest: str  # the decode worker's KV address
    link: str  # the decode worker's name: the link's far end
    xfer: str
    first_block: int
    deadline_in_s: float | None = None  # predicted first consumption, from now (the delivery deadline)
    read_in_s: float | None = None  # when it would first be read were the link free, from now (`auto` wire slack)


@message("stage")
class Stage(RequestFields):
    """Prefill: compute the prompt ahead, no transfer (its decode worker has no room yet)."""


@message("warm")
class Warm:
    """Prefill: compute a hot prefix ahead, for no request in particular; its KV carries `sensitivity`, the
    strictest label of the requests it was seen with."""
    rid: str
    prompt: list
    sensitivity: str = DEFAULT_LABEL


@message("abort")
class Abort:
    rid: str


@message("kv_failed")
class KvFailed:
    """Decode: the KV of `xfer` will not come; recompute the prompt here (`reason`: why, its
    `usage.kv_transfer.recompute_reason`, `pdserve.core.pd.kv_arrival`)."""
    xfer: str
    reason: str = "failed_timeout"


@message("redirect")
class Redirect:
    """Decode: expect the KV of `old` anew as `xfer` (another prefill worker computes it)."""
    old: str
    xfer: str


@message("renew")
class Renew:
    """Decode: the lapsed transfer's sender was heard (busy, not hung): its lease starts over."""
    xfer: str


@message("unpin")
class Unpin:
    id: str


@message("peer_gone")
class PeerGone:
    """Prefill: the decode worker at `addr` is gone; end its transfers."""
    addr: str


@message("shutdown")
class Shutdown:
    pass


@message("welcome")
class Welcome:
    """A joining worker was taken."""


@message("release")
class Release:
    """A leaving worker may go: nothing is left on it."""


@message("leave")
class Leave:
    """Drain, then go (role switching)."""


@message("refused")
class Refused:
    message: str


# ---- events: worker -> gateway -------------------------------------------------------------------------------
@message("ready")
class Ready:
    worker: str
    role: str
    pid: int = 0
    kv_addr: str = ""
    num_blocks: int = 0
    block_size: int = default_of(KvBlockSettings, "block_size")
    kv_capacity_blocks: int = 0
    max_model_len: int = 0
    max_num_batched_tokens: int = default_of(SchedulerConfig, "max_num_batched_tokens")
    max_num_seqs: int = 256
    stage_blocks: int = 0  # staged KV it keeps (`pdserve.core.sched.stage_passes.stage_capacity`)
    stage_max_blocks: int | None = None  # the longest prompt whose staged KV it reuses whole
    cmd_addr: str | None = None  # a joining worker: where it takes commands
    model: str | None = None  # a joining worker: the model it serves (`model_fingerprint`)
    replaces: bool = False  # a joining worker restarted under its name
    kv_block_bytes: int = 0  # one KV block at its pool's codec (what a transfer of it moves)


@message("reserved")
class Reserved:
    rid: str
    xfer: str
    first_block: int
    kv_addr: str
    needs_prefill: bool


@message("reserve_waiting")
class ReserveWaiting:
    rid: str
    xfer: str


@message("prefilled")
class Prefilled:
    rid: str
    failed: str | None = None
    landing_in_s: float | None = None
    queue_s: float | None = None
    prefill_s: float | None = None


@message("staged")
class Staged:
    rid: str
    ok: bool


@message("consumed")
class Consumed:
    items: list  # [[rid, at (the worker's monotonic clock)], ...]


@message("relanded")
class Relanded:
    items: list  # [[rid, landing_in_s], ...]


@message("tokens")
class Tokens:
    items: list  # token item dicts (the module docstring)
    worker: str | None = None


@message("transfer")
class Transfer:
    rid: str
    xfer: str
    outcome: str  # delivered | recompute | held
    state: str  # `pdserve.transfer.base.TransferState` value
    bytes: int
    seconds: float
    worker: str
    lapses: int = 0


@message("error")
class Error:
    rid: str | None
    status: int
    message: str
    etype: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None


@message("checkpointed")
class Checkpointed:
    worker: str
    items: list  # [[rid, tokens], ...]


@message("stats")
class Stats:
    worker: str
    role: str
    values: dict = field(default_factory=dict)  # `pdserve.worker.worker_stats.worker_stats`


@message("kv_cache")
class KvCache:
    """The block hashes a worker's caches stored and evicted since its last `kv_cache`, per tier (tier ->
    [hash, ...]; the first after `ready` lists all it holds): routing's knowledge of its cache contents."""
    worker: str
    stored: dict = field(default_factory=dict)
    evicted: dict = field(default_factory=dict)


@message("beat")
class Beat:
    worker: str
    loop_age_s: float


@message("leaving")
class Leaving:
    worker: str


@message("left")
class Left:
    worker: str
    released: bool = False


Command = (Generate, Reserve, Prefill, Stage, Warm, Abort, KvFailed, Redirect, Renew, Unpin, PeerGone, Shutdown,
           Welcome, Release, Leave, Refused)
Event = (Ready, Reserved, ReserveWaiting, Prefilled, Staged, Consumed, Relanded, Tokens, Transfer, Error,
         Checkpointed, Stats, KvCache, Beat, Leaving, Left)
