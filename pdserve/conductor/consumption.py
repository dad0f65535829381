"""When will a transfer's KV first be consumed? The conductor's prediction, refined as the transfer advances.

One copy for both clocks: the gateway's and the simulator's `ConductorCore` both call it, over the same
fitted step-time models admission keeps (`pdserve.conductor.admission.WorkerModel`, learnt from the workers'
live steps). A transfer's KV is first consumed by the decode step that starts once it has landed, which is
about when the request's first token reaches the gateway (the decode worker emits the prefill worker's
first token when it settles the transfer, then steps).

* At dispatch (the decode worker reserved the blocks, the prefill goes out): `now` + the predicted time to
  first token of this prompt behind its prefill worker's backlog (admission's TTFT model: the backlog of its
  tier rank or better, its own chunks, the decode worker's delivery tail).
* When the prefill worker reports the prompt prefilled, with its link's estimate of when the transfer's
  last queued chunk will have gone (`landing_in_s`: the bytes the delivery policy sends before it, at the
  link's rate; `pdserve.core.pd.delivery.LinkQueue.bytes_until`): that landing time + the decode worker's
  consumption tail for the transfer's service tier (from its recent first consumption - landing of that
  tier: the wait for its next step boundary, and for a flex request also for room in the batch; the decode
  worker's over all tiers until a tier has TIER_SAMPLES of its own). The tail taken is the centre of the
  window of +-`CONSUME_TOLERANCE_S` that holds the most recent tails, not their median: tails are uniform
  over a decode step while the worker is busy and 0 when a transfer lands on an idle one, and the median of
  such a mix can sit at the edge of the busy spread.
* Again whenever the prefill worker's link re-estimates that landing by more than `RELAND_S`
  (`pdserve.core.pd.delivery`): another transfer became due on the link and takes its tier's share of it
  (`ConductorCore.relanded`; the real worker's `PrefillSide.relanded`, the simulator's `_reland`).

The prediction is the transfer's delivery deadline (`--delivery scheduled` sends the earliest first within
a tier) and is checked when the decode worker reports the first consuming step: per block, actual minus
predicted, for the final (refined) prediction, the one made when the prompt was prefilled and the one made at
dispatch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from pdserve.conductor.admission import Admission
from pdserve.core.pd.delivery import CONSUME_TOLERANCE_S

TAIL_SAMPLES = 64
TIER_SAMPLES = 8  # a tier's own consumption tail is used once it has this many samples


@dataclass
class Prediction:
    blocks: int  # KV blocks the transfer delivers
    at_dispatch_s: float | None = None
    final_s: float | None = None  # the latest refinement
    at_prefilled_s: float | None = None  # the first refinement, when the prompt was prefilled
    landed_s: float | None = None  # when the prefill worker's link expected the last chunk out
    tier: str = "default"


class ConsumptionPredictor:
    def __init__(self, admission: Admission | None) -> None:
        self.admission = admission
        # decode worker, or (decode worker, tier) -> consumption - landing, the median of recent ones
        self.tail: dict = {}
        self.samples: dict = {}

    def at_dispatch(self, now: float, producer: str, decoder: str, tokens: int, ahead: int, behind: int,
                    busy_s: float | None = None) -> tuple[float | None, float | None]:
        """(predicted first consumption, the same were the link free: prefill and the decode worker's first step
        without its learned delivery tail, `Admission.predict_read_s`), each None until the models predict."""
        if self.admission is None:
            return None, None
        ttft = self.admission.predict_ttft_s(producer, decoder, tokens, ahead, behind, 0, busy_s)
        read = self.admission.predict_read_s(producer, decoder, tokens, ahead, behind, 0, busy_s)
        return None if ttft is None else now + ttft, None if read is None else now + read

    def at_prefilled(self, p: Prediction, now: float, decoder: str, landing_in_s: float | None) -> None:
        p.landed_s = now + (landing_in_s or 0.0)
        own = self.samples.get((decoder, p.tier))
        key = (decoder, p.tier) if own is not None and len(own) >= TIER_SAMPLES else decoder
        p.final_s = p.landed_s + self.tail.get(key, 0.0)
        if p.at_prefilled_s is None:
            p.at_prefilled_s = p.final_s

    def consumed(self, p: Prediction, decoder: str, at_s: float) -> None:
        """Learn the decode worker's consumption tail from a transfer that landed: the densest centre of its
        recent ones (a few transfers that waited long must not move every prediction)."""
        if p.landed_s is None:
            return
        for key in (decoder, (decoder, p.tier)):
            recent = self.samples.setdefault(key, deque(maxlen=TAIL_SAMPLES))
            recent.append(max(at_s - p.landed_s, 0.0))
            self.tail[key] = densest_centre(recent, CONSUME_TOLERANCE_S)


def densest_centre(samples, tolerance: float) -> float:
    """The centre of the window of +-`tolerance` that holds the most `samples` (of such windows, the one whose
    samples are closest to its centre): the point estimate most often within `tolerance` of them."""
    xs = np.sort(np.fromiter(samples, dtype=float))
    ends = np.searchsorted(xs, xs + 2 * tolerance, side="right")  # window [xs[i], xs[i] + 2 tol]
    counts = ends - np.arange(len(xs))
    best = np.flatnonzero(counts == counts.max())
    spans = [(xs[i] + xs[ends[i] - 1]) / 2 for i in best]
    return float(min(spans, key=lambda c: float(np.abs(xs - c).sum())))
