"""KV tiers with real processes: `pdserve serve` (PD mode, a small device pool), the OpenAI SDK as client.

A prompt evicted from the device pool is served from the host tier; after a restart on the same
`--kv-disk-dir`, from the disk tier; a corrupted disk file is skipped and counted; greedy output is always
the reference's. Prewarm pins a prefix and later requests report it as cached; DELETE unpins it.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from serve_util import Server, wait_for

pytestmark = pytest.mark.slow

# Distinct long prompts (~100 tokens each) so a few of them overflow a 24-block device pool.
PROMPTS = [f"Report {i}. " + " ".join(f"The {w} of item {i} is noted in the ledger." for w in
                                          ("colour", "weight", "price", "origin", "owner", "shape", "age",
                                           "state", "label"))
           for i in range(6)]
AGAIN = [p + " Again." for p in PROMPTS[4:]]  # in flight when the workers are killed
SMALL_POOL = ["--num-kv-blocks", "24", "--max-num-seqs", "4", "--block-size", "16"]


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=float(__import__("os").environ.get("T_TIMEOUT", 120)))


def _complete(server: Server, prompt: str):
    r = _client(server).completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=6,
                                           temperature=0)
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens


def _hits(server: Server, tier: str) -> float:
    return server.metric("pdserve_prefix_cache_hit_tokens_total", tier=tier, worker="decode-0")


@pytest.fixture(scope="module")
def plain_llm():
    """One engine in this process whose device pool holds every prompt here, no tiers: the reference (a server's
    greedy answers equal the engine's: tests/test_serve.py; one model load, not a server started for it)."""
    from pdserve import LLM
    llm = LLM(num_kv_blocks=600, kv_host_gb=0)
    yield llm
    del llm


@pytest.fixture(scope="module")
def reference(plain_llm) -> list[str]:
    from pdserve import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=6)  # as `_complete` asks, one prompt at a time
    return [plain_llm.generate(p, params)[0].text for p in PROMPTS + AGAIN]


def test_host_then_disk_after_restart_then_corrupt_file(tmp_path: Path, reference):
    disk = tmp_path / "kv"
    tiers = ["--kv-host-gb", "0.25", "--kv-disk-dir", str(disk), *SMALL_POOL]
    server = Server(*tiers)
    try:
        assert [_complete(server, p)[0] for p in PROMPTS] == reference[:len(PROMPTS)]  # overflows the pool
        text, cached = _complete(server, PROMPTS[0])  # evicted from the device long ago
        assert text == reference[0] and cached >= 96
        assert wait_for(lambda: _hits(server, "host"), lambda v: v > 0) > 0
        assert server.metric("pdserve_kv_tier_capacity_blocks", tier="host", worker="decode-0") > 0
        assert server.metric("pdserve_kv_tier_blocks", tier="disk") > 0
        assert server.metric("pdserve_kv_tier_bytes_total", tier="disk", direction="in") > 0
        _kill_mid_write(server)
    finally:
        server.stop()
    files = sorted(disk.glob("*/decode-0/*.kv"))
    assert files, "the decode worker's blocks should be on disk"

    server = Server(*tiers)  # a restart: the device pool and the host tier are empty, the disk is not
    try:
        text, cached = _complete(server, PROMPTS[1])
        assert text == reference[1] and cached >= 96
        # the prompts in flight when the workers were killed: whatever reached the disk is served right
        assert [_complete(server, p)[0] for p in AGAIN] == reference[len(PROMPTS):]
        assert wait_for(lambda: _hits(server, "disk"), lambda v: v > 0) > 0
        # Damage every file of prompt 2's blocks on both workers: they must be skipped, counted, recomputed.
        damaged = _damage_files_of(disk, PROMPTS[2])
        assert damaged
        text, _ = _complete(server, PROMPTS[2])
        assert text == reference[2]
        assert server.wait_metric("pdserve_kv_tier_corrupt_total", lambda v: v > 0, tier="disk") > 0
    finally:
        server.stop()


def _kill_mid_write(server: Server) -> None:
    """SIGKILL both workers while new prompts are being prefilled (their blocks are being flushed to disk)."""
    import os
    import signal
    import threading
    pids = [server.worker_pid("prefill-0"), server.worker_pid("decode-0")]
    threads = [threading.Thread(target=_complete_quietly, args=(server, p), daemon=True) for p in AGAIN]
    for t in threads:
        t.start()
    # a stimulus, not a wait for a state: the kill lands somewhere in their prefill and write-through, and
    # whatever reached the disk must be served right after the restart
    time.sleep(0.3)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


def _complete_quietly(server: Server, prompt: str) -> None:
    try:
        _complete(server, prompt)
    except openai.APIError:
        pass


