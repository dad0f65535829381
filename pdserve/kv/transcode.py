"""Delivery between workers whose KV codecs differ: the receiver stages a chunk in the sender's format
(named by the chunk header's `kv`), then decodes and re-encodes it token record by token record into its own
(a prefill worker computing in `auto` under a decode worker that keeps `int8`, say). Records keep the wire
order `[2 * Hkv, count, block_size]`, so the transcoded payload lands where an untranscoded one would."""

from __future__ import annotations

import warnings

import torch

from pdserve.core.kvstore.kv_codecs import CODECS
from pdserve.kv.codec import KVCodec


def codec_of(fmt: object, own: KVCodec) -> KVCodec | None:
    """The codec a header's `kv` names (for a model of `own`'s head size), or None when it names none."""
    if not isinstance(fmt, str):
        return None
    if fmt in CODECS and fmt != "auto":
        return KVCodec(fmt, own.head_dim, own.model_dtype)
    dtype = getattr(torch, fmt, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return None
    return KVCodec("auto", own.head_dim, dtype)


def payload_nbytes(codec: KVCodec, num_kv_heads: int, block_size: int, count: int) -> int:
    return 2 * num_kv_heads * count * block_size * codec.token_bytes


def transcode(payload, src: KVCodec, dst: KVCodec) -> memoryview:
    """A chunk payload in `src`'s records -> the same tokens in `dst`'s records (bytes in wire order)."""
    with warnings.catch_warnings():  # a read-only receive buffer: only read
        warnings.simplefilter("ignore", UserWarning)
        records = torch.frombuffer(payload, dtype=src.storage).view(-1, src.width)
    out = src.transcode(records, dst).contiguous()
    return memoryview(out.view(-1).view(torch.uint8).numpy())


def recode(records: torch.Tensor, src: KVCodec, dst: KVCodec) -> torch.Tensor:
    """Token records `[..., src.width]` of `src` -> the same tokens `[..., dst.width]` in `dst` (a block copied
    into or out of a storage tier of another codec than the pool's: `pdserve.kv.host_store`)."""
    lead = records.shape[:-1]
    return src.transcode(records.reshape(-1, src.width), dst).view(*lead, dst.width)
