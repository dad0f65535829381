"""Moves KV bytes between a worker's tiers for `pdserve.core.kvstore.kv_tiers.TieredKV`.

Copies down (offload: device -> host; flush: host -> disk), prefetches (disk -> host) and deletes run on
one background thread, so a step never waits for them: the engine `submit`s the operations its tier
bookkeeping produced after a step and `poll`s the finished ones before the next. Loads (host -> device)
run on the engine's thread, right before the forward that reads them (`load`): a memory copy, far
cheaper than recomputing the blocks.

The shared pool (`--kv-remote`, `pdserve.kv.remote_store`) has two threads of its own: one for what a request
waits for (`pdserve-kv-lookup`: probes, which of a prefix's blocks the pool holds, and fetches, pool -> host
slot), one for write-through (`pdserve-kv-publish`: host slot -> pool). Both cross the network and, with the pool
down, may take seconds to fail; a lookup never waits behind a disk flush or a publish, nor they behind it. The
pool keeps blocks in the host tier's codec.

Each tier holds its blocks in its own codec (`--kv-host-cache-dtype`, `--kv-disk-cache-dtype`; by default the
pool's): the host store transcodes on the way down and up, and a disk tier of another codec than the host's is
written transcoded from the host slot and read back through a staging buffer.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Sequence

import torch

from pdserve.core.kvstore.kv_ops import KVLoad, KVOp, TierCapacity
from pdserve.core.kvstore.kv_remote import ABSENT, DOWN
from pdserve.kv.disk_store import CorruptBlock, DiskKVStore, is_disk_full
from pdserve.core.kvstore import kv_codecs
from pdserve.kv.codec import KVCodec
from pdserve.kv.host_store import HostKVStore
from pdserve.kv.transcode import transcode


class TierIO:
    def __init__(self, device_layers: Sequence[torch.Tensor], host: HostKVStore, disk: DiskKVStore | None,
                 disk_blocks: int = 0, disk_recode: tuple[KVCodec, KVCodec] | None = None,
                 codecs: tuple[str, str] | None = None, remote=None) -> None:
        """`codecs`: the names of the host and disk tiers' codecs (the blocks' metadata records them); `remote`:
        the shared pool (a `RemoteKVStore`), or None."""
        self.layers = device_layers
        self.host = host
        self.disk = disk
        self.remote = remote
        self.disk_recode = disk_recode  # (host codec, disk codec) when they differ
        self.capacity = TierCapacity(host.num_slots, disk_blocks if disk is not None else 0, host.slot_nbytes,
                                     *(codecs or (None, None)), disk_sealed=getattr(disk, "seal", None) is not None,
                                     remote=remote is not None, remote_sealed=getattr(remote, "seal", None) is not None)
        self.busy_s = collections.Counter()  # seconds spent per operation kind (bandwidth = bytes / time)
        self._done: collections.deque = collections.deque()
        self._submitted = self._finished = 0
        names = ["pdserve-kv-io", *(("pdserve-kv-lookup", "pdserve-kv-publish") if remote is not None else ())]
        self._queues = {name: queue.SimpleQueue() for name in names}
        self._threads = [threading.Thread(target=self._run, args=(q,), name=name, daemon=True)
                         for name, q in self._queues.items()]
        for thread in self._threads:
            thread.start()

    def restored(self) -> list[tuple[int, float, float]]:
        """Blocks on disk from earlier runs: [(hash, produced-at, last use)] in wall-clock seconds."""
        return self.disk.scan() if self.disk is not None else []

    def submit(self, ops: Sequence[KVOp]) -> None:
        for op in ops:
            self._submitted += 1
            self._queues[THREAD_OF.get(op.kind, "pdserve-kv-io")].put(op)

    def poll(self) -> list[tuple[int, dict[int, str]]]:
        """Finished operations since the last poll: [(op id, {hash: why it failed})]."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def load(self, loads: Sequence[KVLoad]) -> None:
        if loads:
            start = time.perf_counter()
            self.host.load(self.layers, [ld.host_slot for ld in loads], [ld.block_id for ld in loads])
            self.busy_s["load"] += time.perf_counter() - start

    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait until every submitted operation has finished (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._finished < self._submitted:
            if time.monotonic() > deadline:
                raise TimeoutError("KV tier I/O did not finish")
            time.sleep(0.001)

    def close(self) -> None:
        for thread, q in zip(self._threads, self._queues.values()):
            if thread.is_alive():
                q.put(None)
                thread.join(timeout=5)
        if self.remote is not None:
            self.remote.close()

    def _run(self, ops: queue.SimpleQueue) -> None:
        # One thread for this thread's torch ops (a per-thread setting): an OpenMP team of its own would
        # spin on the cores the engine's step runs on.
        torch.set_num_threads(1)
        while True:
            op = ops.get()
            if op is None:
                return
            start = time.perf_counter()
            try:
                failures = getattr(self, f"_{op.kind}")(op)
            except Exception as e:  # noqa: BLE001 - every failure ends the operation, explicitly
                failures = {h: f"{type(e).__name__}: {e}" for h in op.hashes}
            self.busy_s[op.kind] += time.perf_counter() - start
            self._done.append((op.op_id, failures))
            self._finished += 1

    def _offload(self, op: KVOp) -> dict[int, str]:
        self.host.store(self.layers, op.src, op.dst)
        return {}

    def _flush(self, op: KVOp) -> dict[int, str]:
        failures = {}
        for h, slot in zip(op.hashes, op.src):
            if failures:  # the disk refused one: do not hammer it with the rest
                failures[h] = next(iter(failures.values()))
                continue
            try:
                self.disk.write(h, self._disk_payload(slot))
            except OSError as e:
                failures[h] = "disk_full" if is_disk_full(e) else f"write failed: {e.strerror or e}"
        return failures

    def _prefetch(self, op: KVOp) -> dict[int, str]:
        failures = {}
        for h, slot in zip(op.hashes, op.dst):
            try:
                self._read_slot(h, slot)
            except CorruptBlock:
                failures[h] = "corrupt"
            except FileNotFoundError:
                failures[h] = "missing"
            except OSError as e:
                failures[h] = f"read failed: {e.strerror or e}"
        return failures

    def _disk_payload(self, slot: int) -> memoryview:
        """A host slot's block as the disk tier keeps it."""
        if self.disk_recode is None:
            return self.host.slot_bytes(slot)
        return transcode(self.host.slot_bytes(slot), *self.disk_recode)

    def _read_slot(self, block_hash: int, slot: int) -> None:
        """A block from disk into a host slot (staged and transcoded when the disk keeps another codec)."""
        if self.disk_recode is None:
            self.disk.read_into(block_hash, self.host.slot_bytes(slot))
            return
        staged = memoryview(bytearray(self.disk.payload_nbytes))
        self.disk.read_into(block_hash, staged)
        self.host.slot_bytes(slot)[:] = transcode(staged, *reversed(self.disk_recode))

    def _delete(self, op: KVOp) -> dict[int, str]:
        for h in op.hashes:
            self.disk.delete(h)
        return {}

    # ---- the shared pool (its own thread) ----------------------------------------------------------------------
    def _probe(self, op: KVOp) -> dict[int, str]:
        from pdserve.kv.remote_store import PoolDown
        try:
            found = self.remote.exists(list(op.hashes))
        except PoolDown:
            return {h: DOWN for h in op.hashes}
        return {h: ABSENT for h, there in zip(op.hashes, found) if not there}

    def _fetch(self, op: KVOp) -> dict[int, str]:
        from pdserve.kv.remote_store import PoolDown
        failures = {}
        for h, slot in zip(op.hashes, op.dst):
            try:
                self.remote.read_into(h, self.host.slot_bytes(slot))
            except FileNotFoundError:
                failures[h] = "missing"
            except CorruptBlock:
                failures[h] = "corrupt"
            except PoolDown:
                failures.update({k: DOWN for k in op.hashes if k not in failures})
                break
        return failures

    def _publish(self, op: KVOp) -> dict[int, str]:
        from pdserve.kv.remote_store import PoolDown
        for i, (h, slot) in enumerate(zip(op.hashes, op.src)):
            try:
                self.remote.write(h, self.host.slot_bytes(slot))
            except PoolDown:
                return {k: DOWN for k in op.hashes[i:]}
        return {}


# the shared pool's operations, on threads of their own (the others: pdserve-kv-io)
THREAD_OF = {"probe": "pdserve-kv-lookup", "fetch": "pdserve-kv-lookup", "publish": "pdserve-kv-publish"}


def build_tier_io(config, model_config, model_dir, layers: Sequence[torch.Tensor], codec: KVCodec,
                  worker: str) -> TierIO | None:
    """The host (and disk) tiers `config` asks for, around the device pool `layers` (whose blocks are in
    `codec`), each in its own codec (`kv_codecs.tier_codecs`) and sized in its blocks; None without a host tier."""
    if not config.kv_host_gb:
        return None
    host_name, disk_name = kv_codecs.tier_codecs(codec.name, config.kv_host_cache_dtype, config.kv_disk_cache_dtype)
    host_codec = _tier_codec(host_name, codec)
    num_slots = kv_codecs.tier_blocks(config.kv_host_gb, _block_bytes(host_codec, model_config, config.block_size))
    host = HostKVStore(num_slots, model_config.num_layers, model_config.num_kv_heads, config.block_size,
                       host_codec.width, host_codec.storage, pin=layers[0].device.type == "cuda",
                       recode=None if host_codec is codec else (codec, host_codec))
    disk, disk_blocks, disk_recode = None, 0, None
    if config.kv_disk_dir:
        from pdserve.kv.block_seal import BlockSeal
        from pdserve.kv.disk_store import model_identity
        disk_codec = _tier_codec(disk_name, host_codec)
        identity = model_identity(model_dir, disk_codec.format, config.block_size, "L2HBD")
        block_bytes = _block_bytes(disk_codec, model_config, config.block_size)
        seal = None if config.kv_disk_key_file is None else BlockSeal.from_key_file(config.kv_disk_key_file, identity)
        disk = DiskKVStore(config.kv_disk_dir, identity, worker, block_bytes, seal)
        disk_blocks = kv_codecs.tier_blocks(config.kv_disk_gb, disk.file_nbytes)
        disk_recode = None if disk_codec is host_codec else (host_codec, disk_codec)
    remote = None
    if getattr(config, "kv_remote", None):
        remote = _remote_store(config, model_dir, host_codec, host.slot_nbytes)
    return TierIO(layers, host, disk, disk_blocks, disk_recode, (host_name, disk_name), remote)


def _remote_store(config, model_dir, codec: KVCodec, block_bytes: int):
    """The shared pool, its blocks in the host tier's codec (sealed with the disk tier's key file, if any)."""
    from pdserve.kv.block_seal import BlockSeal
    from pdserve.kv.disk_store import model_identity
    from pdserve.kv.remote_store import RemoteKVStore
    identity = model_identity(model_dir, codec.format, config.block_size, "L2HBD")
    seal = None if config.kv_disk_key_file is None else BlockSeal.from_key_file(config.kv_disk_key_file, identity)
    return RemoteKVStore(config.kv_remote, identity, block_bytes, int(config.kv_remote_gb * (1 << 30)), seal)


def _tier_codec(name: str, above: KVCodec) -> KVCodec:
    """A tier's KVCodec: `above` itself (the blocks kept as they are) when it is the same codec."""
    return above if name == above.name else KVCodec(name, above.head_dim, above.model_dtype)


def _block_bytes(codec: KVCodec, model_config, block_size: int) -> int:
    return codec.kv_bytes_per_token(model_config) * block_size
