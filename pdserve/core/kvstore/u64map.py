"""`U64Map`: a map from 64-bit keys (block hashes) to non-negative ints (block ids, slots), with bulk calls.

The prefix cache and the tier indexes look up, insert and drop hundreds of block hashes per request and
step; one Python dict operation per block was most of a simulated cluster's time. `U64Map` keeps them in a
compiled open-addressing table (`native/kvcore.c`, a CPython extension type built at first use: a single
lookup costs what a dict's does) and answers whole arrays in one call. Where the module cannot be built or
loaded, `new_map` returns `DictMap`, the same contract over a dict, counted (`pdserve.core.kvstore.native`). Both
are tested against one contract. Values are >= 0: -1 means "absent" in bulk answers.
"""

from __future__ import annotations

import numpy as np

from pdserve.core.kvstore import native

MISSING = -1
_NO = object()


def new_map(hint: int = 0):  # -> U64Map (compiled) | DictMap: the same contract
    """A compiled `U64Map`, or (counted, `pdserve.core.kvstore.native.fallback`) a `DictMap` where it is unavailable."""
    if native.load() is not None:
        return _u64map_class()(hint)
    native.fallback()
    return DictMap(hint)


def _keys(keys) -> np.ndarray:
    """Keys as a contiguous 1-d uint64 array (sequences of ints, or arrays)."""
    if isinstance(keys, np.ndarray) and keys.dtype == np.uint64 and keys.flags.c_contiguous and keys.ndim == 1:
        return keys
    out = np.ascontiguousarray(keys if isinstance(keys, np.ndarray) else list(keys), np.uint64)
    if out.ndim != 1:
        raise ValueError(f"keys must be 1-d, got shape {out.shape}")
    return out


def _vals(vals, n: int) -> np.ndarray:
    out = np.ascontiguousarray(vals, np.int64)
    if out.shape != (n,):
        raise ValueError(f"{n} keys but {out.shape} values")
    return out


def _checked(vals: np.ndarray) -> np.ndarray:
    """(DictMap: the compiled map refuses negative values itself, where -1 and -2 mark free entries)"""
    if len(vals) and vals.min() < 0:
        raise ValueError("U64Map values are >= 0")
    return vals


_U64Map: type | None = None


def _u64map_class() -> type:
    """`U64Map`: the compiled type with the bulk calls' array handling (made once the type is loaded)."""
    global _U64Map
    if _U64Map is None:
        class U64Map(native.load().Map):
            """uint64 key -> int >= 0 in the compiled table. Dict-like for single keys (as fast as a dict);
            bulk calls take arrays (or sequences) of keys."""

            __slots__ = ()

            def get_many(self, keys) -> np.ndarray:
                """The value of each key, -1 where absent."""
                k = _keys(keys)
                out = np.empty(len(k), np.int64)
                self._get_many(k, out, MISSING)
                return out

            def prefix_len(self, keys) -> int:
                """How many of `keys` are present before the first absent one."""
                return self._prefix_len(_keys(keys))

            def put_many(self, keys, values) -> int:
                """Set each key (later repeats win); how many keys were new."""
                k = _keys(keys)
                return self._put(k, _vals(values, len(k)), None, False)

            def put_new(self, keys, values) -> np.ndarray:
                """Insert the keys not present (the first of repeats wins); a mask of those inserted."""
                k = _keys(keys)
                inserted = np.empty(len(k), np.bool_)
                self._put(k, _vals(values, len(k)), inserted, True)
                return inserted

            def del_many(self, keys, only_if=None) -> np.ndarray:
                """Remove each key (with `only_if`: only where its value is only_if[j]); the values removed,
                -1 where nothing was."""
                k = _keys(keys)
                out = np.empty(len(k), np.int64)
                self._del_many(k, None if only_if is None else _vals(only_if, len(k)), out, MISSING)
                return out

            def items(self) -> tuple[np.ndarray, np.ndarray]:
                """(keys, values) of every entry, in no particular order."""
                keys, vals = np.empty(len(self), np.uint64), np.empty(len(self), np.int64)
                self._items(keys, vals)
                return keys, vals

            def keys(self) -> np.ndarray:
                return self.items()[0]

            def values(self) -> np.ndarray:
                return self.items()[1]

        _U64Map = U64Map
    return _U64Map


class DictMap:
    """`U64Map`'s contract over a Python dict: the counted fallback where the compiled map is unavailable."""

    __slots__ = ("_d",)

    def __init__(self, hint: int = 0) -> None:
        self._d: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: int) -> bool:
        return key in self._d

    def get(self, key: int, default=None):
        return self._d.get(key, default)

    def __getitem__(self, key: int) -> int:
        return self._d[key]

    def __setitem__(self, key: int, value: int) -> None:
        if not 0 <= key < 1 << 64:
            raise OverflowError("U64Map keys are ints in [0, 2**64)")
        if value < 0:
            raise ValueError("U64Map values are >= 0")
        self._d[int(key)] = int(value)

    def pop(self, key: int, default=_NO):
        return self._d.pop(key) if default is _NO else self._d.pop(key, default)

    def __delitem__(self, key: int) -> None:
        del self._d[key]

    def get_many(self, keys) -> np.ndarray:
        k = _keys(keys).tolist()
        return np.fromiter(map(self._d.get, k, [MISSING] * len(k)), np.int64, len(k))

    def prefix_len(self, keys) -> int:
        n = 0
        for key in _keys(keys).tolist():
            if key not in self._d:
                break
            n += 1
        return n

    def put_many(self, keys, values) -> int:
        k = _keys(keys).tolist()
        v = _checked(_vals(values, len(k)))
        before = len(self._d)
        self._d.update(zip(k, v.tolist()))
        return len(self._d) - before

    def put_new(self, keys, values) -> np.ndarray:
        k = _keys(keys).tolist()
        v = _checked(_vals(values, len(k)))
        inserted = np.zeros(len(k), np.bool_)
        d = self._d
        for j, (key, val) in enumerate(zip(k, v.tolist())):
            if key not in d:
                d[key] = val
                inserted[j] = True
        return inserted

    def del_many(self, keys, only_if=None) -> np.ndarray:
        k = _keys(keys).tolist()
        cond = None if only_if is None else _vals(only_if, len(k)).tolist()
        out = np.full(len(k), MISSING, np.int64)
        d = self._d
        for j, key in enumerate(k):
            val = d.get(key)
            if val is not None and (cond is None or val == cond[j]):
                del d[key]
                out[j] = val
        return out

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        n = len(self._d)
        return (np.fromiter(self._d.keys(), np.uint64, n), np.fromiter(self._d.values(), np.int64, n))

    def keys(self) -> np.ndarray:
        return self.items()[0]

    def values(self) -> np.ndarray:
        return self.items()[1]

    def clear(self) -> None:
        self._d.clear()

