"""`pdserve serve` end to end: real worker processes, real sockets, the official `openai` SDK as the client.

Greedy outputs over HTTP must equal the single-process engine's, in PD mode over shm and tcp (with the KV
really delivered) and in colocated mode. Bad input gets OpenAI-style 4xx errors and leaves the workers
running; a client that disconnects frees its blocks on every worker, mid-prefill too; `priority` orders
the queues; corrupted KV is never consumed; a dead prefill worker leads to an explicit fallback, a dead
decode worker restarted with its requests finishing unchanged (/health 503 meanwhile); SIGTERM leaves no
process behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import time
import uuid

import httpx
import openai
import pytest

from serve_util import Server, wait_for

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


# Long prompts are prefilled in chunks of 256 tokens: a prefill spans several steps (and the worker reads
# commands, an abort among them, between steps).
PREFILL_CHUNK = 256


@pytest.fixture(scope="module")
def pd_server():
    server = Server("--max-num-batched-tokens", str(PREFILL_CHUNK))
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


def test_kernel_fallbacks_reach_the_metrics(pd_server):
    """Kernels on (the default): no fallback on any host (choosing MKL somewhere is no fallback), once the
    worker that ran the prompt has reported its stats. Kernels off: every call counted."""
    before = pd_server.metric("pdserve_prefix_cache_query_tokens_total", worker="prefill-0")
    client(pd_server).completions.create(model=MODEL, prompt="Hi there", max_tokens=2)
    assert pd_server.wait_metric("pdserve_prefix_cache_query_tokens_total", lambda v: v > before,
                                 worker="prefill-0") > before
    assert pd_server.metric("pdserve_fallbacks_total", kind="kernel_torch_path") == 0
    server = Server("--mode", "colocated", env={"PDSERVE_KERNELS": "0"})  # every kernel call takes torch's path
    try:
        client(server).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert server.wait_metric("pdserve_fallbacks_total", lambda v: v > 0, kind="kernel_torch_path") > 0
    finally:
        server.stop()


def test_models_and_health(pd_server):
    models = client(pd_server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(pd_server.url + "/health").json()
    assert health["status"] == "ok"
    assert [(w["name"], w["role"], w["state"], w["restarts"]) for w in health["workers"]] == [
        ("prefill-0", "prefill", "ready", 0), ("decode-0", "decode", "ready", 0)]
    assert all(w["pid"] == pd_server.worker_pid(w["name"]) for w in health["workers"])


def test_completions_and_chat_equal_single_engine(pd_server, reference):
    check_completions_and_chat(pd_server, reference)
    assert pd_server.metric("pdserve_kv_transfer_time_seconds_count", outcome="delivered") >= 4
    assert pd_server.wait_metric("pdserve_kv_chunks_sent_total", lambda v: v > 0, mode="in_place") > 0  # shm: in place


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
    (dict(n=0), 400, "n"),
    (dict(prompt="hello " * 9000), 400, None),
    (dict(model="no-such-model"), 404, "model"),
])
def test_bad_completion_requests(pd_server, kwargs, status, param):
    body = dict(model=MODEL, prompt="Hello", max_tokens=4)
    body.update(kwargs)
    with pytest.raises(openai.APIStatusError) as info:
        client(pd_server).completions.create(**body)
    assert info.value.status_code == status
    error = _error(info.value)
    assert error["message"] and error["type"]
    if param:
        assert error["param"] == param
    if "prompt" in kwargs:
        assert error["code"] == "context_length_exceeded"


def _error(e: openai.APIError) -> dict:
    """OpenAI's error object from an SDK exception (the SDK unwraps `{"error": ...}` only sometimes)."""
    return e.body if "message" in e.body else e.body["error"]


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


@pytest.mark.parametrize("extra,param,code", [
    ({"temperatur": 0.5}, "temperatur", "unrecognized_argument"),  # a typo is not silently ignored
    ({"response_format": {"type": "xml"}}, "response_format.type", None),
    ({"tools": [{"type": "function", "function": {"name": "not a name!"}}]}, "tools[0]", None),
    ({"logit_bias": {"50256": -100}}, "logit_bias", "unsupported_parameter"),
    ({"guided_choice": "yes"}, "guided_choice", None),
    ({"min_p": 0.1}, "min_p", "unsupported_parameter"),
    ({"stream_options": {"include_usage": True, "bogus": 1}}, "stream_options.bogus", None),
])
def test_no_parameter_is_silently_ignored(pd_server, extra, param, code):
    with pytest.raises(openai.BadRequestError) as info:
        client(pd_server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=2, stream="stream_options" in extra, extra_body=extra)
    error = _error(info.value)
    assert error["param"] == param and (code is None or error["code"] == code), error


