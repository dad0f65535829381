"""The simulated conductor's records: one request's flight through the simulated cluster, and the counters
of delivery and consumption the lifecycle metrics are computed from (`pdserve.sim.report.lifecycle`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pdserve.bench.metrics import RequestRecord
from pdserve.conductor.consumption import CONSUME_TOLERANCE_S
from pdserve.core.sampling_params import SamplingParams
from pdserve.sim.engine import SimEngine


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
    superseded: float = 0.0  # partly filled blocks sent again later
    deadline_s: float = float("inf")  # the core's predicted consumption: its flows' delivery deadline
    first_token: int | None = None  # sampled by the prefill worker
    failed: bool = False
    finished: bool = False


@dataclass
class Lifecycle:
    """Counters of delivery and consumption, for the lifecycle metrics."""
    bytes_sent: float = 0.0
    bytes_delivered: float = 0.0
    bytes_consumed: float = 0.0
    blocks_consumed: int = 0
    blocks_on_time: int = 0
    errors_s: list = field(default_factory=list)  # actual - final prediction, per consuming request
    dispatch_errors_s: list = field(default_factory=list)  # actual - prediction at dispatch
    blocks_on_time_at_prefilled: int = 0  # on time against the prediction made when prefilled
    blocks_on_time_at_dispatch: int = 0
    production_paused_s: float = 0.0  # prefill engines held back by backpressure, summed
    production_paced: Counter = field(default_factory=Counter)  # prefill chunks capped / held per link
    staged: int = 0  # prompts computed ahead while their decode engine had no room
    idle_prewarms: int = 0  # hot prefixes computed ahead on idle prefill engines
    transfers: int = 0
    transfer_failures: int = 0
    aborted: int = 0

    def observe(self, metric: str, error_s: float, blocks: int) -> None:
        """The core's check of one of its consumption predictions: actual - predicted, for `blocks` blocks."""
        on_time = blocks * (abs(error_s) <= CONSUME_TOLERANCE_S)
        if metric == "kv_consumption_error":
            self.errors_s.append(error_s)
            self.blocks_on_time += on_time
        elif metric == "kv_consumption_error_at_prefilled":
            self.blocks_on_time_at_prefilled += on_time
        elif metric == "kv_consumption_error_at_dispatch":
            self.dispatch_errors_s.append(error_s)
            self.blocks_on_time_at_dispatch += on_time
