"""Moving whole KV blocks of one layer between the pool and flat byte buffers (the wire format of delivery).

Wire layout of a chunk: `[2 (k|v) * Hkv, count, block_size * head_dim]` in the pool's dtype, i.e. the pool
layer `[2, Hkv, num_blocks, block_size, D]` with only the chosen blocks kept, in the order given.
"""

from __future__ import annotations

import warnings

import torch


def chunk_nbytes(layer: torch.Tensor, count: int) -> int:
    two, num_kv, _, block_size, head_dim = layer.shape
    return two * num_kv * count * block_size * head_dim * layer.element_size()


def _blocks_view(layer: torch.Tensor) -> torch.Tensor:
    two, num_kv, num_blocks, block_size, head_dim = layer.shape
    return layer.view(two * num_kv, num_blocks, block_size * head_dim)


def _buffer_tensor(buf, layer: torch.Tensor, count: int) -> torch.Tensor:
    two, num_kv, _, block_size, head_dim = layer.shape
    with warnings.catch_warnings():  # read-only receive buffers: we only read them
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buf, dtype=layer.dtype)
    return flat.view(two * num_kv, count, block_size * head_dim)


def gather_blocks(layer: torch.Tensor, block_ids: list[int], out) -> None:
    """Copy blocks `block_ids` of a pool layer into the writable buffer `out` (exactly `chunk_nbytes`)."""
    dst = _buffer_tensor(out, layer, len(block_ids))
    index = torch.tensor(block_ids, dtype=torch.long, device=layer.device)
    if layer.device.type == "cpu":
        torch.index_select(_blocks_view(layer), 1, index, out=dst)
    else:
        dst.copy_(_blocks_view(layer).index_select(1, index))


def scatter_blocks(layer: torch.Tensor, block_ids: list[int], payload) -> None:
    """Write a chunk's payload into blocks `block_ids` of a pool layer."""
    src = _buffer_tensor(payload, layer, len(block_ids)).to(layer.device)
    index = torch.tensor(block_ids, dtype=torch.long, device=layer.device)
    _blocks_view(layer).index_copy_(1, index, src)
