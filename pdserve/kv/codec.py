"""KV codecs in torch: token records in and out of a coded KV pool (the reference the CPU kernels match).

A pool layer of codec `auto` is `[2, Hkv, num_blocks, block_size, D]` in the model dtype, as ever; of any
other codec `[2, Hkv, num_blocks, block_size, token_bytes]` uint8, one record per token and head: its codes
then its fp32 parameters (`pdserve.core.kvstore.kv_codecs`). Everything that moves whole blocks (delivery, the host
and disk tiers) moves these bytes as they are; only attention and the cache write look inside.

`encode(x [N, D] float) -> [N, token_bytes] uint8`; `decode(records [..., token_bytes]) -> [..., D] fp32`.
Rounding is round-half-to-even everywhere (torch.round, the fp8 cast, the kernels' nearbyintf).
"""

from __future__ import annotations

import torch

from pdserve.core.kvstore import kv_codecs

FP8_MAX = 448.0
FP16_MAX = 65504.0
HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


class KVCodec:
    """One codec for one head size; `storage` is the pool's dtype and `width` the pool's last dimension."""

    def __init__(self, name: str, head_dim: int, model_dtype: torch.dtype) -> None:
        self.name = kv_codecs.check(name)
        self.head_dim = head_dim
        self.model_dtype = model_dtype
        self.spec = kv_codecs.CODECS[name]
        self.coded = name != "auto"
        self.storage = torch.uint8 if self.coded else model_dtype
        self.token_bytes = kv_codecs.token_bytes(name, head_dim, model_dtype.itemsize)
        self.width = self.token_bytes if self.coded else head_dim
        self.code_bytes = head_dim * self.spec.bits // 8
        # int4 codes each token in a rotated basis (`rotation`, orthogonal and symmetric: its own inverse), which
        # spreads the few outlier channels of keys over all of them, so one scale per token fits every channel.
        self.rotation = _hadamard(head_dim) if name == "int4" else None
        self._rotations: dict[torch.device, torch.Tensor] = {}

    @property
    def format(self) -> str:
        """What a delivered chunk's header names its payload's format: the codec, or the dtype of `auto`."""
        return self.name if self.coded else str(self.storage).removeprefix("torch.")

    def __repr__(self) -> str:
        return f"KVCodec({self.name}, head_dim={self.head_dim})"

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[N, D] float -> [N, width] records in the pool's dtype."""
        if not self.coded:
            return x.to(self.storage)
        x = x.float()
        if self.rotation is not None:
            x = x @ self.rotation_on(x.device)
        if self.name in HALF:
            if self.name == "fp16":  # saturated, never inf
                x = x.clamp(-FP16_MAX, FP16_MAX)
            return x.to(HALF[self.name]).view(torch.uint8).view(x.shape[0], self.token_bytes)
        return self._encode_scaled(x)

    def _encode_scaled(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if self.name == "int4":  # two groups of D / 2 channels, each with an fp16 scale and minimum
            g = x.view(n, 2, -1)
            lo, hi = g.amin(dim=2, keepdim=True), g.amax(dim=2, keepdim=True)
            scale = _nonzero((hi - lo) / 15.0).half().float()
            lo = lo.half().float()
            q = torch.round((g - lo) / scale).clamp_(0, 15).to(torch.uint8).view(n, -1)
            codes = q[:, 0::2] | (q[:, 1::2] << 4)
            params = torch.cat([scale, lo], dim=2).half().view(n, -1)
        else:
            top = FP8_MAX if self.name == "fp8_e4m3" else 127.0
            scale = _nonzero(x.abs().amax(dim=1, keepdim=True) / top)
            if self.name == kv_codecs.BROKEN:  # test-only (`kv_codecs.TEST_CODEC_ENV`): clips, deliberately
                scale = scale / kv_codecs.BROKEN_SHRINK
            y = (x / scale).clamp_(-top, top)
            if self.name != "fp8_e4m3":
                codes = torch.round(y).to(torch.int8).view(torch.uint8)
            else:
                codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
            params = scale
        return torch.cat([codes, params.contiguous().view(torch.uint8).view(n, -1)], dim=1)

    def decode(self, records: torch.Tensor) -> torch.Tensor:
        """[..., width] records -> [..., D] fp32."""
        x = self._dequantize(records)
        return x if self.rotation is None else x @ self.rotation_on(x.device)

    def window_encode(self, x: torch.Tensor) -> torch.Tensor:
        """[N, D] float -> [N, D] fp16 rows of a residual window (`pdserve.kv.residual`), in the codec's basis
        (so the decode kernel reads them as it reads the records: rotated, for int4)."""
        x = x.float()
        return (x if self.rotation is None else x @ self.rotation_on(x.device)).half()

    def window_decode(self, rows: torch.Tensor) -> torch.Tensor:
        """[..., D] fp16 window rows -> [..., D] fp32 values."""
        x = rows.float()
        return x if self.rotation is None else x @ self.rotation_on(x.device)

    def kv_bytes_per_token(self, config) -> int:
        """K and V of one token over every layer and KV head of a model of `config`, in this codec."""
        return kv_codecs.kv_bytes_per_token(self.name, config.num_layers, config.num_kv_heads, config.head_dim,
                                            self.model_dtype.itemsize)

    def rotation_on(self, device: torch.device) -> torch.Tensor:
        """`rotation` on `device` (copied there once per device)."""
        if device not in self._rotations:
            self._rotations[device] = self.rotation.to(device)
        return self._rotations[device]

    def _dequantize(self, records: torch.Tensor) -> torch.Tensor:
        """[..., width] records -> [..., D] fp32 as coded (in the rotated basis, for int4)."""
        if not self.coded:
            return records.float()
        lead = records.shape[:-1]
        r = records.reshape(-1, self.token_bytes)
        if self.name in HALF:
            return r.contiguous().view(HALF[self.name]).float().view(*lead, self.head_dim)
        codes, params = r[:, :self.code_bytes].contiguous(), r[:, self.code_bytes:].contiguous()
        if self.name == "int4":
            q = torch.stack([codes & 15, codes >> 4], dim=2).reshape(-1, 2, self.head_dim // 2).float()
            p = params.view(torch.float16).float().view(-1, 2, 2)
            x = (q * p[:, :, 0:1] + p[:, :, 1:2]).view(-1, self.head_dim)
        else:
            kind = torch.float8_e4m3fn if self.name == "fp8_e4m3" else torch.int8
            x = codes.view(kind).float() * params.view(torch.float32)
        return x.view(*lead, self.head_dim)

    def transcode(self, records: torch.Tensor, into: "KVCodec") -> torch.Tensor:
        """[N, width] records of this codec -> [N, into.width] records of `into` (a delivery between workers
        whose codecs differ)."""
        return into.encode(self.decode(records))


def _hadamard(n: int) -> torch.Tensor:
    """The normalized Walsh-Hadamard matrix of order n (a power of 2), else a fixed random orthogonal
    symmetric one (a reflection): either way R = R^T = R^-1, the same on every worker."""
    if n & (n - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h / n ** 0.5
    u = torch.randn(n, 1, generator=torch.Generator().manual_seed(0))
    return torch.eye(n) - 2 * (u @ u.T) / (u.T @ u)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """A zero range (an all-equal row) codes as 0 with scale 1, so decode is exact and never divides by 0."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))
