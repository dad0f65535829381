"""Compile kernels.c and gemm.c with the host's C compiler at first use and load it with ctypes.

The shared library is built for this very CPU (`-march=native`), so it is cached under a key made of the
source, the flags, the compiler's version and the CPU's model and feature flags: a cache directory shared
with, or copied to, another kind of CPU misses and rebuilds instead of running illegal instructions.
Cache: `$PDSERVE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/pdserve/kernels`, else `~/.cache/pdserve/kernels`.
`$PDSERVE_KERNEL_CFLAGS` adds compiler flags (part of the key), e.g. `-mno-avx512f` to run here what an
AVX2-only host would.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCES = [Path(__file__).with_name(n) for n in ("kernels.c", "gemm.c", "kv_codec.c")]
HEADERS = [Path(__file__).with_name("attend.h")]
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared",
         "-std=gnu11"]


def cache_dir() -> Path:
    if os.environ.get("PDSERVE_KERNEL_CACHE"):
        return Path(os.environ["PDSERVE_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pdserve" / "kernels"


def _cpu_signature() -> str:
    """The CPU model and feature flags (what -march=native depends on)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("vendor_id", "model name", "flags")]
    return "\n".join(sorted(set(keep)))


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    return cc


def _flags() -> list[str]:
    return FLAGS + shlex.split(os.environ.get("PDSERVE_KERNEL_CFLAGS", ""))


def library_path(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([*(s.read_text() for s in SOURCES + HEADERS), " ".join(_flags()), version, platform.machine(),
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    return cache_dir() / key / "libpdserve_kernels.so"


def build() -> Path:
    """Path of the compiled library, compiling it first when the cache has none for this host."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"the kernels are written for x86-64, this machine is {platform.machine()}")
    cc = _compiler()
    lib = library_path(cc)
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # Compile to a temporary name and rename: concurrent first uses never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *_flags(), *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling the kernels failed:\n{proc.stderr[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "pd_decode_attention": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F],
    "pd_add_rms_norm": [_P, _P, _P, _P, _I, _I, _F],
    "pd_silu_mul": [_P, _P, _I, _I],
    "pd_rope_write_kv": [_P, _I64, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I],
    "pd_gemm_pack": [_P, _P, _I, _I],
    "pd_gemm": [_P, _I64, _P, _P, _I, _I, _I],
    "pd_kv_encode": [_I, _P, _I64, _I, _P, _P, _I, _P],
    "pd_decode_attention_coded": [_I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _P, _P, _P, _P, _I64],
}


def load() -> ctypes.CDLL:
    import torch  # noqa: F401  (loads torch's libgomp first, so the library binds to that one)
    lib = ctypes.CDLL(str(build()))
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    for name in ("pd_gemm_panel_width", "pd_gemm_isa"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [], ctypes.c_int
    return lib
