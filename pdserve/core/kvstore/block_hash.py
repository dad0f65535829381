"""Chained content hashes of full KV blocks, the keys of the prefix cache.

A block's hash covers its parent's hash and its own tokens, so equal hashes mean equal whole prefixes, not
just equal blocks. xxh3-64 is fast enough to hash every block of every prompt on the scheduler's thread; a
run of blocks is hashed in one compiled call (`pdserve/core/kvstore/native/hash_chain.h`, the xxhash package's own xxh3).
"""

from __future__ import annotations

import ctypes
import logging
from array import array
from collections.abc import Callable, Sequence
from typing import NewType

import numpy as np
import xxhash

from pdserve.core.kvstore import native

log = logging.getLogger(__name__)

BlockHash = NewType("BlockHash", int)

# Root of every chain; any fixed value works, a non-zero one keeps "no parent" distinct from a parent of 0.
_ROOT = (0x9E3779B97F4A7C15).to_bytes(8, "little")


COMPILED_FROM = 4  # blocks: a shorter run is hashed in Python (the compiled call's set-up costs as much)
_chain: Callable | None | bool = None  # the compiled chain once looked up, False where it is unavailable


def _compiled_chain() -> Callable | None:
    """`kvcore`'s hash_chain bound to the xxhash package's own xxh3 (checked against it once), or None (the
    Python loop: counted, `pdserve.core.kvstore.native.fallback`, and logged once)."""
    global _chain
    if _chain is None:
        _chain, module = False, native.load()
        try:
            if module is None:
                raise RuntimeError(native.fallback_reason())
            import xxhash._xxhash as lib  # noqa: PLC0415 - its shared object exports the xxh3 functions
            fn = ctypes.CDLL(lib.__file__).XXH3_64bits_withSeed
            module.set_xxh3(ctypes.cast(fn, ctypes.c_void_p).value)
            probe, out = np.arange(64, dtype=np.int64).tobytes(), np.empty(4, np.uint64)
            module.hash_chain(probe, 128, 7, out)
            want = [7]
            for k in range(4):
                want.append(xxhash.xxh3_64_intdigest(probe[k * 128:(k + 1) * 128], want[-1]))
            if out.tolist() != want[1:]:
                raise RuntimeError("the compiled chain disagrees with xxhash")
            _chain = module.hash_chain
        except Exception as e:  # noqa: BLE001 - any failure means the Python loop, counted
            native.fallback()
            log.warning("compiled block hashing unavailable, hashing in Python (slower): %s", e)
    return _chain or None


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
    out = _hashes(token_ids, block_size, parent, start_block, extra_key)
    return out.tolist() if isinstance(out, np.ndarray) else out


def hash_blocks_array(token_ids: Sequence[int], block_size: int, parent: BlockHash | None = None,
                      start_block: int = 0, extra_key: bytes = b"") -> np.ndarray:
    """`hash_blocks` as a uint64 array (what the compiled chain writes: no list made)."""
    out = _hashes(token_ids, block_size, parent, start_block, extra_key)
    return out if isinstance(out, np.ndarray) else np.array(out, np.uint64)


def _hashes(token_ids, block_size: int, parent, start_block: int, extra_key: bytes) -> np.ndarray | list:
    num_full = len(token_ids) // block_size
    if start_block >= num_full:
        return []
    tokens = token_ids[start_block * block_size:num_full * block_size]
    # numpy arrays and int64 arrays pack in place; lists fastest through array("q")
    if isinstance(tokens, np.ndarray):
        raw = tokens.astype(np.int64).tobytes()
    else:
        raw = (tokens if isinstance(tokens, array) and tokens.typecode == "q" else array("q", tokens)).tobytes()
    seed = _root(extra_key) if parent is None else parent
    if num_full - start_block == 1:  # a decode step's block
        return [xxhash.xxh3_64_intdigest(raw, seed)]
    data = memoryview(raw)
    stride = block_size * 8
    chain = _compiled_chain() if num_full - start_block >= COMPILED_FROM else None
    if chain is not None:
        out = np.empty(num_full - start_block, np.uint64)
        chain(data, stride, seed, out)
        return out
    hashes: list[BlockHash] = []
    digest, append = xxhash.xxh3_64_intdigest, hashes.append
    for off in range(0, len(data), stride):
        seed = digest(data[off:off + stride], seed)
        append(seed)  # (a BlockHash is an int: NewType costs a call per block at runtime)
    return hashes
