"""The disk KV tier sealed with a key file (`pdserve.kv.block_seal`, `--kv-disk-key-file`): real files in a
temporary folder; what is on disk is never the block's bytes, a changed or moved file never opens, and a
folder sealed under another key is emptied at start and counted."""

from __future__ import annotations

import os

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.kv.block_seal import BlockSeal
from pdserve.kv.disk_store import HEADER, CorruptBlock, DiskKVStore

NBYTES = 4096
IDENTITY = "model-x"


def _key(tmp_path, name: str, secret: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(secret)
    return str(path)


def _store(tmp_path, key: str | None) -> DiskKVStore:
    seal = None if key is None else BlockSeal.from_key_file(key, IDENTITY)
    return DiskKVStore(str(tmp_path / "disk"), IDENTITY, "w0", NBYTES, seal)


def _payload(seed: int) -> bytes:
    return bytes((seed * 31 + i * 7) % 251 for i in range(NBYTES))


def test_a_sealed_block_reads_back_and_its_bytes_are_not_on_disk(tmp_path):
    store = _store(tmp_path, _key(tmp_path, "k", os.urandom(32)))
    block = _payload(1)
    store.write(0xABC, memoryview(block))
    raw = store.path(0xABC).read_bytes()
    assert len(raw) == store.file_nbytes > HEADER.size + NBYTES
    assert not any(block[i:i + 32] in raw for i in range(0, NBYTES - 32, 32))  # no 32-byte run of it
    out = bytearray(NBYTES)
    store.read_into(0xABC, memoryview(out))
    assert bytes(out) == block
    assert [h for h, _, _ in store.scan()] == [0xABC]


def test_a_changed_or_renamed_sealed_file_does_not_open_and_is_dropped(tmp_path):
    store = _store(tmp_path, _key(tmp_path, "k", os.urandom(32)))
    store.write(1, memoryview(_payload(1)))
    store.write(2, memoryview(_payload(2)))
    raw = bytearray(store.path(1).read_bytes())
    raw[HEADER.size + 100] ^= 0x01  # one bit of the ciphertext (its checksum fixed up, so the tag must catch it)
    import xxhash
    body = bytes(raw[HEADER.size:])
    magic, h, n, _, at = HEADER.unpack(bytes(raw[:HEADER.size]))
    store.path(1).write_bytes(HEADER.pack(magic, h, n, xxhash.xxh3_64_intdigest(body), at) + body)
    with pytest.raises(CorruptBlock, match="authentication failed"):
        store.read_into(1, memoryview(bytearray(NBYTES)))
    assert not store.path(1).exists()
    # block 2's file under block 3's name, its header rewritten to match: the header is the associated data
    raw2 = store.path(2).read_bytes()
    magic, _, n, check, at = HEADER.unpack(raw2[:HEADER.size])
    store.path(3).write_bytes(HEADER.pack(magic, 3, n, check, at) + raw2[HEADER.size:])
    with pytest.raises(CorruptBlock):
        store.read_into(3, memoryview(bytearray(NBYTES)))


def test_a_restart_with_another_key_starts_empty_and_says_so(tmp_path):
    first = _store(tmp_path, _key(tmp_path, "k1", os.urandom(32)))
    first.write(7, memoryview(_payload(7)))
    assert not first.key_mismatch
    again = _store(tmp_path, _key(tmp_path, "k1", (tmp_path / "k1").read_bytes()))
    assert not again.key_mismatch and [h for h, _, _ in again.scan()] == [7]
    other = _store(tmp_path, _key(tmp_path, "k2", os.urandom(32)))
    assert other.key_mismatch
    assert other.scan() == [] and not other.path(7).exists()
    assert not _store(tmp_path, str(tmp_path / "k2")).key_mismatch  # the folder is the new key's now


def test_sealed_and_plain_stores_do_not_read_each_others_files(tmp_path):
    plain = _store(tmp_path, None)
    plain.write(5, memoryview(_payload(5)))
    sealed = _store(tmp_path, _key(tmp_path, "k", os.urandom(32)))
    assert sealed.scan() == []  # a plain file is not a sealed one's size
    sealed.write(6, memoryview(_payload(6)))
    assert [h for h, _, _ in _store(tmp_path, None).scan()] == [5]


def test_a_binary_key_is_taken_whole_and_a_printable_one_without_its_newline(tmp_path):
    binary = b"\n" + os.urandom(30) + b" \n"  # whitespace at its ends is key material: 33 bytes
    assert BlockSeal.from_key_file(_key(tmp_path, "bin", binary), IDENTITY).seal(b"", b"x")
    hexed = os.urandom(32).hex().encode()
    a = BlockSeal.from_key_file(_key(tmp_path, "hex", hexed + b"\n"), IDENTITY)
    b = BlockSeal.from_key_file(_key(tmp_path, "hex2", hexed), IDENTITY)
    assert b.open(b"aad", a.seal(b"aad", b"payload")) == b"payload"  # the newline is not part of the key


def test_a_key_file_that_cannot_serve_is_a_one_line_error(tmp_path):
    with pytest.raises(InvalidRequestError, match="needs at least 32") as e:
        BlockSeal.from_key_file(_key(tmp_path, "short", b"x" * 10), IDENTITY)
    assert e.value.param == "kv_disk_key_file" and "\n" not in str(e.value)
    with pytest.raises(InvalidRequestError, match="cannot read it"):
        BlockSeal.from_key_file(str(tmp_path / "missing"), IDENTITY)
