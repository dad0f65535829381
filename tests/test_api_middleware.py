"""The gateway's ASGI seams without workers: a client that stops reading is cut after the stream timeout
(and the response's generator closed, which is what aborts its request), API keys with their tiers, and the
keys file's errors."""

from __future__ import annotations

import asyncio

import pytest
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from pdserve.errors import InvalidRequestError
from pdserve.server.api import ON_CUT, SendTimeout
from pdserve.server.launch import ServeConfig, api_keys
from pdserve.server.metrics import Metrics


def test_a_client_that_stops_reading_is_cut_and_its_request_aborted():
    aborted = []

    async def tokens():
        for i in range(1000):
            yield f"data: {i}\n\n"
            await asyncio.sleep(0)

    def handler(request):
        request.scope.setdefault(ON_CUT, []).append(lambda: aborted.append("r1"))  # as the completions route
        return StreamingResponse(tokens())

    app = Starlette(routes=[Route("/s", handler)])
    metrics = Metrics()
    sent = []

    async def send(message):
        sent.append(message)
        if len(sent) > 3:
            await asyncio.Event().wait()  # the client's window is full: a write never completes

    async def receive():
        await asyncio.Event().wait()

    async def run(timeout_s: float):
        scope = {"type": "http", "method": "GET", "path": "/s", "headers": [], "query_string": b"",
                 "root_path": "", "scheme": "http", "server": ("x", 80), "http_version": "1.1",
                 "asgi": {"version": "3.0", "spec_version": "2.3"}}  # as uvicorn's
        await asyncio.wait_for(SendTimeout(app, timeout_s, metrics)(scope, receive, send), timeout_s + 5)

    asyncio.run(run(0.2))
    assert metrics.streams_cut._value.get() == 1 and len(sent) == 4 and aborted == ["r1"]
    sent.clear()
    # a reader that keeps up is never cut
    asyncio.run(asyncio.wait_for(_fast_reader(app, metrics), 30))
    assert metrics.streams_cut._value.get() == 1 and aborted == ["r1"]


async def _fast_reader(app, metrics) -> None:
    got = []

    async def send(message):
        got.append(message)

    async def receive():
        await asyncio.Event().wait()

    scope = {"type": "http", "method": "GET", "path": "/s", "headers": [], "query_string": b"", "root_path": "",
             "scheme": "http", "server": ("x", 80), "http_version": "1.1", "asgi": {"spec_version": "2.4"}}
    await SendTimeout(app, 0.2, metrics)(scope, receive, send)
    assert got[-1]["type"] == "http.response.body" and not got[-1].get("more_body")


def test_api_keys_from_flags_and_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\nalpha flex\n\nbeta\ngamma priority\ndelta secret\nomega public flex\n")
    cfg = ServeConfig(api_key=("k1", "k2"), api_key_tier="default", api_keys_file=str(path))
    assert {k: v.tier for k, v in api_keys(cfg).items()} == {
        "k1": "default", "k2": "default", "alpha": "flex", "beta": "default", "gamma": "priority",
        "delta": "default", "omega": "flex"}
    # the KV sensitivity column (issue 40): a label in either position; none -> the deployment's default
    assert {k: v.sensitivity for k, v in api_keys(cfg).items()} == {
        "k1": None, "k2": None, "alpha": None, "beta": None, "gamma": None, "delta": "secret", "omega": "public"}
    assert api_keys(ServeConfig()) == {}
    for bad in ("alpha gold\n", "alpha secret public\n", "alpha flex default\n", "alpha flex secret x\n"):
        path.write_text(bad)
        with pytest.raises(InvalidRequestError, match="line 1"):
            api_keys(ServeConfig(api_keys_file=str(path)))
    with pytest.raises(InvalidRequestError, match="kv_sensitivity"):
        ServeConfig(kv_sensitivity="confidential")
    with pytest.raises(InvalidRequestError, match="cannot read"):
        api_keys(ServeConfig(api_keys_file=str(tmp_path / "missing")))
