"""KV at rest, sealed: the disk tier's blocks (and so the KV checkpoints made of them) encrypted and
authenticated with a key from a key file (`--kv-disk-key-file`).

The key file holds at least 32 bytes of secret (e.g. `head -c 32 /dev/urandom > kv.key`, mode 0600); the
block key is derived from it with HKDF-SHA256, salted by the disk folder's model identity, so one key file
serves every model and worker of a deployment, and a worker that adopts a dead peer's checkpoint files (hard
links into its own folder, `pdserve.engine.checkpoints`) opens them with the same key. Each block is sealed
with ChaCha20-Poly1305 under a fresh random 96-bit nonce, the file's header (magic, block hash, length,
produced-at) as associated data: a file renamed to another block's name, or changed in any byte, fails to open
and is dropped (a miss, recomputed), never served.

A folder sealed under one key carries a check record (`key.check`, a sealed constant). A worker started with
another key cannot open it: the folder's blocks are unreadable to it, so they are deleted at start and the
tier starts empty (`DiskKVStore.key_mismatch`, counted in `pdserve_fallbacks_total{kind="kv_disk_key_mismatch"}`);
the server serves as without them.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from pdserve.errors import InvalidRequestError

NONCE = 12
TAG = 16
OVERHEAD = NONCE + TAG  # bytes a sealed payload adds
MIN_KEY_BYTES = 32
CHECK_FILE = "key.check"
_CHECK = b"pdserve kv disk key check v1"


class SealBroken(Exception):
    """A sealed payload did not open: another key, or changed bytes."""


class BlockSeal:
    def __init__(self, secret: bytes, identity: str) -> None:
        key = HKDF(hashes.SHA256(), 32, salt=identity.encode(), info=b"pdserve kv disk block v1").derive(secret)
        self._aead = ChaCha20Poly1305(key)

    @classmethod
    def from_key_file(cls, path: str, identity: str) -> BlockSeal:
        """The seal of key file `path`; a one-line error (param `kv_disk_key_file`) when it cannot serve."""
        try:
            secret = Path(path).expanduser().read_bytes()
        except OSError as e:
            raise InvalidRequestError(f"--kv-disk-key-file {path}: cannot read it ({e.strerror or e})",
                                      param="kv_disk_key_file") from None
        text = secret.strip()  # a printable key (`openssl rand -hex 32`) loses its newline; a binary one is as is
        key = text if text and all(32 < b < 127 for b in text) else secret
        if len(key) < MIN_KEY_BYTES:
            raise InvalidRequestError(f"--kv-disk-key-file {path}: holds {len(key)} bytes, needs at least "
                                      f"{MIN_KEY_BYTES} of secret (e.g. head -c 32 /dev/urandom > {path})",
                                      param="kv_disk_key_file")
        return cls(key, identity)

    def seal(self, aad: bytes, payload) -> bytes:
        nonce = os.urandom(NONCE)
        return nonce + self._aead.encrypt(nonce, bytes(payload), aad)

    def open(self, aad: bytes, sealed) -> bytes:
        out = bytearray(len(sealed) - OVERHEAD)
        self.open_into(aad, sealed, memoryview(out))
        return bytes(out)

    def open_into(self, aad: bytes, sealed, out: memoryview) -> None:
        """Decrypt `sealed` (nonce, ciphertext, tag) straight into `out` (its plaintext's length)."""
        sealed = memoryview(sealed)
        try:
            self._aead.decrypt_into(bytes(sealed[:NONCE]), sealed[NONCE:], aad, out)
        except InvalidTag:
            raise SealBroken("authentication failed (another key, or changed bytes)") from None

    def claim(self, folder: Path) -> bool:
        """Check (or write) `folder`'s key record: False when the folder was sealed under another key."""
        record = folder / CHECK_FILE
        fresh = not record.exists()
        if not fresh:
            try:
                self.open(_CHECK, record.read_bytes())
                return True
            except SealBroken:
                pass
        tmp = record.with_name(f"{CHECK_FILE}.tmp{os.getpid()}")
        tmp.write_bytes(self.seal(_CHECK, _CHECK))
        os.replace(tmp, record)
        return fresh
