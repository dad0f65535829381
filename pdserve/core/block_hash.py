"""Chained content hashes of full KV blocks, the keys of the prefix cache.

A block's hash covers its parent's hash and its own tokens, so equal hashes mean equal whole prefixes, not
just equal blocks. xxh3-64 is fast enough to hash every block of every prompt on the scheduler's thread.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import NewType

import xxhash

BlockHash = NewType("BlockHash", int)

# Root of every chain; any fixed value works, a non-zero one keeps "no parent" distinct from a parent of 0.
_ROOT = (0x9E3779B97F4A7C15).to_bytes(8, "little")


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_key: bytes = b"") -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block of a sequence).

    `extra_key` salts the chain (e.g. a model or adapter id) so caches of different weights never mix.
    """
    h = xxhash.xxh3_64()
    h.update(_ROOT if parent is None else parent.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra_key:
        h.update(extra_key)
    return BlockHash(h.intdigest())


def hash_blocks(token_ids: Sequence[int], block_size: int, parent: BlockHash | None = None,
                start_block: int = 0, extra_key: bytes = b"") -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block `start_block` on, chained from `parent`."""
    hashes: list[BlockHash] = []
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra_key)
        hashes.append(parent)
    return hashes