def _damage_files_of(disk: Path, prompt: str) -> list[Path]:
    """Flip a payload byte in the disk files of `prompt`'s blocks (found by hashing its tokens the way the
    workers do)."""
    from pdserve.core.kvstore.block_hash import hash_blocks
    from pdserve.model.loader import resolve_model_dir
    from pdserve.tokenizer import Tokenizer
    ids = Tokenizer.from_dir(resolve_model_dir(None)).encode(prompt)
    damaged = []
    for h in hash_blocks(ids, 16):
        for path in disk.glob(f"*/*/{h:016x}.kv"):
            data = bytearray(path.read_bytes())
            data[-7] ^= 0xFF
            path.write_bytes(bytes(data))
            damaged.append(path)
    return damaged


def test_prewarm_pins_and_unpins(reference):
    server = Server("--kv-host-gb", "0", *SMALL_POOL)
    try:
        r = httpx.post(server.url + "/v1/kv/prewarm", timeout=60,
                       json={"model": "SmolLM2-135M-Instruct", "prompt": PROMPTS[3], "ttl_s": 600})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens"] > 96 and body["blocks"] == body["tokens"] // 16
        assert sorted(body["workers"]) == ["decode-0", "prefill-0"]
        assert server.wait_metric("pdserve_kv_tier_blocks", lambda v: v >= body["blocks"], stage="prewarm",
                                  worker="decode-0") >= body["blocks"]
        for p in PROMPTS[:3] + PROMPTS[4:]:  # enough traffic to evict anything that is not pinned
            _complete(server, p)
        text, cached = _complete(server, PROMPTS[3])
        assert text == reference[3] and cached >= (body["blocks"] - 1) * 16  # (the last token is computed)
        _, cached = _complete(server, PROMPTS[3] + " A later question about it follows here.")
        assert cached == body["blocks"] * 16
        assert httpx.delete(f"{server.url}/v1/kv/prewarm/{body['id']}", timeout=10).status_code == 200
        assert httpx.delete(f"{server.url}/v1/kv/prewarm/{body['id']}", timeout=10).status_code == 404
        assert server.wait_metric("pdserve_kv_tier_blocks", lambda v: v == 0, stage="prewarm") == 0
        for bad in ({"prompt": "x", "ttl_s": 0}, {"prompt": "x", "ttl_s": -5}, {"ttl_s": 10},
                    {"prompt": "x", "messages": [{"role": "user", "content": "y"}], "ttl_s": 10},
                    {"prompt": "x"}):
            r = httpx.post(server.url + "/v1/kv/prewarm", timeout=10, json=bad)
            assert r.status_code == 400 and "error" in r.json(), (bad, r.text)
        r = httpx.post(server.url + "/v1/kv/prewarm", timeout=60,
                       json={"messages": [{"role": "system", "content": PROMPTS[5]}], "ttl_s": 1})
        assert r.status_code == 200 and r.json()["blocks"] > 0
    finally:
        server.stop()


LONG = "Ledger of the mill. " + " ".join(f"Line {i}: the river carried stone number {i * 7} past the mill."
                                         for i in range(240))


@pytest.fixture(scope="module")
def long_reference(plain_llm):
    from pdserve import SamplingParams
    return plain_llm.generate(LONG, SamplingParams(temperature=0, max_tokens=8))[0]


@pytest.mark.parametrize("mode", [pytest.param("colocated", marks=pytest.mark.extended), "pd"])
def test_a_context_four_times_the_device_pool_matches_the_reference(long_reference, mode):
    """64 device blocks (1,024 tokens) per worker and a 512-token hot window; the prompt is ~4,500 tokens:
    its older blocks are read from the host tier layer by layer (PD: the prefill worker slides its window,
    the decode worker receives the prompt's head into its host tier). Same greedy tokens as a pool that
    holds it all."""
    ref = long_reference
    assert len(ref.prompt_token_ids) >= 4 * 64 * 16
    server = Server("--mode", mode, "--num-kv-blocks", "64", "--kv-host-gb", "0.5",
                    "--kv-hot-window-tokens", "512", "--max-num-batched-tokens", "512")
    try:
        r = _client(server).completions.create(model="SmolLM2-135M-Instruct", prompt=LONG, max_tokens=8,
                                               temperature=0)
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.choices[0].text == ref.text
        assert server.metric("pdserve_kv_tier_bytes_total", tier="host", direction="in") > 0
    finally:
        server.stop()


def test_a_long_decode_slides_its_own_blocks_out_of_the_hot_window_before_their_write_through_unit(plain_llm):
    """In process: a 64-token hot window (4 blocks) and a decode of 100 tokens. Decode blocks go to host in
    256-token units, so the window passes blocks not yet handed over: they are handed over and waited for,
    then leave the device (no overflow past the window), and the tokens match a pool that holds it all."""
    from pdserve import LLM, SamplingParams
    prompt, params = "The history of the city is long and full of surprises. " * 3, \
        SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    ref = plain_llm.generate(prompt, params)[0]
    llm = LLM(num_kv_blocks=600, kv_host_gb=0.05, kv_hot_window_tokens=64)
    assert llm.engine.block_manager.offload_unit > llm.engine.scheduler.window.window
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == ref.token_ids
    assert llm.engine.scheduler.window.num_overflows == 0
