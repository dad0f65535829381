"""The disk KV tier's bytes: one file per block, `<dir>/<identity>/<worker>/<hash:016x>.kv`.

`identity` is a digest of everything that makes KV bytes mean something: the model's config and weights
(names, sizes and the first and last MiB of each weight file), dtype, block size and layout. A server of
another model, dtype or block size never reads these files, because it looks in another folder.

File: a 64-byte header (magic, format version, block hash, payload length, xxh3-64 of the payload,
produced-at wall time) then the payload (one host slot: every layer of the block). With a key
(`--kv-disk-key-file`, `pdserve.kv.block_seal`) the payload is sealed (nonce, ChaCha20-Poly1305 ciphertext and
tag; the header, magic `PDKVENC1`, is its associated data and its checksum is of the sealed bytes); a store
with a key reads only sealed files, one without only plain ones (`scan` tells them apart by size). A file is written to a
temporary name and renamed into place, so a kill mid-write leaves a stray temporary (removed at the next
start), never a file under a block's name with half its bytes; a file damaged later (torn, truncated,
overwritten) fails the header or checksum check on read and is deleted, never served.
"""

from __future__ import annotations

import errno
import os
import struct
import time
from pathlib import Path

import xxhash

from pdserve.errors import InvalidRequestError
from pdserve.kv.block_seal import OVERHEAD, BlockSeal, SealBroken

MAGIC = b"PDKVBLK1"
MAGIC_SEALED = b"PDKVENC1"
HEADER = struct.Struct("<8sQQQd24x")  # magic, block hash, payload bytes, xxh3-64 of payload, produced-at
assert HEADER.size == 64


class CorruptBlock(Exception):
    pass


def model_identity(model_dir: Path, dtype: str, block_size: int, layout: str) -> str:
    h = xxhash.xxh3_128()
    h.update(f"{dtype}|{block_size}|{layout}|".encode())
    config = model_dir / "config.json"
    if config.exists():
        h.update(config.read_bytes())
    for weights in sorted(model_dir.glob("*.safetensors")):
        size = weights.stat().st_size
        h.update(f"{weights.name}|{size}|".encode())
        with open(weights, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(size - (1 << 20), 0))
            h.update(f.read(1 << 20))
    return h.hexdigest()[:24]


def check_writable(directory: str) -> Path:
    """Create `directory` if needed and prove a file can be written there; a clear error if not."""
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise InvalidRequestError(f"--kv-disk-dir {directory}: not a writable directory ({e.strerror or e})",
                                  param="kv_disk_dir") from None
    return path


class DiskKVStore:
    def __init__(self, root: str, identity: str, worker: str, payload_nbytes: int,
                 seal: BlockSeal | None = None) -> None:
        self.dir = check_writable(root) / identity / worker
        self.dir.mkdir(parents=True, exist_ok=True)
        self.payload_nbytes = payload_nbytes
        self.seal = seal
        self.file_nbytes = HEADER.size + payload_nbytes + (0 if seal is None else OVERHEAD)
        for stray in self.dir.glob("*.tmp*"):  # a write killed half way in an earlier run
            stray.unlink(missing_ok=True)
        self.key_mismatch = seal is not None and not seal.claim(self.dir)
        if self.key_mismatch:  # sealed under another key: unreadable here, the tier starts empty
            for old in self.dir.glob("*.kv"):
                old.unlink(missing_ok=True)

    def path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}.kv"

    def scan(self) -> list[tuple[int, float, float]]:
        """Blocks present from earlier runs: [(hash, produced-at wall time, last use wall time)], oldest use
        first. Only names and sizes are checked here; contents are verified when read."""
        found = []
        for entry in os.scandir(self.dir):
            name = entry.name
            if not name.endswith(".kv") or len(name) != 19:
                continue
            try:
                st = entry.stat()
                block_hash = int(name[:16], 16)
            except (OSError, ValueError):
                continue
            if st.st_size == self.file_nbytes:
                found.append((block_hash, st.st_mtime, st.st_atime))
        found.sort(key=lambda t: t[2])
        return found

    def write(self, block_hash: int, payload: memoryview, produced_at: float | None = None) -> None:
        """Write one block atomically (sealed with a key). Raises OSError (errno ENOSPC when the disk is full)."""
        header, payload = encode_record(block_hash, payload, self.seal, produced_at)
        final = self.path(block_hash)
        tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def read_into(self, block_hash: int, out: memoryview) -> None:
        """Read one block into `out`, verified (and opened, with a key). Raises CorruptBlock (the file is
        deleted) or FileNotFoundError."""
        path = self.path(block_hash)
        body = out if self.seal is None else memoryview(bytearray(len(out) + OVERHEAD))
        with open(path, "rb") as f:
            header = f.read(HEADER.size)
            n = f.readinto(body) if len(header) == HEADER.size else 0
            extra = f.read(1)
        problem = check_record(header, n, extra, block_hash, body, self.seal) or open_record(header, body, out,
                                                                                             self.seal)
        if problem:
            path.unlink(missing_ok=True)
            raise CorruptBlock(f"{path.name}: {problem}")

    def delete(self, block_hash: int) -> None:
        self.path(block_hash).unlink(missing_ok=True)


def encode_record(block_hash: int, payload: memoryview, seal: BlockSeal | None,
                  produced_at: float | None = None) -> tuple[bytes, memoryview | bytes]:
    """A block as a store keeps it: (its header, its payload, sealed with `seal`). The disk tier's files and the
    shared pool's values (`pdserve.kv.remote_store`) are these records."""
    produced_at = time.time() if produced_at is None else produced_at
    if seal is not None:
        payload = seal.seal(HEADER.pack(MAGIC_SEALED, block_hash, len(payload), 0, produced_at), payload)
    magic = MAGIC if seal is None else MAGIC_SEALED
    return HEADER.pack(magic, block_hash, len(payload), xxhash.xxh3_64_intdigest(payload), produced_at), payload


def check_record(header: bytes, n: int, extra: bytes, block_hash: int, body: memoryview,
                 seal: BlockSeal | None) -> str:
    """Why a record read back (`header`, `n` payload bytes into `body`, `extra`: anything after) is not block
    `block_hash`'s ("" when it is, so far: a sealed one still has to open)."""
    if len(header) < HEADER.size:
        return "truncated header"
    magic, stored_hash, nbytes, checksum, _ = HEADER.unpack(header)
    if magic != (MAGIC if seal is None else MAGIC_SEALED) or stored_hash != block_hash or nbytes != len(body):
        return "header does not match"
    if n != nbytes or extra:
        return f"payload has {n}{'+' if extra else ''} bytes, header says {nbytes}"
    if xxhash.xxh3_64_intdigest(body) != checksum:
        return "checksum mismatch"
    return ""


def open_record(header: bytes, body: memoryview, out: memoryview, seal: BlockSeal | None) -> str:
    """A sealed body opened into `out` ("" when done or not sealed; else why not). On a failure `out` may hold
    garbage: its read is reported failed and the slot is discarded, never served."""
    if seal is None:
        return ""
    magic, block_hash, _, _, produced_at = HEADER.unpack(header)
    try:
        seal.open_into(HEADER.pack(magic, block_hash, len(out), 0, produced_at), body, out.cast("B"))
    except SealBroken as e:
        return str(e)
    return ""


def is_disk_full(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT)
