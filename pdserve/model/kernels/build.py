"""Compile kernels.c, gemm.c, qgemm.c and kv_codec.c with the host's C compiler at first use and load them with ctypes.

The shared library is built for this very CPU (`-march=native`); `pdserve.cbuild` caches it per source,
flags, compiler and CPU (and reads `$PDSERVE_KERNEL_CACHE` / `$PDSERVE_KERNEL_CFLAGS`).
"""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

from pdserve import cbuild

SOURCES = [Path(__file__).with_name(n) for n in ("kernels.c", "gemm.c", "qgemm.c", "kv_codec.c")]
HEADERS = [Path(__file__).with_name("attend.h")]
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared",
         "-std=gnu11"]


def build() -> Path:
    """Path of the compiled library, compiling it first when the cache has none for this host."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"the kernels are written for x86-64, this machine is {platform.machine()}")
    return cbuild.build("pdserve_kernels", SOURCES, FLAGS, HEADERS, ["-lm"])


_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "pd_decode_attention": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F],
    "pd_add_rms_norm": [_P, _P, _P, _P, _I, _I, _F],
    "pd_silu_mul": [_P, _P, _I, _I],
    "pd_rope_write_kv": [_P, _I64, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I],
    "pd_gemm_pack": [_P, _P, _I, _I],
    "pd_gemm": [_P, _I64, _P, _P, _I, _I, _I],
    "pd_qgemm": [_I, _P, _I64, _P, _P, _I, _I, _I, _P],
    "pd_qdecode_forward": [_P, _I, _P],
    "pd_qdequant": [_I, _P, _P, _I, _I],
    "pd_qdequant_bf16t": [_I, _P, _P, _I, _I],
    "pd_kv_encode": [_I, _P, _I64, _I, _P, _P, _I, _P],
    "pd_decode_attention_coded": [_I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _P, _P, _P, _P, _I64],
}


def load() -> ctypes.CDLL:
    import torch  # noqa: F401  (loads torch's libgomp first, so the library binds to that one)
    lib = ctypes.CDLL(str(build()))
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    for name in ("pd_gemm_panel_width", "pd_gemm_isa", "pd_qgemm_isa", "pd_qgemm_i8_isa"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [], ctypes.c_int
    lib.pd_qblock_bytes.argtypes, lib.pd_qblock_bytes.restype = [_I], ctypes.c_int
    lib.pd_qscratch_bytes.argtypes, lib.pd_qscratch_bytes.restype = [_I, _I], ctypes.c_int64
    return lib
