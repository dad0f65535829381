"""`build_prompts`: exact-length token-id prompts for a workload, with the trace's prefix sharing made real.

The runner sends token ids through the completions API, so every prompt has exactly `input_len` ids by
construction (no tokenizer round trip that could change the length). Ids are drawn uniformly from `token_range`,
default `[100, vocab_size - 100)`, to stay clear of the special tokens at either end of most vocabularies.

* Requests with `hash_ids` (Mooncake): the prompt is the concatenation of blocks, block k being a pseudo-random
  block determined only by `(hash_ids[k], seed)`; equal hash ids therefore give identical token blocks, so the
  trace's shared prefixes are shared on the wire too. The block size is `max(1, round(block_tokens *
  length_scale))` with `length_scale` taken from `workload.description` (1.0 if absent): the loader scales the
  lengths but keeps the hash ids, so scaling the block the same way keeps about one block per hash id. The last
  block is truncated to make the length exact; if `input_len` exceeds `len(hash_ids) * block`, the rest is filled
  deterministically from `(seed, request index)`, so that tail is never shared.
* Requests without `hash_ids`: independent random ids seeded by `(seed, request index)`, so different requests
  differ from their first tokens on and there is no accidental prefix sharing.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from pdserve.errors import InvalidRequestError
from pdserve.workloads.spec import Workload

# First word of the numpy seed sequence: keeps the three kinds of stream independent for the same numbers.
_BLOCK, _FILL, _PLAIN = 0, 1, 2
SPECIAL_TOKEN_MARGIN = 100


def _token_range(vocab_size: int, token_range: tuple[int, int] | None) -> tuple[int, int]:
    if token_range is None:
        token_range = (SPECIAL_TOKEN_MARGIN, vocab_size - SPECIAL_TOKEN_MARGIN)
    lo, hi = token_range
    if not 0 <= lo < hi <= vocab_size:
        raise InvalidRequestError(f"token range [{lo}, {hi}) is empty or outside the vocabulary of {vocab_size} "
                                  "ids; pass token_range=(lo, hi)")
    return lo, hi


_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """splitmix64's finalizer on a Python int: a bijection of 64-bit values with good avalanche."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _mix64_array(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)  # uint64 arrays wrap mod 2**64
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _draw(key: tuple[int, ...], n: int, lo: int, hi: int) -> np.ndarray:
    """n ids in [lo, hi) determined by `key` alone: splitmix64 over a counter from a key-derived seed (a few
    microseconds per block, where a seeded numpy Generator costs ~25: a one-hour trace has 180k blocks)."""
    return _draw_many([key], n, lo, hi)[0]


def _draw_many(keys: list[tuple[int, ...]], n: int, lo: int, hi: int) -> np.ndarray:
    """`_draw(key, n, lo, hi)` for each key, as the rows of one array (one numpy pass for all of them)."""
    seeds = []
    for key in keys:
        seed = 0
        for part in key:
            seed = _mix64((seed * _GOLDEN + part + 1) & _MASK)
        seeds.append(seed)
    steps = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(_GOLDEN)
    counter = steps[None, :] + np.array(seeds, np.uint64)[:, None]
    return lo + (_mix64_array(counter) % np.uint64(hi - lo)).astype(np.int64)


def _hashed_prompt(index: int, input_len: int, hash_ids: tuple[int, ...], block: int, seed: int,
                   lo: int, hi: int, cache: dict[int, np.ndarray]) -> np.ndarray:
    """Blocks keyed by hash id (cached within one call), truncated or filled to exactly input_len."""
    used = hash_ids[:-(-input_len // block)]  # the blocks that reach into input_len
    new = [h for h in dict.fromkeys(used) if h not in cache]
    if new:  # the same values as _draw per block, in one pass
        cache.update(zip(new, _draw_many([(seed, _BLOCK, h) for h in new], block, lo, hi)))
    parts = [cache[h] for h in used]
    have = len(used) * block
    if have > input_len:
        parts[-1] = parts[-1][:block - (have - input_len)]
    elif have < input_len:
        parts.append(_draw((seed, _FILL, index), input_len - have, lo, hi))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def block_size(workload: Workload, block_tokens: int = 512) -> int:
    """Tokens per Mooncake hash block for this workload: block_tokens scaled by its length_scale."""
    return max(1, round(block_tokens * float(workload.description.get("length_scale", 1.0))))


def build_prompts(workload: Workload, vocab_size: int, *, block_tokens: int = 512,
                  token_range: tuple[int, int] | None = None, seed: int = 0) -> list[list[int]]:
    """One list of exactly `input_len` token ids per request, in the workload's order (see module docstring)."""
    return [p.tolist() for p in iter_prompt_arrays(workload, vocab_size, block_tokens=block_tokens,
                                                   token_range=token_range, seed=seed)]


def iter_prompt_arrays(workload: Workload, vocab_size: int, *, block_tokens: int = 512,
                       token_range: tuple[int, int] | None = None, seed: int = 0) -> Iterator[np.ndarray]:
    """The prompts of `build_prompts` as int64 arrays, one at a time (arguments checked now): for consumers
    that hold only the prompts in flight, such as the simulator replaying a long trace."""
    lo, hi = _token_range(vocab_size, token_range)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InvalidRequestError(f"seed must be a non-negative integer, got {seed!r}")
    if block_tokens < 1:
        raise InvalidRequestError(f"block_tokens must be >= 1, got {block_tokens}")
    return _prompt_arrays(workload, block_size(workload, block_tokens), seed, lo, hi)


def _prompt_arrays(workload: Workload, block: int, seed: int, lo: int, hi: int) -> Iterator[np.ndarray]:
    cache: dict[int, np.ndarray] = {}
    for i, req in enumerate(workload.requests):
        if req.hash_ids:
            yield _hashed_prompt(i, req.input_len, req.hash_ids, block, seed, lo, hi, cache)
        else:
            yield _draw((seed, _PLAIN, i), req.input_len, lo, hi)