def test_neutral_values_of_unsupported_parameters_and_user_are_accepted(pd_server):
    resp = client(pd_server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi", "name": "ann"}], max_tokens=2, user="u-1",
        extra_body={"response_format": {"type": "text"}, "tool_choice": "none", "logit_bias": {}, "best_of": 1})
    assert resp.usage.completion_tokens == 2


def test_tokenize_detokenize_version_and_continuous_usage(pd_server):
    text = "The capital of France is Paris."
    tok = httpx.post(pd_server.url + "/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > 0
    assert httpx.post(pd_server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == text
    chat = httpx.post(pd_server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] == client(pd_server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1).usage.prompt_tokens
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    with_tools = httpx.post(pd_server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}],
                                                              "tools": [tool]}).json()
    assert with_tools["count"] > chat["count"] and with_tools["count"] == client(pd_server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], tools=[tool], max_tokens=1).usage.prompt_tokens
    bad = httpx.post(pd_server.url + "/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.get(pd_server.url + "/version").json()["version"]
    chunks = list(client(pd_server).completions.create(
        model=MODEL, prompt="Once", max_tokens=6, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert counts == sorted(counts) and counts[-1] == 6 and len(counts) > 2  # usage so far, in every chunk


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


def test_client_disconnect_during_prefill_aborts_the_prefill(pd_server):
    """The client leaves while its long prompt is still being prefilled: the prefill worker must stop it
    (blocks freed, the prefill never completes), not finish work nobody will read."""
    prefills = pd_server.metric("pdserve_request_prefill_time_seconds_count", worker_role="prefill")
    aborted = pd_server.metric("pdserve_requests_total", finish_reason="abort")
    rng = random.Random(uuid.uuid4().int)  # fresh tokens: nothing of it is in any prefix cache
    # 24 chunks: still prefilling when the abort lands, even on a fast machine (the test only waits for ~2)
    prompt = [rng.randrange(1000, 40000) for _ in range(24 * PREFILL_CHUNK)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", pd_server.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        _wait_blocks(pd_server, lambda used: used.get("prefill-0", 0) > 0)  # its first chunk is computed
    _wait_blocks(pd_server, lambda used: all(v == 0 for v in used.values()))
    assert pd_server.metric("pdserve_request_prefill_time_seconds_count", worker_role="prefill") == prefills
    assert pd_server.metric("pdserve_requests_total", finish_reason="abort") == aborted + 1


def test_non_streaming_disconnect_aborts(pd_server):
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(pd_server.url + "/v1/completions", json=body, timeout=2.0)
    _wait_blocks(pd_server, lambda used: all(v == 0 for v in used.values()))


SHAPES = {"tcp": ("--transport", "tcp", "--api-key", "s3cret"), "colocated": ("--mode", "colocated")}
# Two requests at a time per worker: enough to batch, few enough that a queue (whose order the priority
# policy decides) forms at once.
QUEUE_ARGS = ("--queue-policy", "priority", "--max-num-seqs", "2")


@pytest.fixture(scope="module", params=list(SHAPES))
def shape_server(request):
    server = Server(*SHAPES[request.param], *QUEUE_ARGS)
    server.shape = request.param
    if "--api-key" in server.args:
        server.api_key = "s3cret"
    yield server
    assert server.stop() == 0


def test_other_shapes_equal_single_engine(shape_server, reference):
    server = shape_server
    if "--api-key" in server.args:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong").models.list()
    delivered = server.metric("pdserve_kv_transfer_time_seconds_count", outcome="delivered")
    check_completions_and_chat(server, reference, (0, 1))
    if server.shape == "tcp":  # the KV travelled and was used: no recompute stood in for it
        assert server.metric("pdserve_kv_transfer_time_seconds_count", outcome="delivered") >= delivered + 3
    test_eight_concurrent_streams(server, reference)
    if server.shape == "tcp":
        assert server.metric("pdserve_kv_transfer_failures_total") == 0
        assert server.metric("pdserve_kv_transfer_time_seconds_count", outcome="recompute") == 0
        assert server.wait_metric("pdserve_kv_chunks_sent_total", lambda v: v > 0, worker="prefill-0",
                                  mode="payload") > 0  # tcp: the bytes travel
        assert server.metric("pdserve_kv_chunks_sent_total", mode="in_place") == 0


def test_priority_serves_an_urgent_request_before_queued_ones(shape_server):
    """Both slots busy, two priority-10 requests queue, then a priority -1 one arrives: it is served first
    (lower value first, as in vLLM), on the decode worker in PD mode as in colocated mode."""
    server, order = shape_server, []

    async def run(c, name: str, priority: int, max_tokens: int, started: asyncio.Event | None = None):
        async with await c.completions.create(
                model=MODEL, prompt=f"Request {name} says", max_tokens=max_tokens, temperature=0, stream=True,
                extra_body={"priority": priority, "ignore_eos": True}) as stream:
            async for _ in stream:
                if started is not None:
                    started.set()
        order.append(name)

    async def main():
        c = aclient(server)
        started = [asyncio.Event(), asyncio.Event()]
        # `short` frees a slot after a while; `long` keeps the other one until the queue has drained.
        short = asyncio.create_task(run(c, "short", 0, 64, started[0]))
        long = asyncio.create_task(run(c, "long", 0, 2000, started[1]))
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        queued = [asyncio.create_task(run(c, f"low{i}", 10, 4)) for i in range(2)]
        assert await asyncio.to_thread(wait_for, lambda: server.metric("pdserve_num_requests_waiting") >= 2)
        queued.append(asyncio.create_task(run(c, "urgent", -1, 4)))
        assert await asyncio.to_thread(wait_for, lambda: server.metric("pdserve_num_requests_waiting") >= 3)
        assert not short.done()  # the queue formed behind both slots
        await asyncio.wait_for(asyncio.gather(short, *queued), 120)
        long.cancel()  # the client leaves: the request is aborted
        await asyncio.gather(long, return_exceptions=True)

    asyncio.run(main())
    assert order[:2] == ["short", "urgent"] and sorted(order[2:]) == ["low0", "low1"]
    _wait_blocks(server, lambda used: all(v == 0 for v in used.values()))  # `long` aborted everywhere


def test_listeners_bind_loopback_and_a_foreign_kv_peer_is_refused(shape_server, reference):
    """Every listening socket of the server's processes is on loopback; the tcp transport reads nothing from a
    connection without this deployment's hello (`pdserve.transfer.peer_auth`): refused and counted."""
    import psutil
    server = shape_server
    procs = [psutil.Process(server.proc.pid), *(psutil.Process(p) for p in server.worker_pids())]
    listening = [c.laddr for p in procs for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening and all(addr.ip in ("127.0.0.1", "::1") for addr in listening), listening
    if server.shape != "tcp":
        return
    from pdserve.transfer.peer_auth import hello
    decode = psutil.Process(server.worker_pid("decode-0"))
    (port,) = [c.laddr.port for c in decode.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
    for payload in (b"\xff" * 64, hello(b"not this deployment's secret....") + b"\x00" * 64):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(payload)
            s.settimeout(10)
            try:
                assert s.recv(1) == b""  # closed on us
            except ConnectionResetError:  # (closed with our bytes unread)
                pass
    assert wait_for(lambda: server.metric("pdserve_rejected_connections_total", endpoint="kv_tcp") == 2)
    check_completions_and_chat(server, reference, (0,))  # our own peers are served as before


def test_a_foreign_process_cannot_command_a_worker_or_speak_for_one(shape_server, reference):
    """The ZeroMQ sockets (commands, events, shm ring announcements) speak CurveZMQ with the deployment's keys
    (`pdserve.transfer.zmq_auth`): a plain socket or one with keys of its own is refused, and counted."""
    import msgpack
    import zmq
    server = shape_server
    name = "colocated-0" if server.shape == "colocated" else "decode-0"
    pid = server.worker_pid(name)
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        spec = json.loads(f.read().split(b"\0")[-2])
    targets = [(spec["cmd_addr"], {"type": "shutdown"}), (spec["event_addr"], {"type": "ready", "worker": name})]
    if spec["transport"] != "tcp":  # its KV receiver takes shm ring announcements there
        targets.append((spec["kv_addr"], {"ring": "psm_forged"}))
    before = {e: server.metric("pdserve_rejected_connections_total", endpoint=e) for e in ("control", "kv_shm")}
    ctx = zmq.Context()
    try:
        for addr, message in targets:
            for curve in (False, True):
                sock = ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                if curve:  # CURVE with keys of its own: it cannot know the deployment's
                    public, secret = zmq.curve_keypair()
                    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, public
                sock.connect(addr)
                try:
                    sock.send(msgpack.packb(message), zmq.NOBLOCK)  # never delivered: no handshake succeeds
                except zmq.Again:
                    pass

        def refused(endpoint: str) -> float:
            return server.metric("pdserve_rejected_connections_total", endpoint=endpoint) - before[endpoint]

        assert wait_for(lambda: refused("control") >= 4)
        if len(targets) == 3:
            assert wait_for(lambda: refused("kv_shm") >= 2)
        check_completions_and_chat(server, reference, (0,))  # the worker got no shutdown, nor the gateway a lie
        assert server.worker_pid(name) == pid
    finally:
        ctx.destroy(linger=0)


def test_the_only_decode_worker_killed_is_restarted_and_its_requests_finish_unchanged(shape_server):
    """SIGKILL the worker that decodes a stream and a non-streaming request (the only one that can): /health
    turns 503 (`unavailable`, the worker `dead` then `starting`), the worker is restarted, registers again, and
    both requests then finish on it with the text an undisturbed run gives (they waited for it, nothing lost).
    Runs last on its server."""
    server = shape_server
    name = "decode-0" if server.shape == "tcp" else "colocated-0"
    body = dict(model=MODEL, max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
    prompts = ("Tell me a long story.", "Count to a thousand:")
    reference = [client(server).completions.create(prompt=p, **body).choices[0].text for p in prompts]
    before = httpx.get(server.url + "/health").json()
    (entry,) = [w for w in before["workers"] if w["name"] == name]
    assert entry["state"] == "ready" and entry["restarts"] == 0 and entry["pid"] == server.worker_pid(name)
    healths = []

    async def main():
        c = aclient(server).with_options(timeout=120)
        whole = asyncio.create_task(c.completions.create(prompt=prompts[0], **body))
        stream = await c.completions.create(prompt=prompts[1], stream=True, **body)
        text = (await anext(stream)).choices[0].text
        assert await asyncio.to_thread(
            wait_for, lambda: server.metric("pdserve_num_requests_running", worker=name) >= 2)
        os.kill(server.worker_pid(name), signal.SIGKILL)
        healths.append(await asyncio.to_thread(  # once the gateway has seen it die
            wait_for, lambda: httpx.get(server.url + "/health"), lambda r: r.status_code == 503, 30))
        async for chunk in stream:
            text += chunk.choices[0].text
        return [(await whole).choices[0].text, text]

    assert asyncio.run(main()) == reference
    dead = healths[0]
    assert dead.status_code == 503 and dead.json()["status"] == "unavailable"
    assert {w["name"]: w["state"] for w in dead.json()["workers"]}[name] in ("dead", "starting")
    after = httpx.get(server.url + "/health")
    (entry,) = [w for w in after.json()["workers"] if w["name"] == name]
    assert after.status_code == 200 and entry["state"] == "ready" and entry["restarts"] == 1
    assert entry["pid"] == server.worker_pid(name)
    assert server.metric("pdserve_worker_deaths_total", worker=name) == 1
    assert server.metric("pdserve_requests_migrated_total", reason="worker_died") >= 1


def test_faults_corrupt_kv_dead_prefill_worker_and_clean_shutdown(reference):
    # every chunk the prefill worker sends is bad; a dead worker stays dead
    server = Server("--no-restart-workers", env={"PDSERVE_FAULT_CORRUPT_CHUNKS": "1"})
    try:
        check_completions_and_chat(server, reference, (0, 1))
        assert server.metric("pdserve_kv_transfer_failures_total", reason="failed_checksum",
                             outcome="recompute") >= 3
        assert server.metric("pdserve_kv_transfer_time_seconds_count", outcome="delivered") == 0
        assert len(server.worker_pids()) == 2
        os.kill(server.worker_pid("prefill-0"), signal.SIGKILL)
        wait_for(lambda: httpx.get(server.url + "/health").json()["status"] == "degraded", timeout_s=10)
        health = httpx.get(server.url + "/health")  # the decode worker serves on: 200, degraded
        states = {w["name"]: (w["role"], w["state"]) for w in health.json()["workers"]}
        assert health.status_code == 200 and states == {"prefill-0": ("prefill", "dead"),
                                                        "decode-0": ("decode", "ready")}
        check_completions_and_chat(server, reference, (2,))  # decode worker serves it whole
        assert server.metric("pdserve_fallbacks_total", kind="no_prefill_worker") >= 1
    finally:
        pids = server.worker_pids()
        assert server.stop() == 0
    assert wait_for(lambda: all(not os.path.exists(f"/proc/{pid}") or _is_zombie(pid) for pid in pids))


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except OSError:
        return True
