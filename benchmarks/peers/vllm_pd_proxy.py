"""A client-side proxy that makes two `vllm serve` instances one 1P1D endpoint (MooncakeConnector).

    .venv/bin/python benchmarks/peers/vllm_pd_proxy.py --prefill http://127.0.0.1:8011 \
        --decode http://127.0.0.1:8012 --bootstrap http://127.0.0.1:8998 --port 8001

For each OpenAI request (`/v1/completions`, `/v1/chat/completions`) it sends, at the same time, the prefill
server the request with `max_tokens=1` and `kv_transfer_params={"do_remote_decode": true, "transfer_id":
X}` and the decode server the original request with `kv_transfer_params={"do_remote_prefill": true,
"remote_engine_id": "prefill0", "remote_bootstrap_addr": BOOTSTRAP, "transfer_id": X}`; the decode
server's answer (stream or not) goes back to the client unchanged. This is vLLM's documented way to drive
its Mooncake disaggregation (see ../shared/peers/README.md); it runs in pdserve's venv (FastAPI, httpx).
`/v1/models` is the decode server's.
"""

from __future__ import annotations

import argparse
import asyncio
import uuid

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def build_app(prefill: str, decode: str, bootstrap: str, engine_id: str) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=httpx.Timeout(None), limits=httpx.Limits(max_connections=1024))

    async def forward(path: str, request: Request) -> Response:
        body = await request.json()
        xfer = uuid.uuid4().hex
        p_body = dict(body, max_tokens=1, stream=False, kv_transfer_params={
            "do_remote_decode": True, "transfer_id": xfer})
        p_body.pop("stream_options", None)
        p_body.pop("max_completion_tokens", None)
        d_body = dict(body, kv_transfer_params={
            "do_remote_prefill": True, "remote_engine_id": engine_id, "remote_bootstrap_addr": bootstrap,
            "transfer_id": xfer})
        p_task = asyncio.create_task(client.post(prefill + path, json=p_body))
        if body.get("stream"):
            d_req = client.build_request("POST", decode + path, json=d_body)
            d_resp = await client.send(d_req, stream=True)

            async def relay():
                try:
                    async for chunk in d_resp.aiter_raw():
                        yield chunk
                finally:
                    await d_resp.aclose()
                    await p_task

            return StreamingResponse(relay(), status_code=d_resp.status_code,
                                     media_type=d_resp.headers.get("content-type", "text/event-stream"))
        d_resp = await client.post(decode + path, json=d_body)
        await p_task
        return Response(d_resp.content, status_code=d_resp.status_code,
                        media_type=d_resp.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models() -> Response:
        r = await client.get(decode + "/v1/models")
        return JSONResponse(r.json(), status_code=r.status_code)

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", default="http://127.0.0.1:8011")
    ap.add_argument("--decode", default="http://127.0.0.1:8012")
    ap.add_argument("--bootstrap", default="http://127.0.0.1:8998", help="the prefill server's Mooncake "
                    "bootstrap address (VLLM_MOONCAKE_BOOTSTRAP_PORT)")
    ap.add_argument("--engine-id", default="prefill0")
    ap.add_argument("--port", type=int, default=8001)
    args = ap.parse_args()
    app = build_app(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.bootstrap, args.engine_id)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
