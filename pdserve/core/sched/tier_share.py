"""The guaranteed tier's reserved share of one worker: lent while idle, taken back at the next step.

The `priority` service tier (`pdserve.core.service_tiers`) owns `share` of the worker's decode slots
(`max_num_seqs`) and KV blocks; its token budget comes first anyway (its requests lead the queue order).
While no priority request waits, elastic requests (default, flex) may use everything. When a priority
request waits and does not fit, the elastic requests holding more than their `1 - share` part are preempted,
lowest in queue order first (flex before default, the latest deadline first), until it fits or the elastic
requests are back within their part. This is the one preemption rule besides the scheduler's own (a
running request that cannot grow preempts the lowest running one); both are counted per tier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdserve.core.request import Request

GUARANTEED = "priority"


class ReservedShare:
    def __init__(self, share: float, max_num_seqs: int, num_blocks: int) -> None:
        self.share = share
        self.elastic_slots = int((1.0 - share) * max_num_seqs)
        self.elastic_blocks = int((1.0 - share) * num_blocks)
        self.max_num_seqs = max_num_seqs

    def victims(self, head: Request, need_blocks: int, running: Sequence[Request], num_reserved: int,
                free_blocks: int, blocks_of: Callable[[Request], int]) -> list[Request]:
        """The running requests to preempt so that the waiting `head` can start: none unless `head` is of the
        guaranteed tier and short of slots or blocks while elastic requests exceed their part. `running` is in
        queue order (the last is preempted first); `blocks_of(r)`: the blocks `r` holds."""
        if self.share <= 0 or head.service_tier != GUARANTEED:
            return []
        elastic = [r for r in running if r.service_tier != GUARANTEED]
        held = sum(blocks_of(r) for r in elastic)
        slot_short = len(running) + num_reserved >= self.max_num_seqs
        block_short = need_blocks - free_blocks
        victims: list[Request] = []
        while elastic and (slot_short or block_short > 0):
            if len(elastic) <= self.elastic_slots and held <= self.elastic_blocks:
                break  # the elastic tiers are within their part: the priority request waits its turn
            victim = elastic.pop()
            victims.append(victim)
            freed = blocks_of(victim)
            held -= freed
            block_short -= freed
            slot_short = False
        return victims
