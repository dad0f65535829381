"""`pdserve serve` end to end: real worker processes, real sockets, the official `openai` SDK as the client.

Greedy outputs over HTTP must equal the single-process engine's, in PD mode over shm and tcp and in
colocated mode. Bad input gets OpenAI-style 4xx errors and leaves the workers running; a client that
disconnects frees its blocks on every worker; corrupted KV is never consumed; a dead prefill worker leads
to an explicit fallback; SIGTERM leaves no process behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest

from serve_util import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The capital of Japan is", "Water boils at", "List three fruits:", "The quick brown fox",
           "In 1969, astronauts"]
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a large ocean."}]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def reference():
    from pdserve import LLM, SamplingParams
    llm = LLM(num_threads=2)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    texts = [o.text for o in llm.generate(PROMPTS, params)]
    chat = llm.chat(CHAT, params)[0].text
    del llm
    return {"completions": texts, "chat": chat}


@pytest.fixture(scope="module")
def pd_server():
    server = Server()
    yield server
    server.stop()


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


def aclient(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


def check_completions_and_chat(server: Server, reference, indices=(0, 1, 2)) -> None:
    c = client(server)
    for i in indices:
        resp = c.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0)
        assert resp.choices[0].text == reference["completions"][i]
        assert resp.usage.completion_tokens <= MAX_TOKENS and resp.usage.prompt_tokens > 0
    chat = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].message.content == reference["chat"]
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_kernel_fallbacks_reach_the_metrics():
    server = Server("--mode", "colocated", env={"PDSERVE_KERNELS": "0"})  # every kernel call takes torch's path
    try:
        client(server).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        deadline = time.monotonic() + 5
        while server.metric("pdserve_fallbacks_total", kind="kernel_torch_path") == 0 and time.monotonic() < deadline:
            time.sleep(0.25)
        assert server.metric("pdserve_fallbacks_total", kind="kernel_torch_path") > 0
    finally:
        server.stop()


def test_models_and_health(pd_server):
    models = client(pd_server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(pd_server.url + "/health").json()
    assert health["status"] == "ok" and set(health["workers"]) == {"prefill-0", "decode-0"}


def test_completions_and_chat_equal_single_engine(pd_server, reference):
    check_completions_and_chat(pd_server, reference)
    assert pd_server.metric("pdserve_kv_transfer_time_seconds_count", outcome="delivered") >= 4
    deadline = time.monotonic() + 5  # worker stats arrive every second or so
    while pd_server.metric("pdserve_kv_chunks_sent_total", mode="in_place") == 0 and time.monotonic() < deadline:
        time.sleep(0.25)
    assert pd_server.metric("pdserve_kv_chunks_sent_total", mode="in_place") > 0  # shm: read in place


def test_streaming_equals_non_streaming(pd_server, reference):
    c = client(pd_server)
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == reference["completions"][0]
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS or chunks[-2].choices[0].finish_reason == "stop"
    stream = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    parts = [ch.choices[0].delta.content or "" for ch in stream]
    assert "".join(parts) == reference["chat"]


def test_eight_concurrent_streams(pd_server, reference):
    async def one(c, prompt):
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
        return "".join([ch.choices[0].text async for ch in stream])

    async def main():
        c = aclient(pd_server)
        return await asyncio.gather(*(one(c, p) for p in PROMPTS))

    assert asyncio.run(main()) == reference["completions"]


def test_stop_string_ends_the_request(pd_server, reference):
    full = reference["completions"][0]
    stop = full.strip().split()[2]
    resp = client(pd_server).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                                temperature=0, stop=[stop])
    assert resp.choices[0].text == full[:full.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("kwargs,status,param", [
    (dict(max_tokens=-1), 400, "max_tokens"),
    (dict(temperature=3.0), 400, "temperature"),
    (dict(top_p=0.0), 400, "top_p"),
    (dict(n=2), 400, "n"),
    (dict(prompt="hello " * 9000), 400, None),
    (dict(model="no-such-model"), 404, "model"),
])
def test_bad_completion_requests(pd_server, kwargs, status, param):
    body = dict(model=MODEL, prompt="Hello", max_tokens=4)
    body.update(kwargs)
    with pytest.raises(openai.APIStatusError) as info:
        client(pd_server).completions.create(**body)
    assert info.value.status_code == status
    error = info.value.body if "message" in info.value.body else info.value.body["error"]
    assert error["message"] and error["type"]
    if param:
        assert error["param"] == param
    if "prompt" in kwargs:
        assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize("messages", [[], [{"role": "wizard", "content": "hi"}], [{"content": "hi"}],
                                      [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]])
def test_malformed_chat_messages(pd_server, messages):
    with pytest.raises(openai.BadRequestError):
        client(pd_server).chat.completions.create(model=MODEL, messages=messages, max_tokens=4)


def test_raw_http_errors(pd_server):
    url = pd_server.url + "/v1/completions"
    not_json = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "invalid_request_error"
    huge = httpx.post(url, content=json.dumps({"prompt": "x" * (2 << 20)}).encode(),
                      headers={"content-type": "application/json"})
    assert huge.status_code == 413 and "error" in huge.json()
    # the workers survived all of it
    assert httpx.get(pd_server.url + "/health").json()["status"] == "ok"
    resp = client(pd_server).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert resp.usage.completion_tokens == 2


def _wait_blocks(server: Server, predicate, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        used = {dict(lab)["worker"]: v for (n, lab), v in server.metrics().items() if n == "pdserve_kv_blocks_used"}
        if used and predicate(used):
            return used
        if time.monotonic() > deadline:
            raise AssertionError(f"kv blocks used: {used}")
        time.sleep(0.2)


def test_client_disconnect_frees_blocks_on_every_worker(pd_server):
    aborted = pd_server.metric("pdserve_requests_total", finish_reason="abort")
    body = {"model": MODEL, "prompt": "Count: " + "one two three " * 60, "max_tokens": 2000, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", pd_server.url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        for _ in range(6):
            next(lines)
        _wait_blocks(pd_server, lambda used: used.get("decode-0", 0) > 0)  # the stream holds blocks now
    used = _wait_blocks(pd_server, lambda used: all(v == 0 for v in used.values()))
    assert set(used) == {"prefill-0", "decode-0"}
    assert pd_server.metric("pdserve_requests_total", finish_reason="abort") == aborted + 1


def test_non_streaming_disconnect_aborts(pd_server):
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(pd_server.url + "/v1/completions", json=body, timeout=2.0)
    _wait_blocks(pd_server, lambda used: all(v == 0 for v in used.values()))


@pytest.mark.parametrize("args", [("--transport", "tcp", "--api-key", "s3cret"), ("--mode", "colocated")],
                         ids=["tcp", "colocated"])
def test_other_shapes_equal_single_engine(reference, args):
    server = Server(*args)
    try:
        if "--api-key" in args:
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=server.url + "/v1", api_key="wrong").models.list()
            server.api_key = "s3cret"
        check_completions_and_chat(server, reference, (0, 1))
        test_eight_concurrent_streams(server, reference)
    finally:
        assert server.stop() == 0


def test_faults_corrupt_kv_dead_prefill_worker_and_clean_shutdown(reference):
    server = Server(env={"PDSERVE_FAULT_CORRUPT_CHUNKS": "1"})  # every chunk the prefill worker sends is bad
    try:
        check_completions_and_chat(server, reference, (0, 1))
        assert server.metric("pdserve_kv_transfer_failures_total", reason="failed_checksum",
                             outcome="recompute") >= 3
        assert server.metric("pdserve_kv_transfer_time_seconds_count", outcome="delivered") == 0
        pids = server.worker_pids()
        assert len(pids) == 2
        prefill_pid = min(pids)  # started first
        os.kill(prefill_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert httpx.get(server.url + "/health").json()["workers"]["prefill-0"] is False
        check_completions_and_chat(server, reference, (2,))  # decode worker serves it whole
        assert server.metric("pdserve_fallbacks_total", kind="no_prefill_worker") >= 1
    finally:
        pids = server.worker_pids()
        assert server.stop() == 0
    time.sleep(1)
    assert all(not os.path.exists(f"/proc/{pid}") or _is_zombie(pid) for pid in pids)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except OSError:
        return True
