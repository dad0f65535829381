"""The simulated conductor's records: one request's flight through the simulated cluster, and the counters
of delivery and consumption the lifecycle metrics are computed from (`pdserve.sim.report.lifecycle`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pdserve.bench.metrics import RequestRecord
from pdserve.core.lifecycle_metrics import LifecycleWindow
from pdserve.core.sampling_params import SamplingParams
from pdserve.sim.engine import SimEngine

# the core's consumption checks (`Observe` metrics) -> which prediction each is against
_KINDS = {"kv_consumption_error": "final", "kv_consumption_error_at_prefilled": "at_prefilled",
          "kv_consumption_error_at_dispatch": "at_dispatch"}


@dataclass(eq=False)
class Flight:
    rid: str
    prompt: object  # array('q') of token ids
    params: SamplingParams
    record: RequestRecord
    priority: int = 0  # as the real conductor's: carried to both workers' schedulers
    tier: str = "default"
    decode: SimEngine | None = None
    xfer: str = ""  # its transfer, as the decode engine reserved it
    prefill: SimEngine | None = None
    flows: int = 0  # flows in the air
    in_air: list = field(default_factory=list)  # those flows (`sim.link.Flow`)
    delivered: float = 0.0  # bytes landed at the decode worker
    wire_ratio: float = 1.0  # its transfer's bytes per pool byte (`--kv-wire-dtype`)
    deadline_s: float = float("inf")  # the core's predicted consumption: its flows' delivery deadline
    read_s: float | None = None  # the same were the link free (`--kv-wire-dtype auto`'s slack)
    first_token: int | None = None  # sampled by the prefill worker
    failed: bool = False
    finished: bool = False


@dataclass
class Lifecycle:
    """Counters of delivery and consumption, for the lifecycle metrics; the checks of the core's consumption
    predictions in the window the gateway's /metrics also keep (`pdserve.core.lifecycle_metrics`), over the
    whole run."""
    bytes_sent: float = 0.0
    bytes_delivered: float = 0.0
    bytes_consumed: float = 0.0
    blocks_consumed: int = 0
    errors_s: list = field(default_factory=list)  # actual - final prediction, per consuming request
    dispatch_errors_s: list = field(default_factory=list)  # actual - prediction at dispatch
    checks: LifecycleWindow = field(default_factory=lambda: LifecycleWindow(None))  # on time, by tier and kind
    production_paused_s: float = 0.0  # prefill engines held back by backpressure, summed
    production_paced: Counter = field(default_factory=Counter)  # prefill chunks capped / held per link
    staged: int = 0  # prompts computed ahead while their decode engine had no room
    idle_prewarms: int = 0  # hot prefixes computed ahead on idle prefill engines
    transfers: int = 0
    transfer_failures: int = 0
    aborted: int = 0

    def observe(self, metric: str, error_s: float, blocks: int, tier: str, now: float) -> None:
        """The core's check of one of its consumption predictions: actual - predicted, for `blocks` blocks."""
        kind = _KINDS.get(metric)
        if kind is None:
            return
        self.checks.consumed(now, tier, error_s, blocks, kind)
        if kind == "final":
            self.errors_s.append(error_s)
        elif kind == "at_dispatch":
            self.dispatch_errors_s.append(error_s)
