"""The disk KV tier sealed with `--kv-disk-key-file` on a real server (the default model, PD): every block file
on disk is sealed, opens with the key, and holds no run of its block's plain bytes; a restart with the key serves disk hits; a restart with another key empties the folder,
counts it, and answers exactly as before."""

from __future__ import annotations

import os
from pathlib import Path

import openai
import pytest

from serve_util import Server, wait_for

pytestmark = pytest.mark.slow

PROMPT = "Ledger. " + " ".join(f"The {w} of the first item is noted in the ledger." for w in
                               ("colour", "weight", "price", "origin", "owner", "shape", "age", "state"))
TIERS = ["--kv-host-gb", "0.25", "--num-kv-blocks", "24", "--max-num-seqs", "4", "--block-size", "16"]


def _complete(server: Server, prompt: str = PROMPT) -> tuple[str, int]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=6, temperature=0)
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens


def _files(disk: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in disk.glob("*/decode-0/*.kv")}


def _fill_and_stop(server: Server, disk: Path) -> tuple[str, dict[str, bytes]]:
    """Answer PROMPT, then evict it from the device with other prompts (so its blocks reach the disk)."""
    try:
        text, _ = _complete(server)
        for i in range(4):
            _complete(server, f"Other {i}. " + PROMPT.replace("first", f"other {i}"))
        wait_for(lambda: len(_files(disk)), lambda n: n >= 6, timeout_s=60)
        return text, _files(disk)
    finally:
        server.stop()


def _opened(raw: bytes, key: Path, identity: str) -> bytes:
    """A sealed file's block, opened with `key` (as `DiskKVStore.read_into` does)."""
    from pdserve.kv.block_seal import OVERHEAD, BlockSeal
    from pdserve.kv.disk_store import HEADER
    magic, block_hash, nbytes, _, produced_at = HEADER.unpack(raw[:HEADER.size])
    aad = HEADER.pack(magic, block_hash, nbytes - OVERHEAD, 0, produced_at)
    return BlockSeal.from_key_file(str(key), identity).open(aad, raw[HEADER.size:])


def test_sealed_disk_tier_never_holds_plain_kv_and_another_key_starts_empty(tmp_path: Path):
    key, other = tmp_path / "kv.key", tmp_path / "other.key"
    key.write_bytes(os.urandom(32))
    other.write_bytes(os.urandom(32))
    sealed_dir = tmp_path / "sealed"
    sealed_args = [*TIERS, "--kv-disk-dir", str(sealed_dir), "--kv-disk-key-file"]
    reference, sealed = _fill_and_stop(Server(*sealed_args, str(key)), sealed_dir)
    assert len(sealed) >= 6 and all(raw.startswith(b"PDKVENC1") for raw in sealed.values())
    identity = next(sealed_dir.iterdir()).name
    for name, raw in sealed.items():  # each opens with the key, and none of its block's bytes are in the file
        block = _opened(raw, key, identity)
        assert len(block) == len(raw) - 64 - 28 and any(block)
        assert not any(block[i:i + 64] in raw for i in range(0, len(block) - 64, 4096)), name

    server = Server(*sealed_args, str(key))  # the same key: its blocks come back from disk
    try:
        text, cached = _complete(server)
        assert text == reference and cached >= 96
    finally:
        server.stop()

    server = Server(*sealed_args, str(other))  # another key: the folder is emptied, counted, never read
    try:
        text, cached = _complete(server)
        assert (text, cached) == (reference, 0)
        assert server.wait_metric("pdserve_fallbacks_total", lambda v: v >= 1, kind="kv_disk_key_mismatch") >= 1
        assert server.metric("pdserve_kv_tier_corrupt_total", tier="disk") == 0  # nothing was tried
    finally:
        server.stop()
    after = _files(sealed_dir)  # the old files are gone; PROMPT's blocks were written again, under the new key
    assert after and all(after[name] != raw for name, raw in sealed.items() if name in after)


def _block_files(disk: Path, prompt: str) -> list[Path]:
    """The disk files of `prompt`'s blocks on any worker (its tokens hashed the way the workers do)."""
    from pdserve.core.kvstore.block_hash import hash_blocks
    from pdserve.model.loader import resolve_model_dir
    from pdserve.tokenizer import Tokenizer
    ids = Tokenizer.from_dir(resolve_model_dir(None)).encode(prompt)
    return [p for h in hash_blocks(ids, 16) for p in disk.glob(f"*/*/{h:016x}.kv")]


def test_a_secret_requests_kv_never_reaches_a_disk_tier_without_a_key(tmp_path: Path):
    disk = tmp_path / "kv"
    server = Server(*TIERS, "--kv-disk-dir", str(disk))
    secret = "Secret. " + PROMPT
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        client.completions.create(model="SmolLM2-135M-Instruct", prompt=secret, max_tokens=6, temperature=0,
                                  extra_body={"kv_sensitivity": "secret"})
        _complete(server)  # an internal one: its blocks go down to disk
        for i in range(4):  # push both out of the device pool, through host to disk
            _complete(server, f"Other {i}. " + PROMPT.replace("first", f"other {i}"))
        assert wait_for(lambda: len(_block_files(disk, PROMPT)), lambda n: n >= 8, timeout_s=60) >= 8
        assert server.wait_metric("pdserve_fallbacks_total", lambda v: v >= 8, kind="kv_secret_off_disk") >= 8
        assert _block_files(disk, secret) == []  # on neither worker
    finally:
        server.stop()
