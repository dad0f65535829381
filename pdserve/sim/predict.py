"""When will the KV blocks the conductor is about to have produced be consumed? The conductor's prediction.

When the conductor dispatches a prefill (right after the decode worker reserved the blocks), it predicts
the time the decode worker will first read those blocks: the prefill worker's current step ends, its
backlog and this prompt are prefilled in budget-sized chunks, the last chunk crosses the link, and the
decode worker reaches its next step boundary. Schedule predictability is the share of delivered blocks
first consumed within +-5 ms of this prediction. A small injected object, like the routing policies.
"""

from __future__ import annotations

from typing import Protocol

from pdserve.sim.timemodel import StepShape, TimeModel


class ConsumptionPredictor(Protocol):
    def predict(self, now: float, prefill, decode, tokens: int, backlog: int, last_bytes: float) -> float: ...


class QueueModelPredictor:
    def __init__(self, time_model: TimeModel, chunk_tokens: int, bandwidth: float, latency_s: float) -> None:
        self.time_model, self.chunk, self.bandwidth, self.latency_s = time_model, chunk_tokens, bandwidth, latency_s

    def prefill_time(self, tokens: int) -> float:
        t, done = 0.0, 0
        while done < tokens:
            n = min(self.chunk, tokens - done)
            t += self.time_model.step_time(StepShape(n, n * n, n * (n + 1) // 2, n, 0, 0, 0))
            done += n
        return t

    def predict(self, now: float, prefill, decode, tokens: int, backlog: int, last_bytes: float) -> float:
        t = max(prefill.step_end_s - now, 0.0) if prefill.busy else 0.0
        t += self.prefill_time(backlog + tokens) + last_bytes / self.bandwidth + 2 * self.latency_s
        n = decode.scheduler.num_running + 1
        # Prompt lengths, not current lengths: they do not move inside a fast-forward window.
        ctx = sum(r.num_prompt_tokens for r in decode.scheduler.running) + tokens
        return now + t + self.time_model.step_time(StepShape.decode(n, ctx)) / 2
