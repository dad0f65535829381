"""Quantized linear-layer weights (`--weights q8_0 | q4 | auto`): blocks of 32 weights along the input dimension,
each with an fp16 scale (and for Q4_1 an fp16 minimum), multiplied by the compiled kernels of `kernels/qgemm.c`.

- `QBlocks`: one weight's blocks, unpacked ([n, k / 32, 32] values, [n, k / 32] scales) and `dequantize()`,
  the torch reference the kernels are tested against.
- Where the blocks come from (`QuantLoader`): a GGUF file's own blocks where it has the kind asked for (q4:
  Q4_0 / Q4_1, kept exactly as the file has them; a Q8_0 tensor, such as the default model's tied embedding /
  lm_head, is kept as Q8_0 too rather than lose bits; q8_0: Q8_0), else requantized at load from the fp32
  weights (ggml's reference rounding: Q8_0 d = max|w| / 127; Q4_1 d = (max - min) / 15, m = min).
- `QuantLinear`: `Linear`'s interface on the packed blocks. Few rows (decode) run the kernel, which reads the
  blocks (1.06 bytes per weight for Q8_0, 0.625 for Q4, against 4 in fp32); more rows (prefill) dequantize
  the weight for the call and run torch's `F.linear`: in bf16 where the CPU multiplies bf16 natively and fast (AMX,
  AVX512-BF16 on AMD: `BF16_ROWS`), else in fp32 (`linear.large`); counted per path in `kernels.paths_used()["gemm"]`.
The embedding table stays fp32 (a lookup reads a few rows). CPU and fp32 activations only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pdserve.errors import UnsupportedModelError
from pdserve.model import kernels, linear

log = logging.getLogger(__name__)

QK, QW = 32, 16  # weights per block (along k); output columns per packed panel
KINDS = {"q8_0": 1, "q4_1": 2}  # block kinds -> the kernel's format ids
# Row counts the kernel serves, per instruction set (Q8_0's int8 rows reach further where `I8_ROWS` says); more
# rows dequantize and run F.linear. Measured with
# bench_gemm.py --quant (the default model's 120 per-layer products, 2 threads, Intel Xeon AVX-512, 2026-12-07):
# the AVX-512 kernel beats dequantize + F.linear up to 128 rows (q8_0 127 vs 144 ms), ties at 256, loses at 512
# (524 vs 421 ms); the AVX2 build (-mno-avx512f, same host) was measured clean only up to 16 rows (q8_0 30 vs
# 66 ms), so it keeps the fp32 kernel's safe 32.
KERNEL_ROWS = {"avx512": 128, "avx2": 32}
# Row counts (inclusive) at which Q8_0 weights multiply rows quantized to int8 per block of 32 (qgemm.c's
# FMT_Q8_0_I8: VNNI integer dot products, as llama.cpp's Q8_0 x Q8_0; not bit-identical to fp32 rows, quality
# measured: issue 43 in docs/benchmarks.md), per instruction set of that kernel (`kernels.qgemm_i8_isa()`); other
# row counts, and hosts without VNNI (a decision), run the fp32-row kernel. Measured on the default model's 120
# per-layer products (Intel Xeon, 1 thread, host load ~7, medians of 10, 2026-12-07; scratch script in the issue-43
# helper report, rows 1-128): AVX-512 int8 rows vs fp32 rows 1.13x faster at 16 rows, 1.25x at 32-64, 1.29x at 128,
# even or noise at 1-12; AVX2 build (-mno-avx512f, AVX-VNNI) 1.37x at 8, 1.40x at 16, 1.47x at 32, 0.92x at 1.
# AMD EPYC Zen 4 (AVX512-VNNI, no AVX-VNNI; `bench_gemm.py --quant`, 2 threads, medians of 7-9, load < 1,
# 2026-12-07; ms for the 120 products, int8 rows vs fp32 rows): 1-3 rows even (4.7-5.6 vs 5.0-5.4), 4 rows 5.3 vs
# 6.1, 8 rows 6.2 vs 10.2, 16 rows 8.9 vs 19.8, 64 rows 40 vs 77. Since the rows are quantized 16 lanes at a time
# (`bench_gemm.py --quant --rows 64 96 128 256 --repeats 5` and `--rows 512 2048 --repeats 3`, quiet, 2026-12-07
# ~23:58-00:02; int8 rows vs bf16 vs fp32 rows, ms): 64 rows 32 / 104 / 81, 128 rows 63 / 142 / 160, 256 rows 128 / 228
# / 324, 512 rows 293 / 393 / 670, 2048 rows 1,119 / 1,267 / 2,904 (oneDNN fp32 2,283): int8 rows at every count
# from 4, prefill included (`ANY_ROWS`), so no bf16 rule for Q8_0 there. Keyed by `kernels.host_kind`.
ANY_ROWS = 1 << 20  # a rule's "and up"
I8_ROWS = {"avx512": (16, 128), "avx2": (8, 32), "avx512_amd": (4, ANY_ROWS)}
# Row counts from which quantized weights multiply in bf16, per how the CPU multiplies bf16 (`kernels.bf16_isa()`):
# the weight dequantized per call into a reused bf16 scratch (qgemm.c pd_qdequant_bf16t: the fp32 weight rounded
# to nearest even, ~0.5 ms for a layer's 3.5 M weights on 2 threads), the rows rounded to bf16, torch's bf16
# F.linear (oneDNN, on AMX tiles here), the output back in fp32. Fewer rows run the kernels (KERNEL_ROWS); a CPU
# without native bf16 keeps fp32 F.linear past KERNEL_ROWS (a decision). fp32 weights never take it. Measured on
# one layer's four products of the default model (960x576, 576x576, 3072x576, 576x1536), 2 threads, Intel Xeon
# AMX, load 0.4-1.5, medians of 11, 2026-12-07 (ms per layer, q8_0 int8-row kernel / q4 kernel / bf16 / fp32
# dequantize + F.linear): 64 rows 1.8 / 2.2 / 2.2 / 4.6, 96 rows 2.6-2.9 / 3.3-3.4 / 2.3-2.6 / 4.7,
# 128 rows 3.6-3.8 / 4.4 / 2.6-2.7 / 6.0, 256 rows 7.6-8.1 / 9.0-9.5 / 3.2-4.1 / 9.5, 512 rows 16.3 / - / 5.4-6.1 /
# 16.8; bf16's floor is ~1.8 ms (dequantize + oneDNN's call) up to 48 rows, where the kernels take 0.6-1.5. On one
# thread (CPU ms per layer, thread_time, medians of 5, load ~4, 17:02): q8_0 int8 rows / bf16 48 rows 2.5 / 2.9,
# 64 rows 3.4 / 3.2, 96 rows 5.3 / 3.8, 128 rows 7.5 / 4.2, 2048 rows (fp32 rows) 175 / 27 (fp32 F.linear 102); so
# 96, the first count where bf16 wins on one and two threads. The same host with oneDNN capped at AVX512-BF16
# (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16: vdpbf16ps, no AMX), one thread, q4: bf16 slower than fp32 F.linear at every
# count (64 rows 7.3 vs 6.9, 256 rows 24 vs 17, 2048 rows 163 vs 103). A real AVX512-BF16 CPU without AMX (AMD EPYC
# Zen 4, 2 threads, the same four products, medians of 9, load ~2-3, 2026-12-07; ms per layer, q8_0 int8-row /
# q4 kernel / bf16 / fp32 dequantize + oneDNN / + F.linear): 64 rows 1.8 / 2.6 / 2.6 / 4.4 / 5.1, 96 rows 2.6 / 3.9 /
# 3.4 / 5.5 / 6.7, 128 rows 3.1 / 5.2 / 3.8 / 6.6 / 7.5, 256 rows (q8_0 fp32 rows) 11.6 / 10.3 / 6.8 / 11.4 / 14.5,
# 2048 rows 86 / 85 / 42 / 72 / 85: bf16 from 96 rows for q4 (`bench_gemm.py --quant`, 2026-12-07 ~23:58, the 120 products:
# q4 kernel vs bf16 96 rows 116 vs 117 ms, 128 rows 156 vs 142, 2048 rows 3,041 vs 1,283); q8_0 never (int8 rows win
# at every count there, `I8_ROWS`). Keyed by `kernels.host_kind(bf16_isa)`: AVX512-BF16 on AMD only (on Intel's,
# above, it lost to fp32).
BF16_ROWS = {"amx": {"q8_0": 96, "q4_1": 96}, "avx512_bf16_amd": {"q4_1": 96}}
# What `--weights auto` picks per instruction set: the format measured fastest within the quality bounds
# (BENCHMARKS.md "Quantized weights": q8_0's kernel is the fastest at 1 row on both builds, 8.3 vs 10.3 ms for
# q4 and 18.4 for fp32; perplexity -0.2% against fp32 on the default model).
AUTO = {"avx512": "q8_0", "avx2": "q8_0", "none": "fp32"}


@dataclass
class QBlocks:
    """A [n, k] weight as blocks of QK along k: q [n, k / QK, QK] (int8 for q8_0, uint8 0..15 for q4_1), d and
    m [n, k / QK] fp16 (m: q4_1 only). w = d * q (+ m)."""
    kind: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> int:
        return self.q.shape[1] * QK

    def dequantize(self) -> torch.Tensor:
        w = self.d.float().unsqueeze(-1) * self.q.float()
        if self.m is not None:
            w = w + self.m.float().unsqueeze(-1)
        return w.reshape(self.n, self.k)


def quantize(w: torch.Tensor, kind: str) -> QBlocks:
    """fp32 [n, k] (k a multiple of QK) -> blocks, rounded as ggml's reference quantizers do."""
    x = w.detach().float().reshape(w.shape[0], -1, QK)
    if kind == "q8_0":
        d = x.abs().amax(-1) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        v = x * inv.unsqueeze(-1)
        return QBlocks(kind, (v.sign() * (v.abs() + 0.5).floor()).to(torch.int8), d.half())  # C's roundf
    lo, hi = x.amin(-1), x.amax(-1)
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = ((x - lo.unsqueeze(-1)) * inv.unsqueeze(-1) + 0.5).to(torch.int8).clamp_(0, 15).to(torch.uint8)
    return QBlocks("q4_1", q, d.half(), lo.half())


def from_gguf(raw: np.ndarray, type_name: str) -> QBlocks | None:
    """A GGUF tensor's own blocks (raw: uint8 [n, bytes per row]) for Q8_0, Q4_0 and Q4_1 (as Q4_1, m = -8 d);
    None for other types."""
    sizes = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
    if type_name not in sizes:
        return None
    n = raw.shape[0]
    b = torch.from_numpy(np.array(raw, dtype=np.uint8)).reshape(n, -1, sizes[type_name])  # (a copy: the file is read-only)
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    if type_name == "Q8_0":
        return QBlocks("q8_0", b[..., 2:].contiguous().view(torch.int8), d)
    m = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1) if type_name == "Q4_1" else d * -8
    qs = b[..., -16:]  # byte j: value j in the low nibble, value j + 16 in the high one
    q = torch.cat([qs & 15, qs >> 4], dim=-1)
    return QBlocks("q4_1", q.contiguous(), d, m.contiguous())


def concat(parts: list[QBlocks]) -> QBlocks:
    """Blocks of weights stacked along n (the fused q|k|v and gate|up projections); one kind."""
    m = None if parts[0].m is None else torch.cat([p.m for p in parts])
    return QBlocks(parts[0].kind, torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m)


def pack(b: QBlocks) -> torch.Tensor:
    """The kernel's layout (qgemm.c): uint8 [ceil(n / QW), k / QK, block bytes], columns padded with zeros."""
    pad = -b.n % QW
    q, d = F.pad(b.q, (0, 0, 0, 0, 0, pad)), F.pad(b.d, (0, 0, 0, pad))
    panels, blocks = (b.n + pad) // QW, b.k // QK

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [n, blocks] fp16 -> [panels, blocks, QW * 2] bytes
        return t.reshape(panels, QW, blocks).transpose(1, 2).contiguous().view(torch.uint8)

    q = q.view(torch.uint8).reshape(panels, QW, blocks, QK).permute(0, 2, 3, 1)  # [panels, blocks, QK, QW]
    if b.kind == "q8_0":
        return torch.cat([per_block(d), q.reshape(panels, blocks, QK * QW)], dim=-1).contiguous()
    pairs = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(panels, blocks, QK * QW // 2)
    return torch.cat([per_block(d), per_block(F.pad(b.m, (0, 0, 0, pad))), pairs], dim=-1).contiguous()


def unpack(panels: torch.Tensor, kind: str, n: int, k: int) -> torch.Tensor:
    """fp32 [n, k] of packed panels, in torch (the path when the kernels are turned off)."""
    p, blocks = panels.shape[0], k // QK
    d = panels[..., :QW * 2].contiguous().view(torch.float16).float()  # [p, blocks, QW]
    if kind == "q8_0":
        w = panels[..., QW * 2:].contiguous().view(torch.int8).reshape(p, blocks, QK, QW).float() * d.unsqueeze(2)
    else:
        m = panels[..., QW * 2:QW * 4].contiguous().view(torch.float16).float()
        pairs = panels[..., QW * 4:].reshape(p, blocks, QK // 2, 1, QW)
        q = torch.cat([pairs & 15, pairs >> 4], dim=3).reshape(p, blocks, QK, QW).float()
        w = q * d.unsqueeze(2) + m.unsqueeze(2)
    return w.permute(0, 3, 1, 2).reshape(p * QW, k)[:n]


class QuantLinear:
    """y = x @ W^T (+ bias) on W's blocks: the kernel for up to `KERNEL_ROWS[isa]` rows (fewer where bf16 takes
    over: `BF16_ROWS`), else F.linear on the weight dequantized for the call, in bf16 or fp32."""

    def __init__(self, blocks: QBlocks, bias: torch.Tensor | None = None, arena=None) -> None:
        """`arena`: a `hugepages.Arena` to keep the packed blocks in (huge pages, in the order the model reads
        them), else a tensor of their own."""
        self._hold(blocks.kind, blocks.n, blocks.k, pack(blocks), bias, arena)

    @classmethod
    def of_panels(cls, kind: str, n: int, k: int, panels: torch.Tensor, bias: torch.Tensor | None = None,
                  arena=None) -> QuantLinear:
        """The layer on blocks already packed (`pack`; read from the prepared-weights cache,
        `pdserve.model.weight_cache`)."""
        linear = cls.__new__(cls)
        linear._hold(kind, n, k, panels, bias, arena)
        return linear

    def _hold(self, kind: str, n: int, k: int, panels: torch.Tensor, bias: torch.Tensor | None, arena) -> None:
        self.kind, self.n, self.k = kind, n, k
        self.panels = panels
        if arena is not None:
            nbytes = self.panels.numel()
            held = arena.take(-(-nbytes // 4)).view(torch.uint8)[:nbytes].view(self.panels.shape)
            self.panels = held.copy_(self.panels)
        self.bias = bias
        self.isa = kernels.qgemm_isa()
        self.bf16_from = bf16_rows(kernels.bf16_isa(), kind)
        self.i8_rows = i8_rows(self.kind)
        self.max_rows = min(max(KERNEL_ROWS.get(self.isa, 0), self.i8_rows[1]), self.bf16_from - 1)

    def kernel_format(self, rows: int) -> int:
        """The kernel format (qgemm.c) for a call of `rows` rows."""
        lo, hi = self.i8_rows
        return kernels.FMT_Q8_0_I8 if lo <= rows <= hi else KINDS[self.kind]

    def path(self, fmt: int) -> str:
        """The name a call in kernel format `fmt` is counted under (`kernels.paths_used()["gemm"]`)."""
        return f"{self.kind}_{self.isa}{'_i8' if fmt == kernels.FMT_Q8_0_I8 else ''}"

    @property
    def nbytes(self) -> int:
        return self.panels.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= self.max_rows and kernels.usable(x):
            fmt = self.kernel_format(rows)
            kernels.used("gemm", self.path(fmt))
            y = kernels.qgemm(x, self.panels, fmt, self.n, self.k)
            return y if self.bias is None else y.add_(self.bias)
        if rows >= self.bf16_from and kernels.usable(x):
            return self.bf16(x)
        return linear.large(x, self.weight(_scratch(self.n * self.k)), self.bias, f"{self.kind}_dequant")

    def bf16(self, x: torch.Tensor) -> torch.Tensor:
        """The bf16 path of many rows (where `BF16_ROWS` says): the blocks dequantized to bf16 for the call, F.linear
        in bf16 (AMX, AVX512-BF16), fp32 out. Callers check `kernels.usable(x)`."""
        kernels.used("gemm", f"{self.kind}_bf16")
        w = kernels.qdequant_bf16t(self.panels, KINDS[self.kind], self.n, self.k,
                                   _scratch(self.n * self.k, torch.bfloat16))
        y = F.linear(x.to(torch.bfloat16), w).float()
        return y if self.bias is None else y.add_(self.bias)

    def weight(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 weight [n, k] these blocks hold (the kernel's dequantization, or torch's when it is off), in
        `out` (numel >= n * k) when given."""
        if kernels.available():
            return kernels.qdequant(self.panels, KINDS[self.kind], self.n, self.k, out)
        kernels.count_fallback("quantized weights dequantized in torch (kernels turned off or not built)")
        return unpack(self.panels, self.kind, self.n, self.k)


def i8_rows(kind: str) -> tuple[int, int]:
    """The row counts (inclusive) at which `kind` blocks run the int8-row kernel on this host ((1, 0): none)."""
    isa = kernels.qgemm_i8_isa() if kind == "q8_0" else "none"
    rows = I8_ROWS.get(kernels.host_kind(isa), (1, 0))
    if kind == "q8_0":
        kernels.decide(f"Q8_0 weights: int8 rows ({isa} VNNI) for {rows[0]}-{rows[1]} rows, fp32 rows else"
                       if isa != "none" else "Q8_0 weights: no VNNI on this CPU, fp32 rows at every row count")
    return rows


def bf16_rows(bf16_isa: str, kind: str) -> int:
    """The row count from which `kind` blocks multiply in bf16 on a CPU that multiplies bf16 as `bf16_isa` says
    (`kernels.bf16_isa()`; a huge number: never, fp32 past the kernels' rows)."""
    key = kernels.host_kind(bf16_isa)
    rows = BF16_ROWS.get(key, {}).get(kind, 1 << 62)
    kernels.decide(f"{kind} weights: bf16 F.linear ({key}) from {rows} rows" if key in BF16_ROWS else
                   f"quantized weights: no measured bf16 rule for this CPU's bf16 ({bf16_isa}): fp32 F.linear past "
                   f"the kernels' rows")
    return rows


_SCRATCH: dict[torch.dtype, torch.Tensor] = {}


def _scratch(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One buffer per dtype reused by every prefill-sized call (the model runs one layer at a time): a fresh
    tensor of megabytes per call would be mapped and page-faulted each time."""
    if dtype not in _SCRATCH or _SCRATCH[dtype].numel() < numel:
        _SCRATCH[dtype] = torch.empty(numel, dtype=dtype)
    return _SCRATCH[dtype]


def resolve_weights(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The weight format to load: `auto` -> the measured pick for this CPU (logged); fp32, q8_0, q4 as named. A
    quantized format named where it cannot run (not CPU fp32, no compiled kernels) is a one-line error."""
    cpu_fp32 = device.type == "cpu" and dtype == torch.float32
    if name == "auto":
        isa = kernels.qgemm_isa() if cpu_fp32 else "none"
        chosen = AUTO.get(isa, "fp32")
        log.warning("pdserve: --weights auto -> %s (the format measured fastest within the quality bounds for "
                    "%s; BENCHMARKS.md 'Quantized weights')", chosen, "this device" if isa == "none" else isa)
        return chosen
    if name != "fp32":
        why = "the model must run on CPU in float32" if not cpu_fp32 else kernels.unavailable()
        if why is None and kernels.qgemm_isa() == "none":
            why = "this CPU has no AVX2 + FMA + F16C"
        if why is not None:
            raise UnsupportedModelError(f"--weights {name} cannot run here: {why}; use --weights fp32")
    return name


class QuantLoader:
    """Makes each linear layer's `QuantLinear` for format `fmt` (q8_0 or q4) from a GGUF file's own blocks
    (`gguf`: HF name -> (GGUF type, raw rows), `gguf_convert.raw_tensors`) where it has them, else from the fp32
    weight, requantized. `sources` counts the tensors by where their blocks came from."""

    def __init__(self, fmt: str, gguf: dict[str, tuple[str, np.ndarray]] | None = None) -> None:
        self.fmt, self.gguf = fmt, gguf or {}
        self.sources: dict[str, int] = {}
        self.nbytes = 0

    def linear(self, names: list[str], weight: torch.Tensor, bias: torch.Tensor | None = None,
               arena=None) -> QuantLinear | None:
        """`weight` (fp32 [n, k]) is the stack of the tensors `names`; None where k is no multiple of QK (the
        caller keeps fp32). `arena`: where the blocks are kept (`QuantLinear`)."""
        blocks = self._file_blocks(names)
        if blocks is None:
            if weight.shape[1] % QK:
                self._count(f"fp32 (k={weight.shape[1]} is no multiple of {QK})", len(names))
                return None
            blocks = quantize(weight, "q8_0" if self.fmt == "q8_0" else "q4_1")
            self._count(f"{blocks.kind} requantized", len(names))
        linear = QuantLinear(blocks, bias, arena)
        self.nbytes += linear.nbytes
        return linear

    def _file_blocks(self, names: list[str]) -> QBlocks | None:
        allowed = ("q8_0",) if self.fmt == "q8_0" else ("q4_1", "q8_0")
        parts = [from_gguf(self.gguf[n][1], self.gguf[n][0]) if n in self.gguf else None for n in names]
        if any(p is None or p.kind not in allowed for p in parts) or len({p.kind for p in parts}) != 1:
            return None
        self._count(f"{parts[0].kind} from the file", len(names))
        return concat(parts)

    def _count(self, source: str, tensors: int) -> None:
        self.sources[source] = self.sources.get(source, 0) + tensors

    def summary(self) -> str:
        parts = ", ".join(f"{n} {source}" for source, n in sorted(self.sources.items()))
        return f"weights {self.fmt}: {parts}; {self.nbytes / 1e6:.1f} MB of blocks"


def quant_loader(name: str, model: str | None, device: torch.device, dtype: torch.dtype) -> QuantLoader | None:
    """The loader for `--weights name` (None: fp32) of `model` (a GGUF file gives its own blocks)."""
    fmt = resolve_weights(name, device, dtype)
    if fmt == "fp32":
        return None
    from pdserve.model.loader import default_model_path
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from pdserve.model.gguf_convert import raw_tensors
        return QuantLoader(fmt, raw_tensors(path))
    return QuantLoader(fmt)
