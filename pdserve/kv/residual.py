"""The residual window of a coded KV pool (`int4`): each running sequence's last, partly filled block, in fp16.

The pool holds every token as a coded record, as for any codec, so a block is self-describing and can be
delivered, offloaded or shared at any time. Besides, a worker keeps the tokens it computed of each sequence's
current block in a window slot (fp16, in the codec's basis: rotated for int4), and attention reads a key and
its value from there while the key is in the same block as the query (KIVI's full-precision recent window,
one block wide). Once the block is full the sequence moves on to the next and the full block is read through
the codec, as the cache holds it. A prompt's prefill sees the same: each of its tokens reads the earlier
tokens of its own block exactly, as the token would have if it had been decoded, so prefill and decode agree.

A window covers only what this worker computed: tokens of the block that were delivered to it, loaded from a
tier or computed before a preemption are read through the codec (`exact_from` says where the exact ones
begin). Slots are reused least recently used first; a sequence whose slot was taken (more sequences than
slots: counted in `evictions`) simply starts a new window at its next token.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkWindow:
    """Where one scheduled chunk's residual window is: its slot, and the first position of the chunk's last
    block that attention reads exactly (the tokens before it in that block are read through the codec)."""
    slot: int
    exact_from: int


@dataclass
class _Held:
    slot: int
    block: int  # the sequence's block (position // block_size) the slot holds
    lo: int  # positions [lo, hi) of that block are in the slot
    hi: int


class ResidualWindow:
    """`layers[i]`: layer i's window, `[2 (k|v), Hkv, slots, block_size, D]` fp16."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, slots: int,
                 device: torch.device) -> None:
        self.block_size, self.slots = block_size, slots
        self.data = torch.zeros(num_layers, 2, num_kv_heads, slots, block_size, head_dim, dtype=torch.float16,
                                device=device)
        self.layers = list(self.data.unbind(0))
        self._held: OrderedDict[str, _Held] = OrderedDict()  # least recently computed first
        self._free = list(range(slots - 1, -1, -1))
        self.evictions = 0

    def release(self, request_ids) -> None:
        """Frees the slots of requests that ended or were preempted."""
        for request_id in request_ids:
            held = self._held.pop(request_id, None)
            if held is not None:
                self._free.append(held.slot)

    def plan(self, chunks) -> list[ChunkWindow]:
        """One step's chunks (`ScheduledChunk`s, each of a different request) -> their windows, after which the
        slots hold (once the step has written them) the tokens of each chunk's last block it computed."""
        if len(chunks) > self.slots:
            raise ValueError(f"{len(chunks)} sequences in one step but {self.slots} residual window slots")
        bs, planned = self.block_size, []
        for c in chunks:
            held = self._held.pop(c.request_id, None)
            end = c.start_pos + c.num_tokens
            continues = held is not None and held.hi == c.start_pos and held.block == c.start_pos // bs
            exact_from = held.lo if continues else c.start_pos
            slot = held.slot if held is not None else self._take()
            last = (end - 1) // bs
            self._held[c.request_id] = _Held(slot, last, max(exact_from, last * bs), end)
            planned.append(ChunkWindow(slot, exact_from))
        return planned

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        self.evictions += 1  # the least recently computed sequence (not one of this step's: those are newer)
        _, held = self._held.popitem(last=False)
        return held.slot
