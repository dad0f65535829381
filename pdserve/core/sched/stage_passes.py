"""A prefill worker's stage passes: prompts computed ahead while their decode worker has no room.

One copy for the real prefill worker (`pdserve.engine.pd.PrefillSide`) and the simulated prefill engine
(`pdserve.sim.staging`); which prompt to stage is the conductor core's decision (`pdserve.conductor.staging`).
A stage pass is a prefill-only request `<rid>@stage` ranked after every real prefill of its tier (arrival at
infinity: real work pauses it at a chunk boundary), with no transfer. When it ends, its prompt's host entries
are pinned (`pin_staged`, at most `STAGE_PIN_S`) until the real prefill has run. The real prefill
(`add_real`) drops a pass not started yet and takes its place, or waits for a pass under way, promoted to the
real prefill's arrival (`Scheduler.claim_stage`); then it finds the prompt cached and only sends it.
A warm pass (`warm`) is a stage pass of a hot prefix for no request in particular (idle prewarm).
`stage_capacity` is what a prefill worker advertises to the conductor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from pdserve.core.kvstore.block_hash import BlockHash
from pdserve.core.kvstore.block_manager import KVBlockManager
from pdserve.core.kvstore.kv_tiers import TieredKV
from pdserve.core.request import STAGE, Request, RequestStatus
from pdserve.core.sampling_params import SamplingParams

# A warm pass: one token sampled, ranked after every real request (lowest tier, least urgent priority)
WARM_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)
WARM_PRIORITY = 1 << 30
WARM_TIER = "flex"


def stage_capacity(scheduler, tiers: TieredKV | None, scheduled: bool) -> dict:
    """`stage_blocks`: blocks of staged KV a prefill worker keeps (its host tier, else half its pool; 0 when
    its delivery is not `scheduled`: no staging); `stage_max_blocks`: the longest prompt whose staged KV it
    reuses whole (a long-context worker reuses at most its hot window, `HotWindow.cap_hits`)."""
    pool = scheduler.blocks.num_blocks
    host = tiers.capacities().get("host", 0) if tiers is not None else 0
    window = scheduler.window
    return {"stage_blocks": (host or pool // 2) if scheduled else 0,
            "stage_max_blocks": window.window - 1 if window is not None else pool}


class StagePasses:
    def __init__(self, scheduler, tiers: TieredKV | None) -> None:
        self.scheduler = scheduler
        self.tiers = tiers
        self.deferred: dict[str, Callable[[], None]] = {}  # rid -> adds its real prefill when its pass ends
        self.prompts: dict[str, Sequence[int]] = {}  # rid -> the prompt of its running stage pass
        self.staged: dict[str, tuple] = {}  # rid -> its staged blocks' hashes (pinned in host until used)
        self.warming: set[str] = set()  # ids of warm passes under way

    def stage(self, request: Request) -> None:
        """`request`: the prompt's prefill-only request, made under the request's own id."""
        self.prompts[request.request_id] = request.prompt_token_ids
        request.request_id += STAGE
        request.arrival_s = math.inf
        self.scheduler.add_request(request)

    def warm(self, request: Request) -> None:
        """A hot prefix computed ahead for no request in particular (`pdserve.conductor.hot_prefixes`): a stage
        pass whose KV is left to the prefix cache and the host tier (nothing pinned, nothing waits for it)."""
        self.warming.add(request.request_id)
        self.stage(request)

    def add_real(self, rid: str, arrival_s: float, add: Callable[[], None]) -> bool:
        """Add `rid`'s real prefill now (True) or when its stage pass under way ends (False)."""
        if not self.scheduler.claim_stage(rid + STAGE, arrival_s):
            self.deferred[rid] = add
            return False
        self.prompts.pop(rid, None)
        add()
        return True

    def ended(self, request_id: str, ok: bool) -> str | None:
        """A request ended here: for a stage pass, its request's id (after adding the real prefill that
        waited for it; `ok`: prefilled, its blocks are cached and now pinned in host); else None."""
        if not request_id.endswith(STAGE):
            return None
        rid = request_id[:-len(STAGE)]
        prompt = self.prompts.pop(rid, ())
        if rid in self.warming:
            self.warming.discard(rid)
            return rid
        if ok:
            self.staged[rid] = pin_staged(self.scheduler.blocks, self.tiers, prompt)
        add = self.deferred.pop(rid, None)
        if add is not None:
            add()
        return rid

    def drop(self, rid: str, cached_tokens: int | None = None) -> int:
        """`rid` ended here: prefilled with `cached_tokens` from the cache, or aborted (None: its stage pass,
        if any, is dropped too). Its staged host entries may go; returns how many staged blocks were not used
        (evicted before the real prefill, or all of them when aborted)."""
        if cached_tokens is None:
            self.scheduler.finish_requests([rid + STAGE], RequestStatus.FINISHED_ABORTED)
            self.deferred.pop(rid, None)
        self.prompts.pop(rid, None)
        hashes = self.staged.pop(rid, ())
        unpin_staged(self.tiers, hashes)
        if cached_tokens is None:
            return len(hashes)
        return max(len(hashes) - cached_tokens // self.scheduler.blocks.block_size, 0)


STAGE_PIN_S = 120.0  # a staged prompt's host entries are kept at most this long for its delivery


def pin_staged(blocks: KVBlockManager, tiers: TieredKV | None, prompt: Sequence[int]) -> tuple:
    """A prefill worker's stage pass of `prompt` ended (`pdserve.engine.pd`, "Staging"): pin the host entries of
    its blocks for STAGE_PIN_S, so other prompts' write-through does not evict them before its delivery;
    returns its block hashes (for `unpin_staged`)."""
    hashes = tuple(blocks.find_prefix(prompt).block_hashes)
    if tiers is not None and tiers.host is not None:
        tiers.host.pin_many(hashes, blocks.clock() + STAGE_PIN_S)
    return hashes


def unpin_staged(tiers: TieredKV | None, hashes: Sequence[BlockHash]) -> None:
    if hashes and tiers is not None and tiers.host is not None:
        tiers.host.pin_many(hashes, 0.0)
