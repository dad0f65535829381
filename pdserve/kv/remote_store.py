"""The shared KV pool's bytes (`--kv-remote mooncake://MASTER[?metadata=URL]`): Mooncake Store, a distributed
key-value store whose memory every worker of the deployment lends a part of (`--kv-remote-gb`) and whose master
keeps the index. A block is a value under `pdkv/<identity>/<hash:016x>`: `identity` is the disk tier's (model,
codec, block size, layout: `pdserve.kv.disk_store.model_identity`), so a worker of another model or codec never
reads it, and the value is the disk tier's record (header with the block hash, length, xxh3-64 and produced-at,
then the payload; sealed with `--kv-disk-key-file`: `pdserve.kv.block_seal`), verified when read: a value
damaged or cut short (a writer that died mid-write) is refused and never served.

Every call runs on the tier I/O's remote thread (`pdserve.kv.tier_io`), never the compute thread: with the
master unreachable a call may take seconds before it fails; it then raises `PoolDown` and the worker's pool book
(`pdserve.core.kvstore.kv_remote`) stops asking for a while. A value the store evicted is a miss
(`FileNotFoundError`, as a missing disk file), never an error.
"""

from __future__ import annotations

import socket
from urllib.parse import parse_qs, urlsplit

from pdserve.errors import InvalidRequestError
from pdserve.kv.block_seal import OVERHEAD, BlockSeal
from pdserve.kv.disk_store import HEADER, CorruptBlock, check_record, encode_record, open_record

SCHEME = "mooncake://"
LOCAL = "local"  # `pdserve serve --kv-remote local`: a master of the deployment's own (`pdserve.mooncake`)


class PoolDown(Exception):
    """The pool did not answer (its master unreachable, or the call failed as a whole)."""


def parse_remote(url: str) -> tuple[str, str]:
    """`mooncake://HOST:PORT[?metadata=URL]` -> (master address, metadata server URL; default: the master's
    host, port 8080, as `mooncake_master -enable_http_metadata_server` serves it). A one-line error if malformed."""
    parts = urlsplit(url)
    if parts.scheme != "mooncake" or not parts.hostname or parts.port is None:
        raise InvalidRequestError(f"--kv-remote must be mooncake://HOST:PORT[?metadata=URL] or local, got {url!r}",
                                  param="kv_remote")
    query = parse_qs(parts.query)
    unknown = set(query) - {"metadata"}
    if unknown:
        raise InvalidRequestError(f"--kv-remote: unknown parameter {sorted(unknown)[0]!r} (only metadata=URL)",
                                  param="kv_remote")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    metadata = query.get("metadata", [f"http://{host}:8080/metadata"])[0]
    if not metadata.startswith(("http://", "https://")):
        raise InvalidRequestError(f"--kv-remote: metadata must be an http(s) URL, got {metadata!r}",
                                  param="kv_remote")
    return f"{host}:{parts.port}", metadata


class RemoteKVStore:
    def __init__(self, url: str, identity: str, payload_nbytes: int, segment_bytes: int,
                 seal: BlockSeal | None = None) -> None:
        from pdserve.mooncake import unavailable
        if url == LOCAL:  # (`pdserve serve` resolves it before its workers start; nobody else can)
            raise InvalidRequestError("--kv-remote local is pdserve serve's (it starts the pool); here give the pool's "
                                      "master: mooncake://HOST:PORT[?metadata=URL]", param="kv_remote")
        why = unavailable()
        if why is not None:
            raise InvalidRequestError(f"--kv-remote: {why}", param="kv_remote")
        from mooncake.store import MooncakeDistributedStore
        master, metadata = parse_remote(url)
        self.identity, self.payload_nbytes, self.seal = identity, payload_nbytes, seal
        self.record_nbytes = HEADER.size + payload_nbytes + (0 if seal is None else OVERHEAD)
        self.store = MooncakeDistributedStore()
        local = _local_address(master)
        rc = self.store.setup(local, metadata, segment_bytes, max(16 << 20, 4 * self.record_nbytes), "tcp", "",
                              master)
        if rc != 0:
            raise InvalidRequestError(f"--kv-remote {url}: the Mooncake store did not set up (code {rc}): is its "
                                      f"master running there?", param="kv_remote")

    def key(self, block_hash: int) -> str:
        return f"pdkv/{self.identity}/{block_hash:016x}"

    def exists(self, hashes: list[int]) -> list[bool]:
        """Which of `hashes` the pool holds now (PoolDown when it cannot say)."""
        if not hashes:
            return []
        found = self.store.batch_is_exist([self.key(h) for h in hashes])
        if any(code < 0 for code in found):
            raise PoolDown(f"the pool did not answer a lookup (code {min(found)})")
        return [code == 1 for code in found]

    def write(self, block_hash: int, payload: memoryview, produced_at: float | None = None) -> None:
        header, body = encode_record(block_hash, payload, self.seal, produced_at)
        # upsert, not put: a value already there (a damaged one, say) is replaced, where a put leaves it; in parts,
        # so the payload is not copied into one buffer with its header first
        rc = self.store.upsert_parts(self.key(block_hash), header, body)
        if rc != 0:
            raise PoolDown(f"the pool refused a write (code {rc})")

    def read_into(self, block_hash: int, out: memoryview) -> None:
        """Block `block_hash` into `out`, verified (opened, with a key). Raises FileNotFoundError (not there: never
        written, or evicted), CorruptBlock (removed from the pool) or PoolDown."""
        value = self.store.get(self.key(block_hash))
        if not value:
            if self.store.is_exist(self.key(block_hash)) < 0:
                raise PoolDown("the pool did not answer a read")
            raise FileNotFoundError(self.key(block_hash))
        view = memoryview(value)
        header, body = view[:HEADER.size], view[HEADER.size:]
        target = out if self.seal is None else memoryview(bytearray(len(out) + OVERHEAD))
        n = min(len(body), len(target))
        target[:n] = body[:n]
        problem = (check_record(bytes(header), len(body), b"", block_hash, target, self.seal)
                   or open_record(bytes(header), target, out, self.seal))
        if problem:  # removed (once no reader holds its lease; until then refused again by whoever reads it)
            self.store.remove(self.key(block_hash))
            raise CorruptBlock(f"{self.key(block_hash)}: {problem}")

    def close(self) -> None:
        self.store.close()


def _local_address(master: str) -> str:
    """This host's address toward the master (the one the pool's peers reach this worker's segment on)."""
    host, _, port = master.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, int(port)))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
