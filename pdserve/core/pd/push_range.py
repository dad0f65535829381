"""What a prefill step sends of a transfer: the push range both clocks compute the same way.

A prefill step that computed a prompt up to token `end` sends the blocks that became complete (from the first
one not yet delivered in full) and, with the prompt's last chunk, its last block partly filled. A step that
ends inside a block sends nothing of that block, under either delivery: the receiver reads nothing before the
transfer is done, so its bytes as they are now would go again, complete, with the next step and never be read
(fifo used to send them: ~25% more KV bytes on a 50 Mbit/s link, where production pacing cuts prefill chunks
at any token). The real prefill worker (`pdserve.engine.pd.PrefillSide.on_layer`, per layer) and the
simulator (`pdserve.sim.kv_push`, over the link model) both take their range from `push_range`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PushRange:
    first: int  # block-table index of the first block sent
    full: int  # blocks [first, full) are complete
    partial: bool  # block `full` goes too, partly filled (the prompt's last block)
    final: bool  # the prompt's last chunk
    next_block: int  # the first block not yet delivered in full, after this step

    @property
    def num_blocks(self) -> int:
        return max(self.full - self.first, 0) + self.partial


def push_range(next_block: int, end: int, num_tokens: int, block_size: int, cold: int = 0) -> PushRange:
    """`next_block`: the first block not yet delivered in full; `end`: tokens computed after this step, of
    `num_tokens`; `cold`: a long prompt's oldest blocks that already left the pool (sent when computed)."""
    first, full = max(next_block, cold), end // block_size
    final = end >= num_tokens
    partial = final and bool(end % block_size) and first <= full
    return PushRange(first, full, partial, final, max(next_block, full))
