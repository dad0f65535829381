"""KV cache codecs by name: how many bytes one token of one KV head takes in each (torch-free; the real
worker's `pdserve.kv.codec` and the simulator both size pools, links and tiers from here).

A coded KV block is self-describing: each token's record holds its codes followed by its own parameters,
so a block carries its scales wherever it goes (the pool, the wire, the host and disk tiers):

- `fp16`, `bf16`: the value itself, 2 bytes per element, no parameters.
- `fp8_e4m3`: e4m3 codes of value / scale, then the scale (fp32, absmax / 448) of the token and head.
- `int8`: symmetric codes round(value / scale) in [-127, 127], then the scale (fp32, absmax / 127).
- `int4`: the token rotated by a Hadamard matrix (spreading the outlier channels of keys), then two groups of
  D / 2 channels, each coded asymmetrically in 16 levels with an fp16 scale and minimum; two codes per byte.
- `auto`: the model's dtype, unencoded (float32 on CPU, bfloat16 on CUDA): today's pools.

A codec with a **residual window** (`int4`) also keeps, per running sequence, the tokens of its last, partly
filled block in fp16 (`pdserve.kv.residual`): attention reads a token exactly while it is in the same block as
the query, and through the codec once that block is full (KIVI's full-precision recent window, one block wide;
the block's records are written as ever, so every block stays self-describing and movable). That window's
memory comes out of the same KV budget: `residual_bytes_per_seq` per sequence the worker may run at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pdserve.errors import InvalidRequestError


@dataclass(frozen=True)
class CodecSpec:
    name: str
    bits: int  # per element; 0 for auto (the model dtype's)
    param_bytes: int  # parameters per token and head (scales, minima)
    dequant_overhead: float  # decoding the codes, as a share of the time attention takes to read their bytes
    residual: bool = False  # keeps each sequence's last block in fp16 besides (see the module's doc)


CODECS: dict[str, CodecSpec] = {s.name: s for s in (
    CodecSpec("auto", 0, 0, 0.0),
    CodecSpec("fp16", 16, 0, 0.0),
    CodecSpec("bf16", 16, 0, 0.0),
    CodecSpec("fp8_e4m3", 8, 4, 0.05),  # a scale multiply per token (the cast is native on Hopper)
    CodecSpec("int8", 8, 4, 0.05),
    CodecSpec("int4", 4, 8, 0.15, residual=True),  # unpacking two codes per byte, then a multiply-add
)}

# TEST ONLY: with this environment variable set, `broken_int8` is a codec too: int8 whose scale is a sixteenth of
# the right one, so every value past 1/16 of its token's absmax is clipped. It exists so tests can show that the
# KV codec gate (`pdserve.engine.codec_gate`) refuses a codec that ruins the model; never set it in a deployment.
TEST_CODEC_ENV = "PDSERVE_TEST_BROKEN_KV_CODEC"
BROKEN = "broken_int8"
BROKEN_SHRINK = 16.0  # its scale is the right one / this
if os.environ.get(TEST_CODEC_ENV) == "1":
    CODECS[BROKEN] = CodecSpec(BROKEN, 8, 4, 0.05)


def check(name: str, param: str = "kv_cache_dtype") -> str:
    """`name` if it names a codec, else a one-line error listing the ones there are."""
    if name not in CODECS:
        raise InvalidRequestError(f"unknown {param} {name!r}; choose from {', '.join(CODECS)}", param=param)
    return name


def token_bytes(name: str, head_dim: int, model_dtype_bytes: int) -> int:
    """Bytes of one token of one KV head (its K or its V) in codec `name`."""
    spec = CODECS[check(name)]
    if spec.bits == 0:
        return head_dim * model_dtype_bytes
    if name == "int4" and head_dim % 4:
        raise InvalidRequestError(f"kv_cache_dtype int4 needs a head size divisible by 4, got {head_dim}",
                                  param="kv_cache_dtype")
    return head_dim * spec.bits // 8 + spec.param_bytes


def kv_bytes_per_token(name: str, num_layers: int, num_kv_heads: int, head_dim: int,
                       model_dtype_bytes: int) -> int:
    """K and V of one token over every layer and KV head."""
    return 2 * num_layers * num_kv_heads * token_bytes(name, head_dim, model_dtype_bytes)


def tier_codecs(pool: str, host: str | None, disk: str | None) -> tuple[str, str]:
    """The codecs of the host and disk tiers (`--kv-host-cache-dtype`, `--kv-disk-cache-dtype`): each its own
    setting, else the tier above's (the host's: the pool's; the disk's: the host's), so without either every
    tier holds the pool's blocks as they are. A tier of another codec than the one above it is written
    transcoded, and decoded back into the pool's codec on load."""
    host = pool if host is None else check(host, "kv_host_cache_dtype")
    return host, host if disk is None else check(disk, "kv_disk_cache_dtype")


def tier_blocks(gib: float, block_bytes: int) -> int:
    """Blocks of `block_bytes` (a block in the tier's own codec, plus any per-block header) that a tier of
    `gib` GiB holds: at least one. The real worker and the simulator both size their tiers here."""
    return max(int(gib * 2**30) // block_bytes, 1)


RESIDUAL_ELEMENT_BYTES = 2  # fp16


def residual_bytes_per_seq(name: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """The residual window of one sequence (K and V of one block, every layer and KV head, fp16); 0 for a codec
    without one."""
    if not CODECS[check(name)].residual:
        return 0
    return 2 * num_layers * num_kv_heads * block_size * head_dim * RESIDUAL_ELEMENT_BYTES
