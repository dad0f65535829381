"""`--stream-timeout-s` on a real server (issue 38; the middleware alone: tests/test_api_middleware.py): a
streaming client that stops reading is cut once the server's writes to it have waited that long, its request
is aborted in the worker and its connection closed; a client that keeps reading meanwhile is never cut, though
its stream lasts longer than that; and the server goes on serving (the `openai` SDK as client)."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time

import openai
import pytest

from serve_util import Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TIMEOUT_S = 3.0
# ~500 prompt tokens echoed with 20 logprobs each: a first event of ~0.5 MB, more than the socket buffers hold
ECHOED = " ".join(["The quick brown fox jumps over the lazy dog."] * 50)
STALLED_TOKENS = 6000  # minutes of decoding here: a request still running long after the cut was not aborted


def _stalled_stream(port: int) -> socket.socket:
    """A streaming request from a client that reads its response's head and then nothing: the echoed prompt
    fills the socket buffers at once, so the server's writes wait from its first token on. At once: the client
    advertises a small window and a small segment size, which keeps the server's kernel send buffer at
    ~70-250 kB (at loopback's 64 kB segments Linux sizes it at 4 MB)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (both before connect: what the SYN advertises)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect(("127.0.0.1", port))
    body = json.dumps({"model": MODEL, "prompt": ECHOED, "echo": True, "logprobs": 20, "stream": True,
                       "max_tokens": STALLED_TOKENS, "ignore_eos": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def _until_cut(server: Server, timeout_s: float) -> tuple[float, float, float]:
    """The gateway's metrics polled until the stalled stream is cut: (the start of the last poll before its
    first token was seen, the end of the poll that saw it, the end of the poll that saw the cut). Its first
    token (the second of the server's: the reader's came before) is when its writes began to wait: at a time
    between the first two."""
    before, first, deadline = time.monotonic(), None, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        start = time.monotonic()
        m = server.metrics()
        end = time.monotonic()
        if first is None and sum(v for (n, _), v in m.items() if n == "pdserve_time_to_first_token_seconds_count") >= 2:
            first = end
        if m.get(("pdserve_streams_cut_total", ())):
            assert first is not None, "cut before its first token"
            return before, first, end
        if first is None:
            before = start
        time.sleep(0.1)
    raise AssertionError(f"not cut in {timeout_s:.0f} s (first token seen: {first is not None})")


def _read(client: openai.OpenAI, started: threading.Event) -> tuple[list, float]:
    """A stream of 200 tokens read as it comes: its chunks and how long it took."""
    start = time.monotonic()
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=200, stream=True,
                                       temperature=0, extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True})
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        started.set()
    return chunks, time.monotonic() - start


def _closed_by_server(sock: socket.socket, timeout_s: float = 30.0) -> bool:
    """What is left in the socket read to its end: True once the server has closed the connection (what was
    buffered is a few hundred kB; a stream that went on would still be sending at the deadline)."""
    sock.settimeout(1.0)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if not sock.recv(65536):
                return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            pass
    return False


def test_a_client_that_stops_reading_is_cut_and_the_server_serves_on():
    server = Server("--stream-timeout-s", str(TIMEOUT_S))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    sock = None
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            started = threading.Event()
            reading = pool.submit(_read, client, started)  # a client that keeps reading, meanwhile
            assert started.wait(120)
            sock = _stalled_stream(server.port)
            before, first, cut = _until_cut(server, timeout_s=120)
            # cut no sooner than the timeout after its writes began to wait, nor much later (the default: 60 s)
            assert TIMEOUT_S <= cut - before and cut - first <= TIMEOUT_S + 15, (before, first, cut)
            assert _closed_by_server(sock)  # its connection closed
            chunks, took_s = reading.result(timeout=600)
        # the reader never cut, though its stream lasted longer than the timeout
        assert took_s > TIMEOUT_S, took_s  # (else this would show nothing)
        assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 200
        assert server.metric("pdserve_streams_cut_total") == 1
        assert server.wait_metric("pdserve_requests_total", lambda v: v == 1, finish_reason="length") == 1
        # the stalled request aborted in the decode worker, not decoded on to its 6,000 tokens
        assert server.wait_metric("pdserve_num_requests_running", lambda v: v == 0, timeout_s=30,
                                  worker="decode-0") == 0
        # and the server serves on
        reply = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": "Say hello."}])
        assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1
        assert server.metric("pdserve_streams_cut_total") == 1
    finally:
        if sock is not None:
            sock.close()
        server.stop()
