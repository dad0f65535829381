"""Compile C sources with the host's C compiler at first use, cached (the callers load the library: ctypes,
or as a Python extension module).

The library is cached under a key made of the sources, the flags, the compiler's version and the CPU's model
and feature flags (what `-march=native` depends on): a cache directory shared with, or copied to, another kind
of CPU misses and rebuilds instead of running illegal instructions. Cache: `$PDSERVE_KERNEL_CACHE`, else
`$XDG_CACHE_HOME/pdserve/kernels`, else `~/.cache/pdserve/kernels`. `$PDSERVE_KERNEL_CFLAGS` adds compiler
flags (part of the key), e.g. `-mno-avx512f` to run here what an AVX2-only host would.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path


def cache_dir() -> Path:
    return user_cache("kernels", "PDSERVE_KERNEL_CACHE")


def user_cache(kind: str, override: str) -> Path:
    """pdserve's user cache folder for `kind`: `$<override>`, else `$XDG_CACHE_HOME/pdserve/<kind>`, else
    `~/.cache/pdserve/<kind>` (compiled kernels here; a worker's calibrated time model: `pdserve.engine.calibration`)."""
    if os.environ.get(override):
        return Path(os.environ[override])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pdserve" / kind


def cpu_signature() -> str:
    """The CPU's vendor, model and feature flags: what compiled code and measured speeds depend on."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("vendor_id", "model name", "flags")]
    return "\n".join(sorted(set(keep)))


@functools.cache
def cpu_vendor() -> str:
    """"amd", "intel" or "" (another vendor, or no /proc/cpuinfo): some libraries pick their code by vendor
    (MKL runs its AVX-512 code only on Intel CPUs), so rules measured on one vendor's CPUs name it."""
    vendor = next((ln.split(":", 1)[1].strip() for ln in cpu_signature().splitlines() if ln.startswith("vendor_id")),
                  "")
    return {"AuthenticAMD": "amd", "GenuineIntel": "intel"}.get(vendor, "")


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    return cc


def flags(base: Sequence[str]) -> list[str]:
    return [*base, *shlex.split(os.environ.get("PDSERVE_KERNEL_CFLAGS", ""))]


def library_path(cc: str, name: str, sources: Sequence[Path], base_flags: Sequence[str]) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    parts = [*(s.read_text() for s in sources), " ".join(flags(base_flags)), version, platform.machine(),
             cpu_signature()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return cache_dir() / key / f"lib{name}.so"


def build(name: str, sources: Sequence[Path], base_flags: Sequence[str], headers: Sequence[Path] = (),
          libs: Sequence[str] = ()) -> Path:
    """Path of the compiled library `lib<name>.so`, compiling it first when the cache has none for this host.
    `headers` count in the cache key but are not compiled."""
    cc = compiler()
    lib = library_path(cc, name, [*sources, *headers], base_flags)
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # Compile to a temporary name and rename: concurrent first uses never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags(base_flags), *map(str, sources), "-o", tmp, *libs],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {name} failed:\n{proc.stderr[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib
