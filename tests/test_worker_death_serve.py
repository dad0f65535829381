"""Worker death without a lost request, with real processes and the `openai` SDK (issue 15): kill -9 a decode
worker while its requests stream; each goes on on the other decode worker (from its KV checkpoint: the blocks
the dead worker wrote through to its disk tier, the rest computed there), and every client's text is the one an
undisturbed run gives, greedy and seeded alike. The
dead worker is restarted and registers again; then a SIGSTOP'd worker is taken for hung after the heartbeat
timeout, killed, its streams moved the same way, and restarted."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest

from serve_util import Server, wait_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TOKENS = 40
LONG = 160  # the SIGSTOP half: long enough that streams are still running when the worker is stopped
HEARTBEAT_S = 4.0


def _requests() -> list[dict]:
    out = []
    for i in range(4):
        sampled = {"temperature": 0.8, "seed": 100 + i} if i % 2 else {"temperature": 0}
        out.append({"prompt": f"Tale {i}: once upon a time, in a village by the sea,", **sampled})
    return out


async def _stream(client, req: dict, started: asyncio.Event | None, after: int = 6, tokens: int = TOKENS) -> str:
    text, chunks = "", 0
    stream = await client.completions.create(model=MODEL, max_tokens=tokens, stream=True,
                                             extra_body={"ignore_eos": True}, **req)
    async for chunk in stream:
        text += chunk.choices[0].text
        chunks += 1
        if started is not None and chunks >= after:
            started.set()
    return text


def test_a_killed_decode_workers_streams_go_on_elsewhere_unchanged(tmp_path):
    # with a disk tier: the killed worker's requests resume from their KV checkpoints (the recompute path,
    # with no disk tier: `test_serve.py`'s restart test)
    server = Server("--prefill", "1", "--decode", "2", "--heartbeat-timeout-s", str(HEARTBEAT_S),
                    "--kv-disk-dir", str(tmp_path / "kv"), "--kv-checkpoint-tokens", "16")
    try:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        reqs = _requests()

        async def undisturbed(tokens: int = TOKENS) -> list[str]:
            return await asyncio.gather(*(_stream(client, r, None, tokens=tokens) for r in reqs))

        async def disturbed() -> list[str]:
            started = [asyncio.Event() for _ in reqs]
            tasks = [asyncio.create_task(_stream(client, r, e, after=20)) for r, e in zip(reqs, started)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            os.kill(victim, signal.SIGKILL)  # every stream is half way: half of them on this worker
            return await asyncio.gather(*tasks)

        victim = server.worker_pid("decode-0")
        reference = asyncio.run(undisturbed())
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        long_reference = asyncio.run(undisturbed(LONG))
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        texts = asyncio.run(disturbed())
        assert texts == reference
        assert server.wait_metric("pdserve_worker_deaths_total", lambda v: v >= 1, worker="decode-0") == 1
        # each had a checkpoint (its prompt's and first outputs' blocks on disk): resumed from there
        assert server.metric("pdserve_requests_migrated_total", reason="worker_died", source="checkpoint") >= 1
        assert server.metric("pdserve_requests_migrated_total", reason="worker_died", source="recompute") == 0
        assert server.metric("pdserve_fallbacks_total", kind="kv_checkpoint_missing") == 0
        # the survivors serve on, and nothing of the dead worker's is held by the prefill worker
        again = asyncio.run(undisturbed_again(server, reqs[:1]))
        assert again == reference[:1]
        assert server.metric("pdserve_kv_transfers_lent", worker="prefill-0") == 0
        # decode-0 comes back: restarted, registered, ready
        assert wait_for(lambda: _states(server)["decode-0"] == ("ready", 1), timeout_s=60), _states(server)
        # a stopped worker (SIGSTOP: alive, silent) is taken for hung once the heartbeat times out: killed,
        # its streams go on elsewhere, unchanged, and it is restarted too. The victim: the decode worker with
        # the most of them (the restarted one may have been given all, or none)
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        stopped = []

        async def stopped_mid_stream() -> list[str]:
            started = [asyncio.Event() for _ in reqs]
            tasks = [asyncio.create_task(_stream(client, r, e, after=2, tokens=LONG))
                     for r, e in zip(reqs, started)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            running = await _running_everywhere(server, len(reqs))
            name = max(running, key=running.get)
            assert running[name] >= 1 and not any(t.done() for t in tasks), running
            stopped.extend([name, time.monotonic()])
            os.kill(server.worker_pid(name), signal.SIGSTOP)
            return await asyncio.gather(*tasks)

        assert asyncio.run(stopped_mid_stream()) == long_reference
        name, at = stopped
        assert time.monotonic() - at >= HEARTBEAT_S  # they waited for the heartbeat, then moved
        assert server.metric("pdserve_requests_migrated_total", reason="worker_hung") >= 1
        assert wait_for(lambda: _states(server)[name][0] == "ready", timeout_s=60), _states(server)
        assert server.metric("pdserve_worker_deaths_total", worker=name) >= 1
    finally:
        server.stop()


async def undisturbed_again(server: Server, reqs: list[dict]) -> list[str]:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    try:
        return await asyncio.gather(*(_stream(client, r, None) for r in reqs))
    finally:
        await client.close()


async def _running_everywhere(server: Server, count: int, timeout_s: float = 10.0) -> dict[str, float]:
    """The decode workers' running requests once their stats reports (every 0.25 s) count all `count` streams
    (else as last seen, after `timeout_s`); polled without blocking the streams' loop."""
    def running() -> dict[str, float]:
        return {w: server.metric("pdserve_num_requests_running", worker=w) for w in ("decode-0", "decode-1")}
    return await asyncio.to_thread(wait_for, running, lambda r: sum(r.values()) >= count, timeout_s)


def _states(server: Server) -> dict:
    return {w["name"]: (w["state"], w["restarts"]) for w in httpx.get(server.url + "/health").json()["workers"]}


@pytest.mark.parametrize("where", ["disk", "pool"])
def test_a_killed_colocated_workers_streams_resume_from_their_checkpoints(tmp_path, where):
    # colocated: the survivor adopts the dead worker's checkpoint (its disk files, or what it wrote to the shared
    # pool: no shared filesystem) and computes the rest itself
    if where == "pool":
        from pdserve.mooncake import unavailable
        if unavailable():
            pytest.skip(unavailable())
    kv = ["--kv-disk-dir", str(tmp_path / "kv")] if where == "disk" else ["--kv-remote", "local",
                                                                         "--kv-remote-pool-gb", "0.25"]
    server = Server("--mode", "colocated", "--instances", "2", "--heartbeat-timeout-s", str(HEARTBEAT_S),
                    *kv, "--kv-checkpoint-tokens", "16")
    try:
        reqs = _requests()

        async def run(kill: bool) -> list[str]:
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
            started = [asyncio.Event() for _ in reqs]
            tasks = [asyncio.create_task(_stream(client, r, e, after=20)) for r, e in zip(reqs, started)]
            if kill:
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
                deadline = time.monotonic() + 60  # a request of colocated-0's has its first blocks on disk
                while server.metric("pdserve_kv_checkpoints_total", worker="colocated-0") < 1:
                    assert time.monotonic() < deadline, "no checkpoint recorded"
                    await asyncio.sleep(0.1)
                os.kill(server.worker_pid("colocated-0"), signal.SIGKILL)
            try:
                return await asyncio.gather(*tasks)
            finally:
                await client.close()

        reference = asyncio.run(run(kill=False))
        assert asyncio.run(run(kill=True)) == reference
        assert server.wait_metric("pdserve_worker_deaths_total", lambda v: v >= 1, worker="colocated-0") == 1
        assert server.metric("pdserve_requests_migrated_total", reason="worker_died", source="checkpoint") >= 1
        assert server.metric("pdserve_fallbacks_total", kind="kv_checkpoint_missing") == 0
        if where == "pool":  # the survivor read the dead worker's blocks from the pool
            assert server.wait_metric("pdserve_prefix_cache_hit_tokens_total", lambda v: v >= 16,
                                      worker="colocated-1", tier="remote")
    finally:
        server.stop()
