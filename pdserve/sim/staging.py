"""Staging in the simulator: each prefill engine runs its stage passes with the real worker's code
(`pdserve.core.sched.stage_passes.StagePasses`, as `pdserve.engine.pd.PrefillSide` does) and advertises the same
capacity (`stage_capacity`). The decisions (when, which prompt) are the conductor core's
(`pdserve.conductor.staging.Staging.next`)."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.core.kvstore.kv_tiers import capacity_blocks
from pdserve.core.sched.stage_passes import WARM_PARAMS, WARM_PRIORITY, WARM_TIER, StagePasses, stage_capacity
from pdserve.sim.engine import SimEngine, SimRequest


def engine_capacity(engine: SimEngine, scheduled: bool) -> dict:
    return {**stage_capacity(engine.scheduler, engine.tiers, scheduled and engine.role == "prefill"),
            "kv_capacity_blocks": capacity_blocks(engine.scheduler.blocks, engine.tiers)}


class SimStaging:
    def __init__(self, life) -> None:
        self.life = life  # the conductor's `Lifecycle` counters
        self.passes: dict[str, StagePasses] = {}  # prefill engine -> its stage passes

    def of(self, engine: SimEngine) -> StagePasses:
        passes = self.passes.get(engine.name)
        if passes is None:
            passes = self.passes[engine.name] = StagePasses(engine.scheduler, engine.tiers)
        return passes

    def stage(self, engine: SimEngine, request: SimRequest) -> None:
        self.of(engine).stage(request)
        self.life.staged += 1

    def warm(self, engine: SimEngine, rid: str, prompt, now: float) -> None:
        self.of(engine).warm(SimRequest(rid, prompt, WARM_PARAMS, arrival_s=now, priority=WARM_PRIORITY,
                                        prefill_only=True, service_tier=WARM_TIER))
        self.life.idle_prewarms += 1

    def add_prefill(self, engine: SimEngine, rid: str, add: Callable[[], None]) -> None:
        self.of(engine).add_real(rid, engine.clock(), add)

    def ended(self, engine: SimEngine, request_id: str, ok: bool) -> str | None:
        return self.of(engine).ended(request_id, ok)

    def done(self, engine: SimEngine, rid: str) -> None:
        """`rid` was prefilled on this engine: its staged host entries may go."""
        self.of(engine).drop(rid, cached_tokens=0)

    def abort(self, engine: SimEngine, rid: str) -> None:
        self.of(engine).drop(rid)
