"""Staging in the simulator, as the real prefill worker does it (`pdserve.engine.pd`, "Staging"): the core's
`stage` command runs a prefill-only pass `<rid>@stage`, ranked after every real prefill of its tier, with no
flows; the prompt's real prefill, dispatched once the decode worker has room, waits for that pass to end and
then finds the prompt in the engine's prefix cache (and host tier). The decisions (when, which prompt, how many
blocks a prefill engine keeps staged) are the conductor core's (`ConductorCore._stage_next`)."""

from __future__ import annotations

import math
from collections.abc import Callable

from pdserve.core.kv_tiers import pin_staged, unpin_staged
from pdserve.core.request import STAGE
from pdserve.sim.engine import SimEngine, SimRequest


def stage_blocks(engine: SimEngine, scheduled: bool) -> int:
    """Blocks of staged KV a prefill engine offers to keep: its host tier, else half its pool (as the real
    worker's `_stage_blocks`); 0 under fifo delivery."""
    if engine.role != "prefill" or not scheduled:
        return 0
    host = engine.tiers.capacities().get("host", 0) if engine.tiers is not None else 0
    return host or engine.engine.block_manager.num_blocks // 2


def stage_max_blocks(engine: SimEngine) -> int:
    window = engine.scheduler.window
    return window.window - 1 if window is not None else engine.engine.block_manager.num_blocks


class SimStaging:
    def __init__(self, life) -> None:
        self.life = life  # the conductor's `Lifecycle` counters
        self.deferred: dict[str, Callable[[], None]] = {}  # rid -> adds its real prefill
        self.prompts: dict[str, object] = {}  # rid -> the prompt of its running stage pass
        self.staged: dict[str, tuple] = {}  # rid -> its staged blocks' hashes (pinned in host until delivered)

    def stage(self, engine: SimEngine, request: SimRequest) -> None:
        """`request`: the prompt's prefill-only request, made under the stage id."""
        self.prompts[request.request_id] = request.prompt_token_ids
        request.request_id += STAGE
        request.arrival_s = math.inf
        engine.scheduler.add_request(request)
        self.life.staged += 1

    def add_prefill(self, engine: SimEngine, rid: str, add: Callable[[], None]) -> None:
        """Add a real prefill now, or when its stage pass (under way, promoted) ends."""
        if not engine.scheduler.claim_stage(rid + STAGE, engine.clock()):
            self.deferred[rid] = add
        else:
            self.prompts.pop(rid, None)
            add()

    def ended(self, engine: SimEngine, request_id: str, ok: bool) -> str | None:
        """A request ended on a prefill engine: for a stage pass, its request's id (after adding the real
        prefill that waited for it); else None."""
        if not request_id.endswith(STAGE):
            return None
        rid = request_id[:-len(STAGE)]
        prompt = self.prompts.pop(rid, ())
        if ok:
            self.staged[rid] = pin_staged(engine.engine.block_manager, engine.tiers, prompt)
        add = self.deferred.pop(rid, None)
        if add is not None:
            add()
        return rid

    def done(self, engine: SimEngine, rid: str) -> None:
        """`rid` ended on this prefill engine (prefilled or aborted): its staged host entries may go."""
        unpin_staged(engine.tiers, self.staged.pop(rid, ()))
        self.prompts.pop(rid, None)

    def abort(self, engine: SimEngine, rid: str) -> None:
        engine.engine.abort([rid + STAGE])
        self.deferred.pop(rid, None)
        self.done(engine, rid)
