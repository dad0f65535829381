"""`SimExecutor`: the model runtime's stand-in. Implements the engine's `Executor` protocol.

It computes nothing: every chunk that samples gets the same valid token id (requests run with
`ignore_eos`, so they produce exactly `max_tokens` tokens), and the step's duration comes from a time model,
plus the time of the step's host -> device KV loads when the engine has KV tiers (`kv_io`, a
`pdserve.sim.tier_io.SimTierIO`; the real executor makes those copies before the forward too). The simulator
reads `last_duration` (and `last_shape`, `last_load_s`) after each `LLMEngine.step()`.
"""

from __future__ import annotations

from pdserve.core.sched.schedule import ExecutorOutput, SchedulerOutput
from pdserve.core.settings import KvBlockSettings, default_of
from pdserve.sim.tier_io import SimTierIO
from pdserve.sim.timemodel import StepShape, TimeModel


class SimExecutor:
    def __init__(self, time_model: TimeModel, block_size: int = default_of(KvBlockSettings, "block_size"),
                 vocab_size: int = 32000, token_id: int = 13, kv_io: SimTierIO | None = None) -> None:
        if not 0 <= token_id < vocab_size:
            raise ValueError("token_id must be a valid id")
        self.time_model = time_model
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.token_id = token_id
        self.kv_io = kv_io  # read by LLMEngine: with it, the engine has host (and disk) KV tiers
        self.last: SchedulerOutput | None = None
        self.last_shape = StepShape()
        self.last_duration = 0.0
        self.last_load_s = 0.0
        self.num_steps = 0
        self.history: list[SchedulerOutput] | None = None  # set to a list to record every step (tests)

    def execute(self, scheduled: SchedulerOutput) -> ExecutorOutput:
        self.last = scheduled
        self.last_shape = StepShape.of(scheduled)
        if self.kv_io is not None:  # what the step's poll submitted starts now, before the forward
            self.kv_io.start(self.kv_io.clock())
        self.last_load_s = self.kv_io.load(scheduled.kv_loads) if scheduled.kv_loads else 0.0
        compute = self.time_model.step_time(self.last_shape) if scheduled.chunks else 0.0
        self.last_duration = compute + self.last_load_s if self.last_load_s else compute
        if scheduled.kv_loads_ahead:  # beside the forward (a copy engine): the step ends when both have
            ahead = self.kv_io.load(scheduled.kv_loads_ahead)
            self.last_load_s += ahead
            self.last_duration = max(self.last_duration, ahead)
        self.num_steps += 1
        if self.history is not None:
            self.history.append(scheduled)
        token = self.token_id
        return ExecutorOutput({c.request_id: token for c in scheduled.chunks if c.sample}, step_s=self.last_duration)
