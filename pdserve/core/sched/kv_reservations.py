"""The decode side of prefill/decode disaggregation: blocks reserved for KV another worker delivers.

A decode worker reserves blocks for the whole prompt of a request whose KV another worker delivers
(WAITING_FOR_KV, never scheduled). Delivered, the request's prompt counts as computed (or all but its
uncached tail, which is computed here); if delivery fails, the blocks are dropped and it recomputes here.
`Scheduler.reserve_kv` / `kv_delivered` / `kv_failed` are the calls; the scheduler does the request's queue
side (admission checks, running and waiting queues, stop checks), this module its KV side.

`KVReservations` owns the reserved requests and the host-tier loads of their prefix hits, which the
scheduler's next steps emit (`step_loads`). It sees the block manager, the host and disk tiers and a long
context's hot window; the scheduler hands it the last two as it gets them.
"""

from __future__ import annotations

import math

import numpy as np

from pdserve.core.kvstore.block_manager import KVBlockManager, PrefixHit
from pdserve.core.sched.hot_window import HotWindow
from pdserve.core.kvstore.kv_tiers import KVLoad, TierHit, TieredKV
from pdserve.core.request import Request, RequestStatus

_NO_TIER_HIT = TierHit()


LOOKING = -1  # `reserve`: not now, and not for lack of room: the prefix is being read from a lower tier

