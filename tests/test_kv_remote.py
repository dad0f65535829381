"""The shared KV pool (issue 41 items 1-2, 5: `--kv-remote`, `pdserve.core.kvstore.kv_remote`,
`pdserve.kv.remote_store`) on a real Mooncake master and store server, with real engines of the default model:
a prefix computed by one engine is a pool hit on another (same greedy text); the master killed mid-run loses
nothing (the engine serves from its own tiers, counted, and uses the pool again once a master is back); a damaged
value in the pool is refused, never served. Skipped, saying how to install Mooncake, where it is not usable."""

from __future__ import annotations

import time

import pytest

from pdserve.core.kvstore.kv_remote import ABSENT, DOWN, RemoteBook
from pdserve.mooncake import unavailable

MISSING = unavailable()
PROMPT = "The lighthouse keeper wrote in his log every night: the wind, the ships, the lamp. " * 4
PARAMS = dict(max_tokens=8, temperature=0.0)


def test_the_pool_book_probes_once_waits_a_bounded_time_and_backs_off():
    book = RemoteBook(probe_again_s=1.0, probe_wait_s=0.25, down_s=5.0)
    ask, waiting = book.to_probe([1, 2, 3], now=0.0)
    assert ask == [1, 2, 3] and not waiting
    assert book.to_probe([1, 2, 3], now=0.1) == ([], True)  # its answer is on the way: wait
    book.probed(1, None, 0.2), book.probed(2, None, 0.2), book.probed(3, ABSENT, 0.2)
    assert book.leading([1, 2, 3]) == 2
    assert book.to_probe([3], now=0.5) == ([], False)  # just found missing: not asked again yet
    assert book.to_probe([3], now=1.3) == ([3], False)  # asked again later
    assert book.to_probe([3], now=1.7) == ([], False) and book.slow_probes == 1  # waited long enough: go on
    book.forget(2)
    assert book.leading([1, 2]) == 1
    book.probed(7, DOWN, 2.0)
    assert not book.up(3.0) and book.to_probe([8], now=3.0) == ([], False) and book.downs == 1
    assert book.up(7.0) and book.to_probe([8], now=7.0) == ([8], False)


@pytest.fixture(scope="module")
def pool():
    if MISSING:
        pytest.skip(MISSING)
    from pdserve.mooncake import start_master
    master = start_master(pool_bytes=256 << 20)
    yield master
    master.stop()


def _llm(url: str):
    from pdserve import LLM
    return LLM(num_threads=1, kv_remote=url, kv_host_gb=0.1, kv_cache_gb=0.1)


def _written(llm, timeout_s: float = 30.0) -> bool:
    """Polls the engine's tier I/O until it has written blocks to the pool (write-through is asynchronous)."""
    engine = llm.engine
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        engine.poll_kv()
        if engine.kv_report()["bytes_in"].get("remote", 0) > 0 and engine.tiers.num_ops_in_flight == 0:
            return True
        time.sleep(0.01)
    return False


@pytest.mark.slow
def test_a_prefix_computed_by_one_engine_is_a_pool_hit_on_another_and_survives_the_master(pool):
    from pdserve import SamplingParams
    params = SamplingParams(**PARAMS)
    first = _llm(pool.url)
    text = first.generate([PROMPT], params)[0].text
    assert _written(first)
    del first
    other = _llm(pool.url)  # a fresh engine: nothing of the prompt on its device or host
    assert other.generate([PROMPT], params)[0].text == text
    report = other.engine.kv_report()
    assert report["hits"]["remote"] >= 64, report["hits"]  # (the prompt's full blocks but the last)
    assert report["bytes_out"]["remote"] > 0 and report["remote_down"] == 0

    pool.proc.kill()  # the master gone mid-run: served from its own tiers, the pool marked down (counted)
    pool.proc.wait()
    later = PROMPT.replace("night", "morning")
    assert other.generate([later], params)[0].text == _reference(later)
    assert _wait(lambda: (other.engine.poll_kv(), other.engine.kv_report()["remote_down"])[1] >= 1)
    assert other.generate([PROMPT], params)[0].text == text  # its own device cache still serves this

    from pdserve.mooncake import start_master  # the master back (where it was): the pool is used again
    pool.proc = start_master(rpc_port=pool.rpc_port, metadata_port=pool.metadata_port).proc
    written = other.engine.kv_report()["bytes_in"].get("remote", 0)
    fresh = PROMPT.replace("lighthouse", "harbour")

    def used_again() -> bool:  # (after the down spell, 5 s: each try is a new prompt, so it has new blocks)
        other.generate([fresh + str(time.monotonic())], params)
        other.engine.poll_kv()
        return other.engine.kv_report()["bytes_in"].get("remote", 0) > written
    assert _wait(used_again, timeout_s=60)


