"""The KV store's books: paged blocks and their prefix hashes, holds and pins, the device/host/disk tiers and
their index, per-block metadata and its columns, codecs, eviction order (compiled in `native`, counted numpy
fallback otherwise)."""
