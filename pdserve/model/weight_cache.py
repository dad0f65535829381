"""Prepared weights on disk (`--weights-cache`): what a model load computes from the checkpoint, kept for the next.

A CPU load packs every linear layer's weight for the compiled GEMM kernels (fp32 column panels, or quantized
blocks in the kernel's panels: requantized, or a GGUF file's own blocks) and stacks the fused projections
(q|k|v, gate|up). The first load of a model writes these tensors to one safetensors file in the cache
directory; the next load of the same model, format and code maps the file and copies the panels into the
model's huge-page arena instead of computing them (docs/benchmarks.md, "Start-up").

- Key: the checkpoint's files (path, size, mtime; the GGUF file the quantized blocks come from too), the
  weight format, the compiled kernels' library (named by its sources, flags, compiler and CPU: `pdserve.cbuild`),
  torch's version, `LAYOUT_VERSION` and the source of the code that shapes the tensors. Any change: another file.
- Checked: the file carries an xxh3 digest of its tensors' bytes; a file that does not open (truncated), or whose
  digest, key or tensor set does not match, is rebuilt, logged and counted (`rebuilds`), never used.
- Written atomically (a temporary file renamed over the name): two workers loading at once each write a whole
  file and the last rename wins; a reader maps one whole file (an older one stays mapped after a rename).
- Not kept: MKL's packed copy of an fp32 weight (`torch.ops.mkl._mkl_reorder_linear_weight`) is an opaque
  tensor whose bytes torch does not expose; it is made again at each load.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import torch
import xxhash

log = logging.getLogger(__name__)

LAYOUT_VERSION = "1"  # bump when the tensors' names or layout change without a change to the files below
_CODE = [Path(__file__).with_name(n) for n in ("weight_cache.py", "linear.py", "llama.py", "quant.py")]


def cache_dir(setting: str) -> Path | None:
    """The directory `--weights-cache` names: auto = `$PDSERVE_WEIGHTS_CACHE`, else `$XDG_CACHE_HOME/pdserve/
    weights`, else `~/.cache/pdserve/weights`; off = None (no cache)."""
    if setting == "off":
        return None
    if setting == "auto":
        from pdserve.cbuild import user_cache
        return user_cache("weights", "PDSERVE_WEIGHTS_CACHE")
    return Path(setting).expanduser()


def _stat(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def cache_key(model_dir: Path, source: Path | None, fmt: str) -> str:
    """The key of a model's prepared tensors (module docstring); `source`: the GGUF file quantized blocks come from."""
    from pdserve.model.kernels import build
    files = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".json"))
    parts = {"files": [_stat(p) for p in files], "source": _stat(source) if source is not None else None,
             "weights": fmt, "kernels": str(build.build()), "torch": torch.__version__, "layout": LAYOUT_VERSION,
             "code": xxhash.xxh3_64_hexdigest(b"".join(p.read_bytes() for p in _CODE))}
    return xxhash.xxh3_64_hexdigest(json.dumps(parts, sort_keys=True).encode())


def _digest(tensors: dict[str, torch.Tensor], meta: str) -> str:
    h = xxhash.xxh3_64(meta.encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(name.encode())
        h.update(t.contiguous().view(torch.uint8).numpy() if t.numel() else b"")
    return h.hexdigest()


_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.uint8: "U8", torch.int8: "I8", torch.bfloat16: "BF16"}


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file of `tensors`, each written from its own memory (safetensors' writers copy every
    tensor into one bytes object first: 2.4 s for the default model's 0.8 GB against ~0.5 s)."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for t in tensors.values():
            if t.numel():
                f.write(t.detach().contiguous().view(torch.uint8).numpy().data)


class WeightCache:
    """One model's prepared tensors: those read from the cache file (a hit) or put by this load (a miss, written
    by `save`). `root` None: no cache (`off`, or a model the cache does not serve): nothing read or written."""

    def __init__(self, root: Path | None, name: str = "", key: str = "") -> None:
        self.path = None if root is None else root / f"{name}-{key}.safetensors"
        self.key = key
        self.found: dict[str, torch.Tensor] = {}
        self.meta: dict = {}
        self.put_tensors: dict[str, torch.Tensor] = {}
        self.rebuilds = 0  # cache files found unusable (truncated, corrupt) and made again
        self.write_failures = 0  # prepared tensors that could not be written (the load went on without)
        self.state = "off" if root is None else "miss"

    @property
    def hit(self) -> bool:
        return self.state == "hit"

    def open(self) -> WeightCache:
        """Maps the cache file when there is a usable one (a hit); a broken one is logged and counted."""
        if self.path is None or not self.path.exists():
            return self
        from safetensors import safe_open
        try:
            with safe_open(str(self.path), framework="pt") as f:
                header = f.metadata() or {}
                tensors = {n: f.get_tensor(n) for n in f.keys()}
            meta = json.loads(header.get("pdserve", "{}"))
            ok = header.get("key") == self.key and header.get("digest") == _digest(tensors, header.get("pdserve", ""))
            why = "its key or digest does not match its tensors"
        except Exception as e:  # noqa: BLE001 - any unreadable file is rebuilt (safetensors raises its own types)
            ok, why = False, f"it does not open ({type(e).__name__}: {e})"
        if not ok:
            self.rebuilds += 1
            log.warning("pdserve: the prepared-weights cache file %s is unusable (%s): rebuilding it", self.path, why)
            return self
        self.found, self.meta, self.state = tensors, meta, "hit"
        return self

    def get(self, name: str) -> torch.Tensor:
        """A tensor of a hit; a name the file lacks is an error (the key covers the code that names them)."""
        return self.found[name]

    def put(self, name: str, tensor: torch.Tensor) -> None:
        if self.path is not None and not self.hit:
            self.put_tensors[name] = tensor

    def save(self, meta: dict) -> None:
        """On a miss: writes the tensors put and `meta` (temporary file, then an atomic rename)."""
        if self.path is None or self.hit:
            return
        meta_json = json.dumps(meta)
        header = {"key": self.key, "digest": _digest(self.put_tensors, meta_json), "pdserve": meta_json}
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.stem}-", suffix=".tmp")
            os.close(fd)
            _write_safetensors(Path(tmp), self.put_tensors, header)
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.path)
            tmp = None
            self._prune()
        except OSError as e:
            self.write_failures += 1
            log.warning("pdserve: cannot write the prepared-weights cache to %s (%s): the next load prepares the "
                        "weights again", self.path, e.strerror or e)
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
        self.put_tensors = {}

    def _prune(self) -> None:
        """Removes this model's and format's files of other keys (an older pdserve, torch or checkpoint): a
        process that has one mapped keeps reading it."""
        prefix = self.path.name[:-len(f"{self.key}.safetensors")]
        for old in self.path.parent.glob(f"{prefix}*.safetensors"):
            if old != self.path and len(old.name) == len(self.path.name):
                old.unlink(missing_ok=True)


def open_cache(setting: str, model_dir: Path, source: Path | None, fmt: str, device: torch.device,
               dtype: torch.dtype) -> WeightCache:
    """The cache for a load of `model_dir` in format `fmt`; served: CPU float32 models (the packed kernels' layouts)."""
    root = cache_dir(setting)
    if root is None or device.type != "cpu" or dtype != torch.float32:
        return WeightCache(None)
    from pdserve.model import kernels
    if not kernels.available():
        return WeightCache(None)
    where = xxhash.xxh3_64_hexdigest(str(model_dir.resolve()).encode())[:8]  # (older keys of this one are pruned)
    return WeightCache(root, f"{model_dir.name}-{where}-{fmt}", cache_key(model_dir, source, fmt)).open()
