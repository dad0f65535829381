"""Which matmul path is fastest for which row count on this host: the evidence for `linear.KERNEL_ROWS`.

    .venv/bin/python benchmarks/bench_gemm.py [--rows 1 2 4 8 16 32 48 64 96 128] [--repeats 7] [--threads 2]

Times the default model's 120 per-layer products (30 layers x q|k|v, o, gate|up, down; random fp32
weights of the same shapes, 425 MB, so every pass streams them from memory as a decode step does) for
each row count on four paths: the compiled GEMM kernel (`kernels.gemm`, when this host has one), MKL's
packed sgemm (`torch.ops.mkl._mkl_linear`), `F.linear` (MKL) and oneDNN's fp32 matmul on the plain weight
(the evidence for `linear.ONEDNN_FROM`). The paths alternate within each repeat, so a noisy neighbour slows
all alike; medians are printed, with the fastest path per row count and the range of row counts where the
kernel wins. `--quant`: also the quantized-weight paths (`pdserve.model.quant`: the q8_0 and q4_1 kernels,
dequantize + the fp32 matmul as prefill runs it past the kernels (`linear.large`), and where the CPU has VNNI
q8_0 on int8 rows, and where the CPU multiplies bf16 natively bf16 `F.linear` on the blocks dequantized per call),
the evidence for `quant.KERNEL_ROWS`, `quant.I8_ROWS` and `quant.BF16_ROWS`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pdserve.model import kernels
from pdserve.model import linear
from pdserve.model.linear import KERNEL_ROWS, ONEDNN_FROM, PACK_HINT_ROWS

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [out, in] of the default model's layers
LAYERS = 30


def make_paths(weights: list[torch.Tensor]) -> dict[str, list]:
    paths = {"mkl_packed": [], "f_linear": [], "onednn": []}
    if kernels.available() and kernels.isa() != "none":
        paths["kernel"] = [kernels.PackedWeight(w) for w in weights]
    for w in weights:
        paths["mkl_packed"].append((torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_HINT_ROWS), w))
        paths["f_linear"].append(w)
        paths["onednn"].append(w)  # oneDNN's fp32 matmul on the plain weight: the evidence for linear.ONEDNN_FROM
    return paths


def quant_paths(weights: list[torch.Tensor]) -> dict[str, list]:
    from pdserve.model import quant
    q8 = [quant.QuantLinear(quant.quantize(w, "q8_0")) for w in weights]
    q4 = [quant.QuantLinear(quant.quantize(w, "q4_1")) for w in weights]
    paths = {"q8_0": q8, "q4_1": q4, "q8_0_deq": q8, "q4_1_deq": q4}
    if kernels.qgemm_i8_isa() != "none":
        paths["q8_0_i8"] = q8  # int8 rows (VNNI): the evidence for quant.I8_ROWS
    if kernels.bf16_isa() != "none":  # bf16 F.linear on the blocks dequantized per call: the evidence for BF16_ROWS
        paths.update({"q8_0_bf16": q8, "q4_1_bf16": q4})
    return paths


def one_pass(path: str, packed: list, xs: dict[int, torch.Tensor]) -> float:
    from pdserve.model import quant
    t0 = time.perf_counter()
    for p in packed:
        if path in ("q8_0", "q4_1"):
            kernels.qgemm(xs[p.k], p.panels, quant.KINDS[p.kind], p.n, p.k)
        elif path == "q8_0_i8":
            kernels.qgemm(xs[p.k], p.panels, kernels.FMT_Q8_0_I8, p.n, p.k)
        elif path.endswith("_bf16"):
            p.bf16(xs[p.k])  # as QuantLinear runs it past quant.BF16_ROWS
        elif path.endswith("_deq"):
            linear.large(xs[p.k], p.weight(), None)  # as QuantLinear's fp32 path runs it
        elif path == "kernel":
            kernels.gemm(xs[p.k], p)
        elif path == "mkl_packed":
            x = xs[p[1].shape[1]]
            torch.ops.mkl._mkl_linear(x, p[0], p[1], None, x.shape[0])
        elif path == "onednn":
            torch.ops.mkldnn._linear_pointwise(xs[p.shape[1]], p, None, "none", [], "")
        else:
            F.linear(xs[p.shape[1]], p)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 48, 64, 96, 128])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--quant", action="store_true", help="also the quantized-weight paths")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.02 for _ in range(LAYERS) for n, k in SHAPES]
    paths = make_paths(weights)
    if args.quant:
        paths.update(quant_paths(weights))
    flops_per_row = 2 * sum(w.numel() for w in weights)
    kind = kernels.host_kind()
    print(f"kernel ISA: {kernels.isa()} (rules for {kind}), threads {torch.get_num_threads()}, current rule: kernel "
          f"for rows {KERNEL_ROWS.get(kind)}, oneDNN from {ONEDNN_FROM.get(kind, 'never')}")
    print(f"{'rows':>5}" + "".join(f"{p + ' ms':>16}" for p in paths) + "  fastest")
    wins = []
    for rows in args.rows:
        xs = {k: torch.randn(rows, k) for k in {k for _, k in SHAPES}}
        times: dict[str, list[float]] = {p: [] for p in paths}
        for r in range(args.repeats + 1):
            for p, packed in paths.items():
                dt = one_pass(p, packed, xs)
                if r:  # the first pass of each path is a warm-up
                    times[p].append(dt)
        med = {p: statistics.median(t) * 1e3 for p, t in times.items()}
        best = min(med, key=med.get)
        if best == "kernel":
            wins.append(rows)
        print(f"{rows:>5}" + "".join(f"{med[p]:>10.1f} ({flops_per_row * rows / med[p] / 1e6:>3.0f})"
                                    for p in paths) + f"  {best}")
    print("(in parentheses: GFLOP/s)")
    if "kernel" in paths:
        print(f"kernel fastest at rows: {wins}")


if __name__ == "__main__":
    main()