def _reference(prompt: str) -> str:
    from pdserve import LLM, SamplingParams
    return LLM(num_threads=1).generate([prompt], SamplingParams(**PARAMS))[0].text


def _wait(probe, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if probe():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_a_damaged_value_in_the_pool_is_refused_and_recomputed(tmp_path):
    if MISSING:
        pytest.skip(MISSING)
    from mooncake.store import MooncakeDistributedStore

    from pdserve import SamplingParams
    from pdserve.mooncake import start_master
    master = start_master(pool_bytes=64 << 20)
    try:
        params = SamplingParams(**PARAMS)
        first = _llm(master.url)
        text = first.generate([PROMPT], params)[0].text
        assert _written(first)
        store = first.engine.kv_io.remote
        keys = [store.key(h) for h in first.engine.tiers.remote.known]
        del first
        client = MooncakeDistributedStore()
        assert client.setup("127.0.0.1", master.metadata_url, 0, 16 << 20, "tcp", "", master.address) == 0
        for key in keys:  # every block's value: one byte of its payload changed
            value = bytearray(client.get(key))
            value[100] ^= 0x40
            assert client.upsert(key, bytes(value)) == 0
        other = _llm(master.url)
        assert other.generate([PROMPT], params)[0].text == text
        report = other.engine.kv_report()
        assert report["hits"]["remote"] == 0 and report["corrupt"].get("remote", 0) >= 1, report
        # the engine that refused them computed the blocks and wrote them afresh: the damaged values replaced
        assert _wait(lambda: (other.engine.poll_kv(), other.engine.kv_report()["bytes_in"].get("remote", 0))[1] > 0)
        third = _llm(master.url)
        assert third.generate([PROMPT], params)[0].text == text
        assert third.engine.kv_report()["hits"]["remote"] >= 64
        client.close()
    finally:
        master.stop()


@pytest.mark.parametrize("value,message", [
    ("bogus", "--kv-remote must be mooncake://HOST:PORT[?metadata=URL] or local, got 'bogus'"),
    ("mooncake://h:1?x=2", "--kv-remote: unknown parameter 'x' (only metadata=URL)"),
    ("mooncake://h:1?metadata=ftp://m", "--kv-remote: metadata must be an http(s) URL, got 'ftp://m'")])
def test_a_malformed_pool_address_is_a_one_line_cli_error(value, message):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--kv-remote", value],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"error: {message}"], proc.stderr


def test_local_is_for_serve_only():
    from pdserve.engine.config import EngineConfig
    from pdserve.errors import InvalidRequestError
    from pdserve.kv.remote_store import RemoteKVStore
    EngineConfig(kv_remote="local")  # (valid: serve resolves it before its workers start)
    with pytest.raises(InvalidRequestError, match="local is pdserve serve's"):
        RemoteKVStore("local", "identity", 1024, 0)


def test_a_slow_probe_is_counted_once_not_at_every_lookup_that_finds_it_still_out():
    book = RemoteBook(probe_again_s=1.0, probe_wait_s=0.25)
    assert book.to_probe([5, 6], now=0.0) == ([5, 6], False)
    for t in (0.3, 0.4, 0.5):  # the probe is still out: given up on once, then the prefix counts as absent
        assert book.to_probe([5, 6], now=t) == ([], False)
    assert book.slow_probes == 1
