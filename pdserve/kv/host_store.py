"""The host-memory KV tier's bytes: one tensor `[num_slots, num_layers, 2, Hkv, block_size, D]` (the last
dimension a token record's bytes, uint8, under a KV codec: coded blocks are kept as the pool holds them).

Block-major, so one slot is one contiguous record of every layer (what a disk file holds, written and
read in one call). Device pool layers are `[2, Hkv, num_blocks, block_size, D]`; copies between the two
move a batch of blocks with one indexed copy per layer. On CUDA the tensor is pinned host memory; on CPU
an anonymous mapping (huge pages where available) whose pages cost nothing until a slot is first written,
so `--kv-host-gb` is a bound, not an up-front allocation.

A tier of another codec than the pool's (`--kv-host-cache-dtype`; `recode` = (pool codec, tier codec)) holds
the blocks transcoded into its own: encoded on their way down (on the pool's device, before the copy), decoded
back into the pool's codec on their way up (after it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pdserve.kv.transcode import recode as transcode_records
from pdserve.model.hugepages import lazy_zeros


class HostKVStore:
    def __init__(self, num_slots: int, num_layers: int, num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, pin: bool = False, recode: tuple | None = None) -> None:
        shape = (num_slots, num_layers, 2, num_kv_heads, block_size, head_dim)
        if pin:  # CUDA: page-locked, so copies to the device run at full speed (allocated up front)
            self.data = torch.zeros(shape, dtype=dtype, pin_memory=True)
        else:  # an anonymous mapping: a slot's pages cost memory only once a block is written there
            self.data = lazy_zeros(math.prod(shape), dtype).view(shape)
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.recode = recode  # (pool KVCodec, this tier's KVCodec) when they differ
        self.codec = None if recode is None else recode[1]  # its blocks' codec when not the pool's

    @property
    def slot_nbytes(self) -> int:
        return self.data[0].numel() * self.data.element_size()

    def slot_bytes(self, slot: int) -> memoryview:
        """Writable bytes of one slot (a contiguous record of every layer)."""
        return memoryview(self.data[slot].view(-1).view(torch.uint8).numpy())

    def store(self, device_layers: Sequence[torch.Tensor], block_ids: Sequence[int], slots: Sequence[int]) -> None:
        """Device blocks -> host slots, every layer."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=device_layers[0].device)
        dst = torch.tensor(slots, dtype=torch.long)
        for layer, dev in enumerate(device_layers):
            blocks = dev.index_select(2, ids)
            if self.recode is not None:
                blocks = transcode_records(blocks, *self.recode)
            self.data[dst, layer] = blocks.permute(2, 0, 1, 3, 4).to("cpu", non_blocking=False)

    def load(self, device_layers: Sequence[torch.Tensor], slots: Sequence[int], block_ids: Sequence[int],
             layers: range | None = None) -> None:
        """Host slots -> device blocks (every layer, or the `layers` given)."""
        if not slots:
            return
        device = device_layers[0].device
        src = torch.tensor(slots, dtype=torch.long)
        ids = torch.tensor(block_ids, dtype=torch.long, device=device)
        for layer in layers or range(len(device_layers)):
            blocks = self.data[src, layer].permute(1, 2, 0, 3, 4).to(device)
            if self.recode is not None:
                blocks = transcode_records(blocks, self.recode[1], self.recode[0])
            device_layers[layer].index_copy_(2, ids, blocks)
