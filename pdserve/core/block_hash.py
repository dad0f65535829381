"""Chained content hashes of full KV blocks, the keys of the prefix cache.

A block's hash covers its parent's hash and its own tokens, so equal hashes mean equal whole prefixes, not
just equal blocks. xxh3-64 is fast enough to hash every block of every prompt on the scheduler's thread.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import NewType

import numpy as np
import xxhash

BlockHash = NewType("BlockHash", int)

# Root of every chain; any fixed value works, a non-zero one keeps "no parent" distinct from a parent of 0.
_ROOT = (0x9E3779B97F4A7C15).to_bytes(8, "little")


def _root(extra_key: bytes) -> int:
    return xxhash.xxh3_64_intdigest(_ROOT + extra_key)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_key: bytes = b"") -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block of a sequence).

    The parent's hash seeds the hash of the block's tokens, so the chain needs no concatenation. `extra_key`
    salts the root (e.g. a model or adapter id) so caches of different weights never mix.
    """
    seed = _root(extra_key) if parent is None else parent
    return BlockHash(xxhash.xxh3_64_intdigest(array("q", token_ids).tobytes(), seed))


def hash_blocks(token_ids: Sequence[int], block_size: int, parent: BlockHash | None = None,
                start_block: int = 0, extra_key: bytes = b"") -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block `start_block` on, chained from `parent`.

    Equal to calling `hash_block` block by block; the tokens are packed once and hashed in place.
    """
    num_full = len(token_ids) // block_size
    if start_block >= num_full:
        return []
    tokens = token_ids[start_block * block_size:num_full * block_size]
    # numpy arrays pack in place; lists fastest through array("q")
    data = memoryview(tokens.astype(np.int64).tobytes() if isinstance(tokens, np.ndarray)
                      else array("q", tokens).tobytes())
    stride = block_size * 8
    seed = _root(extra_key) if parent is None else parent
    hashes: list[BlockHash] = []
    digest, append = xxhash.xxh3_64_intdigest, hashes.append
    for off in range(0, len(data), stride):
        seed = digest(data[off:off + stride], seed)
        append(seed)  # (a BlockHash is an int: NewType costs a call per block at runtime)
    return hashes
