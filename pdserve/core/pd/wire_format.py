"""Which KV format a transfer travels in (`--kv-wire-dtype`): torch-free, decided once per transfer when the
prefill worker takes it, by the real worker on its links' measured state and by the simulator on its link model.

- `pool` (the default): the prefill worker's pool format, never re-encoded (exact).
- a codec name (`int8`, `fp8_e4m3`, `fp16`, ...): every transfer in that format.
- `auto`: class- and link-aware. The guaranteed tier (`priority`) always travels exact; an elastic tier's KV
  (`default`, `flex`) travels compact (`COMPACT`, when it is smaller than the pool's) when the link would not
  deliver it exact before its predicted consumption: when what is queued ahead of it on the link (its own tier
  and better) plus its own bytes, at the link's measured rate, take longer than the time until the decode
  worker is predicted to read it (its consumption slack). A transfer with no prediction, or a link whose rate
  is not known yet, travels exact. The time until it is read is the conductor's prediction as if the link took
  no time (the prompt's prefill and the decode worker's first step: `Admission.predict_read_s`, the `Prefill`
  command's `read_in_s`), not its delivery deadline, whose learned delivery tail already holds the link's past
  waits (on a steadily backed-up link exact KV would "fit" by construction).

The receiver decodes a chunk in another format into its pool's (`pdserve.kv.transcode`); each chunk names
its format (`kv` in its header).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.core.kvstore.kv_codecs import CODECS
from pdserve.core.service_tiers import SERVICE_TIERS
from pdserve.errors import check_choice

POOL, AUTO = "pool", "auto"
COMPACT = "int8"  # what `auto` ships an elastic tier's KV in when its link is backed up
EXACT_TIERS = frozenset({"priority"})  # the guaranteed tier: never re-encoded by `auto`


def check_wire_dtype(name: str) -> str:
    """`name` if it names a wire format choice, else a one-line error listing them."""
    return check_choice(name, [POOL, AUTO, *(c for c in CODECS if c != "auto")], "kv_wire_dtype")


def tiers_ahead(tier: str) -> set[str]:
    """The service tiers whose queued KV goes before `tier`'s on a link: its own and the better ones."""
    if tier not in SERVICE_TIERS:
        return set(SERVICE_TIERS)
    return set(SERVICE_TIERS[:SERVICE_TIERS.index(tier) + 1])


@dataclass(frozen=True)
class LinkView:
    """What a prefill worker knows of a transfer's link when it takes the transfer."""
    queued_bytes: float  # KV of the transfer's tier and better queued there
    rate: float | None  # bytes/s it measured (None: not known yet)


@dataclass(frozen=True)
class WireFormat:
    mode: str = POOL

    def __post_init__(self) -> None:
        check_wire_dtype(self.mode)

    def choose(self, tier: str, pool_format: str, own_bytes: float, link: LinkView,
               consume_in_s: float | None, compact_ratio: float) -> str:
        """The format of a transfer of `own_bytes` (in the pool's format `pool_format`) in service tier `tier`,
        predicted to be read `consume_in_s` from now were the link free; `compact_ratio`: COMPACT's bytes per pool byte."""
        if self.mode == POOL:
            return pool_format
        if self.mode != AUTO:
            return self.mode
        if tier in EXACT_TIERS or compact_ratio >= 1.0 or consume_in_s is None or not link.rate:
            return pool_format
        exact_s = (link.queued_bytes + own_bytes) / link.rate
        return COMPACT if exact_s > consume_in_s else pool_format
