"""Moving whole KV blocks of one layer between the pool and the wire format of delivery.

Wire layout of a chunk: `[2 (k|v) * Hkv, count, block_size * head_dim]` in the pool's dtype, i.e. the pool
layer `[2, Hkv, num_blocks, block_size, D]` with only the chosen blocks kept, in the order given (under a KV
codec, D is a token record's bytes and the dtype uint8: coded blocks travel as they are, scales inside).

On a CPU pool, `block_pieces` names that payload as byte views straight into the pool (one per run of
consecutive blocks per k/v head row), so transports send from and receive into the pool without a staging
copy. Pools on other devices go through a host buffer with `gather_blocks` / `scatter_blocks`.
"""

from __future__ import annotations

import warnings

import torch

from pdserve.kv.transcode import recode as transcode_records


def chunk_nbytes(layer: torch.Tensor, count: int) -> int:
    two, num_kv, _, block_size, head_dim = layer.shape
    return two * num_kv * count * block_size * head_dim * layer.element_size()


def block_pieces(layer: torch.Tensor, block_ids: list[int]) -> list[memoryview]:
    """The chunk payload of `block_ids`, in wire order, as writable byte views into a CPU pool layer."""
    if layer.device.type != "cpu" or not layer.is_contiguous():
        raise ValueError("block_pieces needs a contiguous CPU pool layer; use gather_blocks/scatter_blocks")
    two, num_kv, num_blocks, block_size, head_dim = layer.shape
    flat = memoryview(layer.view(-1).view(torch.uint8).numpy())
    per_block = block_size * head_dim * layer.element_size()
    spans = runs(block_ids)
    pieces = []
    for row in range(two * num_kv):
        base = row * num_blocks
        pieces += [flat[(base + first) * per_block:(base + first + n) * per_block] for _, first, n in spans]
    return pieces


def _blocks_view(layer: torch.Tensor) -> torch.Tensor:
    two, num_kv, num_blocks, block_size, head_dim = layer.shape
    return layer.view(two * num_kv, num_blocks, block_size * head_dim)


def _buffer_tensor(buf, layer: torch.Tensor, count: int) -> torch.Tensor:
    two, num_kv, _, block_size, head_dim = layer.shape
    with warnings.catch_warnings():  # read-only receive buffers: we only read them
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buf, dtype=layer.dtype)
    return flat.view(two * num_kv, count, block_size * head_dim)


def runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ids: [(position in block_ids, first id, length)]. (On the delivery path,
    once per chunk on each side, right after a copy that evicted the interpreter's data from the caches:
    a plain index loop, no tuple rebuilt per id.)"""
    out: list[tuple[int, int, int]] = []
    n = len(block_ids)
    start = 0
    for i in range(1, n):
        if block_ids[i] != block_ids[i - 1] + 1:
            out.append((start, block_ids[start], i - start))
            start = i
    if n:
        out.append((start, block_ids[start], n - start))
    return out


# Above this many runs, one indexed copy beats a strided copy per run.
MAX_RUNS = 4


def gather_blocks(layer: torch.Tensor, block_ids: list[int], out) -> None:
    """Copy blocks `block_ids` of a pool layer into the writable buffer `out` (exactly `chunk_nbytes`)."""
    _copy_blocks(_blocks_view(layer), _buffer_tensor(out, layer, len(block_ids)), block_ids, to_pool=False)


def scatter_blocks(layer: torch.Tensor, block_ids: list[int], payload) -> None:
    """Write a chunk's payload into blocks `block_ids` of a pool layer."""
    _copy_blocks(_blocks_view(layer), _buffer_tensor(payload, layer, len(block_ids)), block_ids, to_pool=True)


def _copy_blocks(pool: torch.Tensor, wire: torch.Tensor, block_ids: list[int], to_pool: bool) -> None:
    """Consecutive block ids (the usual case: fresh allocations come off the free queue in order) are
    copied as strided slices, close to memcpy speed; scattered ids take one indexed copy."""
    spans = runs(block_ids)
    if len(spans) <= MAX_RUNS:
        for pos, first, n in spans:
            a, b = pool[:, first:first + n], wire[:, pos:pos + n]
            (a if to_pool else b).copy_(b if to_pool else a)
        return
    index = torch.tensor(block_ids, dtype=torch.long, device=pool.device)
    if to_pool:
        pool.index_copy_(1, index, wire.to(pool.device))
    elif pool.device.type == "cpu":
        torch.index_select(pool, 1, index, out=wire)
    else:
        wire.copy_(pool.index_select(1, index))


def mixed_pieces(layer: torch.Tensor, host: torch.Tensor, layer_index: int, targets: list) -> list[memoryview]:
    """The chunk payload's places in wire order when some of its blocks go to the host tier: `targets` is
    one ("host", slot) or ("device", block id) per block; `host` the host tier `[slots, layers, 2, Hkv, bs,
    D]`. One piece per k/v head row per block (CPU tensors)."""
    two, num_kv = layer.shape[:2]
    pieces = []
    for kv in range(two):
        for head in range(num_kv):
            for kind, i in targets:
                block = host[i, layer_index, kv, head] if kind == "host" else layer[kv, head, i]
                pieces.append(memoryview(block.reshape(-1).view(torch.uint8).numpy()))
    return pieces


def land_mixed(layer: torch.Tensor, host, layer_index: int, targets: list, payload) -> None:
    """A staged chunk payload (the pool's format, wire order) into `targets` as `mixed_pieces` names them, for a
    host tier (`pdserve.kv.host_store.HostKVStore`) of another codec: its blocks are transcoded on the way."""
    two, num_kv, _, block_size, width = layer.shape
    with warnings.catch_warnings():  # a read-only receive buffer: only read
        warnings.simplefilter("ignore", UserWarning)
        wire = torch.frombuffer(payload, dtype=layer.dtype).view(two, num_kv, len(targets), block_size, width)
    for j, (kind, i) in enumerate(targets):
        if kind == "host":
            host.data[i, layer_index] = transcode_records(wire[:, :, j], *host.recode)
        else:
            layer[:, :, i] = wire[:, :, j]
