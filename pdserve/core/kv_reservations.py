"""The decode side of prefill/decode disaggregation in the scheduler: reservations for KV another worker delivers.

A decode worker `reserve_kv`s blocks for a request whose KV another worker delivers (WAITING_FOR_KV, never
scheduled), then `kv_delivered(first_token)` makes it a decoding request with the whole prompt computed and
that token as its first output (or finished by it); without a first token (the prefill worker was not needed:
every prompt token but the last was cached here) it computes the last prompt token itself. `kv_failed` sends
it to the waiting queue to recompute here.

`KVReservations` is a part of `pdserve.core.scheduler.Scheduler` (a mixin over the scheduler's state: its
blocks, tiers, hot window, request table and waiting queue), kept apart so each module holds one concept.
"""

from __future__ import annotations

import bisect

from pdserve.core.block_manager import PrefixHit
from pdserve.core.kv_ops import KVLoad
from pdserve.core.request import Request, RequestStatus


class KVReservations:
    """Reservations of blocks for delivered KV (see the module docstring)."""

    def reserve_kv(self, request: Request) -> int | None:
        """Hold blocks for the whole prompt of a request whose KV will be delivered; None when no room now.

        Returns the number of prompt tokens already in this worker's prefix cache (whole blocks): the sender
        need not deliver those. Raises like `add_request` for a request that could never be served.
        """
        self.check_new(request)
        self._take_back(request, self.blocks.blocks_needed(request.num_prompt_tokens), self._taken_back)
        if len(self.running) + self._num_reserved >= self.config.max_num_seqs:
            return None
        prefix = self.blocks.find_prefix(request.all_token_ids, request.request_id)
        if self.window is not None and self.blocks.blocks_needed(request.num_prompt_tokens) > self.window.window:
            hit_blocks = self._reserve_long(request, prefix)  # device hits unused: its head goes to host
            if hit_blocks is None:
                return None
            hit_tokens = hit_blocks * self.blocks.block_size
        else:
            lower = self._tier_hit(prefix)
            if lower.waiting:
                return None
            ids = self.blocks.allocate(request.request_id, request.num_prompt_tokens, prefix)
            if ids is None:
                return None
            if lower.host:
                self._pending_loads[request.request_id] = self._load(lower, prefix, ids, count=True)
            hit_tokens = prefix.num_tokens + len(lower.host) * self.blocks.block_size
        self.requests[request.request_id] = request
        self._num_reserved += 1
        request.scheduled_s = self.blocks.clock()
        request.status = RequestStatus.WAITING_FOR_KV
        request.num_cached_prompt_tokens = hit_tokens
        self.stats.num_prompt_tokens += request.num_prompt_tokens
        self.stats.num_prefix_hit_tokens += hit_tokens
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
            self._pending_loads[request.request_id] = loads
        return hit_blocks

    def kv_delivered(self, request_id: str, first_token: int | None = None) -> Request:
        """The prompt's KV is in the reserved blocks. With `first_token` (sampled by the prefill worker) the
        request decodes from there, or ends if that token stops it (check `is_finished`); without one, only
        the prompt's uncached tail (the last token; after a restore, more) is computed here, giving the first token."""
        req = self._reserved(request_id)
        if req.cold_hashes:  # its head arrived in host entries: now servable (and copied to disk)
            self.tiers.commit_cold(req.cold_hashes)
        # without a first token: what is not cached here is computed here (the last prompt token; or a
        # restored checkpoint's tail, `pdserve.engine.checkpoints`)
        req.num_computed_tokens = (req.num_prompt_tokens if first_token is not None
                                   else min(req.num_cached_prompt_tokens, req.num_prompt_tokens - 1))
        self.blocks.cache_full_blocks(request_id, req.all_token_ids, req.num_computed_tokens)
        req.status = RequestStatus.PREFILLING if first_token is None else RequestStatus.DECODING
        bisect.insort(self.running, req, key=self.policy.sort_key)
        if first_token is not None:
            req.prefilled_s = req.first_token_s = self.blocks.clock()
            req.append_output_token(first_token)
            status = self._stop_status(req)
            if status is not None:
                self._finish(req, status)
        return req

    def _reservation_loads(self) -> tuple[list[KVLoad], list[KVLoad]]:
        """This step's loads of reservations' host hits: (those a request whose KV landed reads now, those
        ahead of the KV, at most `ahead_load_blocks`, oldest reservation first)."""
        needed: list[KVLoad] = []
        ahead: list[KVLoad] = []
        left = self.ahead_load_blocks
        for rid, loads in list(self._pending_loads.items()):
            req = self.requests.get(rid)
            if req is not None and req.status is not RequestStatus.WAITING_FOR_KV:
                needed += loads
                take = len(loads)
            else:
                take = len(loads) if left is None else min(left, len(loads))
                ahead += loads[:take]
                left = None if left is None else left - take
            if take == len(loads):
                del self._pending_loads[rid]
            else:
                self._pending_loads[rid] = loads[take:]
        return needed, ahead

    def kv_failed(self, request_id: str) -> None:
        """Delivery failed: drop the reserved blocks (their content is not trusted) and recompute here."""
        req = self._reserved(request_id)
        self._drop_pending_loads(request_id)
        self.blocks.free(request_id)
        self._drop_cold(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.push(req)

    def _reserved(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None or req.status is not RequestStatus.WAITING_FOR_KV:
            raise KeyError(f"{request_id!r} is not waiting for KV")
        self._num_reserved -= 1
        return req
