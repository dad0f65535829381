"""What a prefill step sends of a transfer: the push range both clocks compute the same way.

A prefill step that computed a prompt up to token `end` sends the blocks that became complete (from the first
one not yet delivered in full) and, under fifo delivery or with the prompt's last chunk, the block it left
partly filled: its bytes as they are now, sent again, complete, with the next chunk (superseded then). Under
scheduled delivery only the prompt's last partial block goes: the receiver reads nothing before the transfer
is done. The real prefill worker (`pdserve.engine.pd.PrefillSide.on_layer`, per layer) and the simulator
(`pdserve.sim.kv_push`, over the link model) both take their range from `push_range`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PushRange:
    first: int  # block-table index of the first block sent
    full: int  # blocks [first, full) are complete
    partial: bool  # block `full` goes too, partly filled
    final: bool  # the prompt's last chunk
    next_block: int  # the first block not yet delivered in full, after this step

    @property
    def num_blocks(self) -> int:
        return max(self.full - self.first, 0) + self.partial

    @property
    def superseded(self) -> bool:
        """The partial block is sent again, complete, later: these bytes are never read."""
        return self.partial and not self.final


def push_range(next_block: int, end: int, num_tokens: int, block_size: int, scheduled: bool,
               cold: int = 0) -> PushRange:
    """`next_block`: the first block not yet delivered in full; `end`: tokens computed after this step, of
    `num_tokens`; `cold`: a long prompt's oldest blocks that already left the pool (sent when computed)."""
    first, full = max(next_block, cold), end // block_size
    final = end >= num_tokens
    partial = bool(end % block_size) and first <= full and (final or not scheduled)
    return PushRange(first, full, partial, final, max(next_block, full))
