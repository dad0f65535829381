"""The KV tiers' bytes: `DiskKVStore` files (header, checksum, atomic writes, damage detection), the model
identity that names their folder, and `TierIO` moving real tensors device -> host -> disk -> host -> device."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import xxhash

from pdserve.core.kvstore.block_manager import KVBlockManager
from pdserve.core.kvstore.kv_meta import LifecycleConfig, LRUPolicy, Tier
from pdserve.core.kvstore.kv_tiers import KVLoad, KVOp, build_tiered_kv
from pdserve.errors import InvalidRequestError
from pdserve.kv.disk_store import HEADER, CorruptBlock, DiskKVStore, check_writable, model_identity
from pdserve.kv.host_store import HostKVStore
from pdserve.kv.tier_io import TierIO

PAYLOAD = 256


def payload(seed: int, n: int = PAYLOAD) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return bytes(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).tolist())


@pytest.fixture
def store(tmp_path: Path) -> DiskKVStore:
    return DiskKVStore(str(tmp_path / "kv"), "ident", "w0", PAYLOAD)


def read(store: DiskKVStore, h: int) -> bytes:
    out = bytearray(PAYLOAD)
    store.read_into(h, memoryview(out))
    return bytes(out)


# ---- DiskKVStore ---------------------------------------------------------------------------------------
def test_round_trip_and_layout(store: DiskKVStore, tmp_path: Path):
    data = payload(1)
    store.write(0xABC, memoryview(data), produced_at=123.5)
    path = store.path(0xABC)
    assert path == tmp_path / "kv" / "ident" / "w0" / "0000000000000abc.kv"
    assert path.stat().st_size == HEADER.size + PAYLOAD
    magic, h, n, _, produced = HEADER.unpack(path.read_bytes()[:HEADER.size])
    assert (magic, h, n, produced) == (b"PDKVBLK1", 0xABC, PAYLOAD, 123.5)
    assert read(store, 0xABC) == data
    assert read(store, 0xABC) == data  # reading does not consume it
    store.write(0xABC, memoryview(payload(2)))  # rewriting replaces it whole
    assert read(store, 0xABC) == payload(2)
    assert [p.name for p in store.dir.iterdir()] == ["0000000000000abc.kv"]  # no temporary left
    store.delete(0xABC)
    store.delete(0xABC)  # deleting twice is fine
    with pytest.raises(FileNotFoundError):
        read(store, 0xABC)


def test_full_64_bit_hash_names(store: DiskKVStore):
    h = 2**64 - 1
    store.write(h, memoryview(payload(3)))
    assert store.path(h).name == "ffffffffffffffff.kv"
    assert read(store, h) == payload(3)
    assert [t[0] for t in store.scan()] == [h]


def damage_cases():
    def truncate_payload(raw: bytes) -> bytes:
        return raw[:HEADER.size + PAYLOAD // 2]

    def truncate_header(raw: bytes) -> bytes:
        return raw[:HEADER.size - 5]

    def flip_payload_byte(raw: bytes) -> bytes:
        b = bytearray(raw)
        b[HEADER.size + 17] ^= 0x01
        return bytes(b)

    def bad_magic(raw: bytes) -> bytes:
        return b"XXXXXXXX" + raw[8:]

    def other_hash(raw: bytes) -> bytes:  # a file renamed onto another block's name
        magic, _, n, checksum, produced = HEADER.unpack(raw[:HEADER.size])
        return HEADER.pack(magic, 0x999, n, checksum, produced) + raw[HEADER.size:]

    def flip_checksum(raw: bytes) -> bytes:
        magic, h, n, checksum, produced = HEADER.unpack(raw[:HEADER.size])
        return HEADER.pack(magic, h, n, checksum ^ 1, produced) + raw[HEADER.size:]

    def longer(raw: bytes) -> bytes:  # wrong size: trailing bytes
        return raw + b"\0"

    def other_length(raw: bytes) -> bytes:  # header and payload of another block size, self-consistent
        magic, h, _, _, produced = HEADER.unpack(raw[:HEADER.size])
        body = raw[HEADER.size:] + b"\0" * 16
        return HEADER.pack(magic, h, len(body), xxhash.xxh3_64_intdigest(body), produced) + body

    def empty(raw: bytes) -> bytes:
        return b""

    return [truncate_payload, truncate_header, flip_payload_byte, bad_magic, other_hash, flip_checksum, longer,
            other_length, empty]


@pytest.mark.parametrize("damage", damage_cases(), ids=lambda f: f.__name__)
def test_damaged_file_raises_corrupt_and_is_deleted(store: DiskKVStore, damage):
    store.write(0x42, memoryview(payload(4)))
    store.write(0x43, memoryview(payload(5)))
    path = store.path(0x42)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CorruptBlock, match="0000000000000042.kv"):
        read(store, 0x42)
    assert not path.exists()  # never offered again
    with pytest.raises(FileNotFoundError):
        read(store, 0x42)
    assert read(store, 0x43) == payload(5)  # its neighbour is untouched


def test_stray_temporaries_are_removed_at_start(tmp_path: Path):
    first = DiskKVStore(str(tmp_path), "ident", "w0", PAYLOAD)
    first.write(1, memoryview(payload(1)))
    (first.dir / "0000000000000002.kv.tmp4242").write_bytes(b"half a write")
    (first.dir / "0000000000000003.kv.tmp1").write_bytes(b"")
    second = DiskKVStore(str(tmp_path), "ident", "w0", PAYLOAD)
    assert sorted(p.name for p in second.dir.iterdir()) == ["0000000000000001.kv"]
    assert read(second, 1) == payload(1)


def test_write_failure_leaves_no_temporary(store: DiskKVStore, monkeypatch):
    real_replace = os.replace

    def failing_replace(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError) as e:
        store.write(7, memoryview(payload(7)))
    assert e.value.errno == errno.ENOSPC
    monkeypatch.setattr(os, "replace", real_replace)
    assert list(store.dir.iterdir()) == []


def test_scan_lists_only_well_formed_names_and_sizes(store: DiskKVStore):
    for h in (1, 2, 3):
        store.write(h, memoryview(payload(h)))
    d = store.dir
    (d / "zzzzzzzzzzzzzzzz.kv").write_bytes(b"\0" * (HEADER.size + PAYLOAD))  # not hex
    (d / "00000000000000004.kv").write_bytes(b"\0" * (HEADER.size + PAYLOAD))  # 17 hex digits
    (d / "0000000000000005.kv").write_bytes(b"\0" * (HEADER.size + PAYLOAD - 1))  # wrong size
    (d / "0000000000000006.bin").write_bytes(b"\0" * (HEADER.size + PAYLOAD))  # wrong suffix
    (d / "0000000000000007.kv.tmp9").write_bytes(b"\0" * (HEADER.size + PAYLOAD))
    (d / "0000000000000008.kv").mkdir()  # a directory under a block's name
    os.utime(store.path(1), (300.0, 300.0))  # (atime, mtime): last use, produced at
    os.utime(store.path(2), (100.0, 50.0))
    os.utime(store.path(3), (200.0, 60.0))
    found = store.scan()
    assert found == [(2, 50.0, 100.0), (3, 60.0, 200.0), (1, 300.0, 300.0)]  # least recently used first


def test_check_writable_creates_and_reports_clearly(tmp_path: Path):
    made = check_writable(str(tmp_path / "a" / "b"))
    assert made.is_dir() and list(made.iterdir()) == []  # the probe is gone
    blocker = tmp_path / "somefile"
    blocker.write_text("not a directory")
    for bad in (blocker / "sub", blocker):
        with pytest.raises(InvalidRequestError) as e:
            check_writable(str(bad))
        assert e.value.param == "kv_disk_dir"
        assert e.value.message.startswith(f"--kv-disk-dir {bad}: not a writable directory (")
    with pytest.raises(InvalidRequestError, match="not a writable directory"):
        DiskKVStore(str(blocker / "sub"), "ident", "w0", PAYLOAD)
    with pytest.raises(InvalidRequestError, match="not a writable directory"):
        check_writable("/proc/pdserve-kv-test")


def test_model_identity_changes_with_what_the_bytes_mean(tmp_path: Path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    (model / "model.safetensors").write_bytes(b"\1" * 4096)
    base = model_identity(model, "float32", 16, "L2HBD")
    assert base == model_identity(model, "float32", 16, "L2HBD")  # stable
    assert len(base) == 24 and all(c in "0123456789abcdef" for c in base)
    others = {
        model_identity(model, "bfloat16", 16, "L2HBD"),
        model_identity(model, "float32", 32, "L2HBD"),
        model_identity(model, "float32", 16, "other"),
    }
    (model / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 3}))
    others.add(model_identity(model, "float32", 16, "L2HBD"))
    (model / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    assert model_identity(model, "float32", 16, "L2HBD") == base
    (model / "model.safetensors").write_bytes(b"\1" * 4095 + b"\2")  # other weights, same size
    others.add(model_identity(model, "float32", 16, "L2HBD"))
    (model / "model.safetensors").write_bytes(b"\1" * 4096)
    (model / "model-2.safetensors").write_bytes(b"\1")  # one more weight file
    others.add(model_identity(model, "float32", 16, "L2HBD"))
    assert base not in others and len(others) == 6


# ---- TierIO with real tensors ---------------------------------------------------------------------------
LAYERS, HKV, NUM_BLOCKS, BS, D = 2, 2, 8, 4, 8


def device_layers(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, HKV, NUM_BLOCKS, BS, D, generator=g) for _ in range(LAYERS)]


def block(layers: list[torch.Tensor], block_id: int) -> torch.Tensor:
    return torch.stack([layer[:, :, block_id] for layer in layers])


@pytest.fixture
def tier_io(tmp_path: Path):
    layers = device_layers()
    host = HostKVStore(4, LAYERS, HKV, BS, D, torch.float32)
    disk = DiskKVStore(str(tmp_path), "ident", "w0", host.slot_nbytes)
    io = TierIO(layers, host, disk, disk_blocks=16)
    yield io
    io.close()


def run(io: TierIO, *ops: KVOp) -> dict[int, dict[int, str]]:
    io.submit(ops)
    io.drain()
    done = dict(io.poll())
    assert set(done) == {op.op_id for op in ops}
    assert io.poll() == []  # each reported once
    return done


def test_capacity(tier_io: TierIO):
    nbytes = LAYERS * 2 * HKV * BS * D * 4
    assert tier_io.host.slot_nbytes == nbytes
    assert (tier_io.capacity.host_blocks, tier_io.capacity.disk_blocks, tier_io.capacity.block_bytes) == (
        4, 16, nbytes)
    assert tier_io.restored() == []


def test_offload_flush_prefetch_load_round_trips_exactly(tier_io: TierIO):
    layers = tier_io.layers
    original = {b: block(layers, b).clone() for b in (1, 3)}
    done = run(tier_io, KVOp(0, "offload", (0x11, 0x33), src=(1, 3), dst=(2, 0)))
    assert done == {0: {}}
    assert torch.equal(tier_io.host.data[2], original[1]) and torch.equal(tier_io.host.data[0], original[3])
    assert run(tier_io, KVOp(1, "flush", (0x11, 0x33), src=(2, 0))) == {1: {}}
    assert {t[0] for t in tier_io.restored()} == {0x11, 0x33}
    tier_io.host.data.zero_()
    assert run(tier_io, KVOp(2, "prefetch", (0x33, 0x11), dst=(1, 3))) == {2: {}}
    assert torch.equal(tier_io.host.data[3], original[1]) and torch.equal(tier_io.host.data[1], original[3])
    before = {b: block(layers, b).clone() for b in range(NUM_BLOCKS)}
    tier_io.load([KVLoad(5, 3), KVLoad(6, 1)])
    assert torch.equal(block(layers, 5), original[1]) and torch.equal(block(layers, 6), original[3])
    for b in set(range(NUM_BLOCKS)) - {5, 6}:  # nothing else was written
        assert torch.equal(block(layers, b), before[b])
    tier_io.load([])  # no loads: nothing to do
    assert run(tier_io, KVOp(3, "delete", (0x11,))) == {3: {}}
    assert [t[0] for t in tier_io.restored()] == [0x33]
    assert tier_io.busy_s["offload"] > 0 and tier_io.busy_s["load"] > 0


def test_prefetch_reports_missing_and_corrupt(tier_io: TierIO):
    run(tier_io, KVOp(0, "offload", (1, 2), src=(0, 1), dst=(0, 1)), KVOp(1, "flush", (1, 2), src=(0, 1)))
    path = tier_io.disk.path(2)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    done = run(tier_io, KVOp(2, "prefetch", (1, 2, 3), dst=(2, 3, 0)))
    assert done == {2: {2: "corrupt", 3: "missing"}}
    assert not path.exists()
    assert torch.equal(tier_io.host.data[2], tier_io.host.data[0])  # the good one arrived


def test_enospc_on_write_is_disk_full(tier_io: TierIO, monkeypatch):
    calls = []

    def full(self, block_hash, data, produced_at=None):
        calls.append(block_hash)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskKVStore, "write", full)
    run(tier_io, KVOp(0, "offload", (1, 2, 3), src=(0, 1, 2), dst=(0, 1, 2)))
    done = run(tier_io, KVOp(1, "flush", (1, 2, 3), src=(0, 1, 2)))
    assert done == {1: {1: "disk_full", 2: "disk_full", 3: "disk_full"}}
    assert calls == [1]  # the rest are not even tried


def test_quota_and_other_write_errors(tier_io: TierIO, monkeypatch):
    def quota(self, block_hash, data, produced_at=None):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(DiskKVStore, "write", quota)
    assert run(tier_io, KVOp(0, "flush", (1,), src=(0,))) == {0: {1: "disk_full"}}

    def eio(self, block_hash, data, produced_at=None):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(DiskKVStore, "write", eio)
    assert run(tier_io, KVOp(1, "flush", (1, 2), src=(0, 1))) == {
        1: {1: "write failed: Input/output error", 2: "write failed: Input/output error"}}


def test_an_operation_that_raises_fails_all_its_hashes_and_the_thread_goes_on(tier_io: TierIO):
    done = run(tier_io, KVOp(0, "offload", (1, 2), src=(0, 99), dst=(0, 1)))  # block 99 does not exist
    assert set(done[0]) == {1, 2} and all(why.startswith("IndexError: ") for why in done[0].values())
    assert run(tier_io, KVOp(1, "offload", (3,), src=(2,), dst=(2,))) == {1: {}}


def test_drain_waits_for_slow_operations_and_times_out(tier_io: TierIO, monkeypatch):
    gate = threading.Event()
    real_delete = DiskKVStore.delete

    def slow_delete(self, block_hash):
        gate.wait(5)
        real_delete(self, block_hash)

    monkeypatch.setattr(DiskKVStore, "delete", slow_delete)
    tier_io.submit([KVOp(0, "delete", (1,)), KVOp(1, "delete", (2,))])
    with pytest.raises(TimeoutError):
        tier_io.drain(timeout_s=0.05)
    assert tier_io.poll() == []
    gate.set()
    tier_io.drain()
    assert [op_id for op_id, _ in tier_io.poll()] == [0, 1]  # in submission order


def test_close_stops_the_thread(tmp_path: Path):
    host = HostKVStore(2, LAYERS, HKV, BS, D, torch.float32)
    io = TierIO(device_layers(), host, None)
    assert io.capacity.disk_blocks == 0 and io.restored() == []
    io.close()
    assert not any(t.is_alive() for t in io._threads)
    io.close()  # twice is fine


def test_tiered_kv_with_real_tier_io_round_trip(tmp_path: Path):
    """TieredKV's operations as TierIO reads them: offload, flush, then a disk hit prefetched and loaded."""
    layers = device_layers(seed=3)
    host = HostKVStore(2, LAYERS, HKV, BS, D, torch.float32)
    disk = DiskKVStore(str(tmp_path), "ident", "w0", host.slot_nbytes)
    io = TierIO(layers, host, disk, disk_blocks=8)
    try:
        bm = KVBlockManager(NUM_BLOCKS, BS, clock=time.monotonic)
        tiers = build_tiered_kv(bm, io.capacity, LRUPolicy(), LifecycleConfig())
        tokens = list(range(9))
        bm.allocate("a", 9, bm.find_prefix(tokens, "a"))
        bm.cache_full_blocks("a", tokens, 8)  # two full blocks registered
        ids = bm.block_ids("a")[:2]
        original = [block(layers, b).clone() for b in ids]
        bm.free("a")

        def cycle():
            io.submit(tiers.after_step())
            io.drain()
            for op_id, failures in io.poll():
                tiers.complete(op_id, failures)

        cycle()  # offload
        cycle()  # flush
        assert tiers.num_ops_in_flight == 0 and len(tiers.disk) == 2
        hashes = bm.find_prefix(tokens).block_hashes
        for h in hashes:  # forget them above the disk
            tiers.host.discard(h)
        bm.reset_prefix_cache()
        host.data.zero_()
        hit = tiers.extend(hashes)
        assert hit.waiting and hit.host == ()
        cycle()  # prefetch
        hit = tiers.extend(hashes)
        assert hit.host == tuple(hashes) and not hit.waiting
        bm.allocate("b", 9)
        fresh = bm.block_ids("b")[:2]
        loads = tiers.load(hit.host, fresh)
        io.load(loads)
        tiers.loads_done(loads)
        for b, want in zip(fresh, original):
            assert torch.equal(block(layers, b), want)
        assert tiers.stats.hit_tokens[Tier.DISK] == 2 * BS
        assert all(m.busy == 0 for m in tiers.host)
    finally:
        io.close()