class KVReservations:
    """Requests waiting for delivered KV, and their host hits not loaded yet (see the module docstring)."""

    def __init__(self, blocks: KVBlockManager) -> None:
        self.blocks = blocks
        self.tiers: TieredKV | None = None  # (set by the scheduler: `Scheduler.tiers`)
        self.window: HotWindow | None = None  # (set by the scheduler: `Scheduler.enable_long_context`)
        self._reserved: dict[str, Request] = {}  # request id -> request in WAITING_FOR_KV
        self._loads: dict[str, list[KVLoad]] = {}  # request id -> loads of its host hits, not emitted yet
        self._expected: dict[str, float] = {}  # request id -> predicted first consumption of its KV (`expect`)

    def __len__(self) -> int:
        return len(self._reserved)

    @property
    def has_loads(self) -> bool:
        return bool(self._loads)

    def reserve(self, request: Request) -> int | None:
        """Hold blocks for the whole prompt of `request`, which then waits for its KV; None when no room now,
        `LOOKING` while its prefix is being looked up in a lower tier (read from disk or the shared pool: ask
        again shortly). Returns the prompt tokens already cached here (whole blocks, device or host): not to be
        delivered."""
        prefix = self.blocks.find_prefix(request.all_token_ids, request.request_id)
        if self.window is not None and self.blocks.blocks_needed(request.num_prompt_tokens) > self.window.window:
            hit_blocks = self._reserve_long(request, prefix)  # device hits unused: its head goes to host
            if hit_blocks is None:
                return None
            hit_tokens = hit_blocks * self.blocks.block_size
        else:
            lower = _NO_TIER_HIT if self.tiers is None else self.tiers.extend(
                prefix.block_hashes[len(prefix.block_ids):])
            if lower.waiting:
                return LOOKING
            ids = self.blocks.allocate(request.request_id, request.num_prompt_tokens, prefix, request.service_tier)
            if ids is None:
                return None
            if lower.host:  # loaded into the fresh blocks `allocate` appended right after the device hit
                first = len(prefix.block_ids)
                self._loads[request.request_id] = self.tiers.load(lower.host, ids[first:first + len(lower.host)])
            hit_tokens = prefix.num_tokens + len(lower.host) * self.blocks.block_size
        self._reserved[request.request_id] = request
        request.scheduled_s = self.blocks.clock()
        request.status = RequestStatus.WAITING_FOR_KV
        request.num_cached_prompt_tokens = hit_tokens
        return hit_tokens

    def _reserve_long(self, request: Request, prefix: PrefixHit) -> int | None:
        lower = self.tiers.extend(prefix.block_hashes)
        if lower.waiting:
            return None
        reserved = self.window.reserve(request, prefix.block_hashes, lower)
        if reserved is None:
            return None
        _, loads, hit_blocks = reserved
        if loads:
            self._loads[request.request_id] = loads
        return hit_blocks

    def deliver(self, request_id: str, first_token: int | None) -> Request:
        """The prompt's KV is in the reserved blocks: the request no longer waits for it. With `first_token`
        (sampled by the prefill worker) it is DECODING with that token; without one, PREFILLING what is not
        cached here (the last prompt token; or a restored checkpoint's tail, `pdserve.engine.checkpoints`).
        Raises KeyError for a request not waiting for KV."""
        req = self._take(request_id)
        if req.cold_hashes:  # its head arrived in host entries: now servable (and copied to disk)
            self.tiers.commit_cold(req.cold_hashes)
        req.num_computed_tokens = (req.num_prompt_tokens if first_token is not None
                                   else min(req.num_cached_prompt_tokens, req.num_prompt_tokens - 1))
        self.blocks.cache_full_blocks(request_id, req.all_token_ids, req.num_computed_tokens,
                                      sla_class=req.service_tier, secret=req.sensitivity == "secret")
        req.status = RequestStatus.PREFILLING if first_token is None else RequestStatus.DECODING
        if first_token is not None:
            req.prefilled_s = req.first_token_s = self.blocks.clock()
            req.append_output_token(first_token)
        return req

    def fail(self, request_id: str) -> Request:
        """Delivery failed: the reserved blocks are freed (their content is not trusted) and the request is
        WAITING to recompute from scratch (its cold head, if any, is the caller's to release). Raises KeyError
        for a request not waiting for KV."""
        req = self._take(request_id)
        self.drop_loads(request_id)
        self.blocks.free(request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        return req

    def cancel(self, request_id: str) -> None:
        """The request ended (finished or aborted; its blocks are the caller's to free): no longer reserved."""
        del self._reserved[request_id]
        self._expected.pop(request_id, None)

    def expect(self, request_id: str, at_s: float) -> None:
        """The request's delivered KV is predicted to be first consumed at `at_s` (`Scheduler.expect_kv`)."""
        if request_id not in self._reserved:
            return
        self._expected[request_id] = at_s
        self.blocks.cols.expected_use_at_s[np.asarray(self.blocks.block_ids(request_id), np.int64)] = at_s

    def drop_loads(self, request_id: str) -> None:
        """Never load the request's host hits (it ended or lost its blocks, which may be reused meanwhile)."""
        loads = self._loads.pop(request_id, None)
        if loads:
            self.tiers.loads_done(loads)

    def step_loads(self, ahead_blocks: int | None) -> tuple[list[KVLoad], list[KVLoad]]:
        """This step's loads of host hits: (those of delivered requests, which read them now; those ahead of
        the KV, at most `ahead_blocks` (None: all), the earliest expected consumption first (`expect`), then the
        oldest reservation). Each load is emitted once; a request whose KV lands with some not emitted yet gets
        them from the step that first reads it."""
        needed: list[KVLoad] = []
        ahead: list[KVLoad] = []
        left = ahead_blocks
        order = list(self._loads.items())
        if self._expected:
            order.sort(key=lambda item: self._expected.get(item[0], math.inf))
        for rid, loads in order:
            if rid not in self._reserved:
                needed += loads
                take = len(loads)
            else:
                take = len(loads) if left is None else min(left, len(loads))
                ahead += loads[:take]
                left = None if left is None else left - take
            if take == len(loads):
                del self._loads[rid]
            else:
                self._loads[rid] = loads[take:]
        return needed, ahead

    def _take(self, request_id: str) -> Request:
        self._expected.pop(request_id, None)
        req = self._reserved.pop(request_id, None)
        if req is None:
            raise KeyError(f"{request_id!r} is not waiting for KV")
        return req
