"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions (SSE streaming or not), /v1/models,
/health, /metrics. Every error is OpenAI's JSON shape with a 4xx status; nothing user-caused is a 500."""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.version import __version__
from pdserve.errors import InvalidRequestError, ModelNotFoundError, PdserveError
from pdserve.worker.ray_placement import ClusterTooSmall
from pdserve.core.pd.kv_arrival import merge as merge_kv
from pdserve.core.pd.sensitivity import resolve as resolve_label
from pdserve.server.gateway import Gateway
from pdserve.server.choices import Collected, Shape
from pdserve.server.families import Family, best, merged
from pdserve.server.tools import ToolStream, plan_tools, prompt_messages
from pdserve.server.protocol import (ChatRequest, CompletionRequest, DetokenizeRequest, PrewarmRequest,
                                     TokenizeRequest, WorkerRequest, chat_messages,
                                     check_supported, completion_prompts, logprobs_asked, sampling_params)


def error_body(message: str, etype: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def _error_response(e: PdserveError) -> JSONResponse:
    retry = getattr(e, "retry_after_s", None)
    headers = {"Retry-After": str(max(1, int(retry)))} if retry is not None else None
    return JSONResponse(error_body(e.message, e.error_type, e.param, e.code), status_code=e.status_code,
                        headers=headers)


class BodyLimit:
    """ASGI middleware: 413 for bodies over `max_bytes`, checked on Content-Length and while streaming in."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._reject(send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise _TooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._reject(send)

    async def _reject(self, send) -> None:
        body = json.dumps(error_body(f"request body exceeds {self.max_bytes} bytes", "invalid_request_error",
                                     None, "request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


class SendTimeout:
    """ASGI middleware: a response whose client takes no data for `timeout_s` (it stopped reading, so the
    server's write would wait forever and tokens pile up behind it) is cut: the connection closes and the
    request is aborted (what the handler put in `scope[ON_CUT]` is called). Counted:
    `pdserve_streams_cut_total`."""

    def __init__(self, app, timeout_s: float, metrics=None) -> None:
        self.app, self.timeout_s, self.metrics = app, timeout_s, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def timed_send(message):
            try:
                await asyncio.wait_for(send(message), self.timeout_s)
            except asyncio.TimeoutError:
                raise _SlowReader from None

        try:
            await self.app(scope, receive, timed_send)
        except* _SlowReader:  # (a streaming response's task group raises it in a group)
            if self.metrics is not None:
                self.metrics.streams_cut.inc()
            for abort in scope.get(ON_CUT, ()):  # at once: the response's generator is closed only when collected
                abort()


class _SlowReader(Exception):
    pass


ON_CUT = "pdserve.on_cut"  # scope key: callables that abort a response's requests when SendTimeout cuts it


def _key_check(keys: dict):
    """The middleware admitting /v1/* requests with a known `Authorization: Bearer` key (401 otherwise); the
    key's default service tier and KV sensitivity label go with the request (`request.state.key_tier`,
    `request.state.key_sensitivity`)."""
    async def check(request: Request, call_next):
        if request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            token = given[7:] if given.startswith("Bearer ") else ""
            match = [k for k in keys if hmac.compare_digest(k.encode(), token.encode())]
            if not match:
                return JSONResponse(error_body("invalid or missing API key", "authentication_error", None,
                                               "invalid_api_key"), status_code=401)
            defaults = keys[match[0]]
            request.state.key_tier, request.state.key_sensitivity = defaults.tier, defaults.sensitivity
        return await call_next(request)
    return check


def create_app(gateway: Gateway, keys: dict | None = None) -> FastAPI:
    """`keys`: the accepted API keys and their defaults (`launch.KeyDefaults`: service tier, KV sensitivity;
    none: no key needed)."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    if keys:
        app.middleware("http")(_key_check(keys))

    @app.exception_handler(PdserveError)
    async def _pdserve_error(_, e: PdserveError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):  # an unknown path or method, an unreadable body
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(error_body(str(e.detail), "invalid_request_error", None, code), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return JSONResponse(error_body(f"{loc or 'body'}: {first.get('msg', 'invalid request')}",
                                       "invalid_request_error", loc, None), status_code=400)

    @app.get("/health")
    async def health():
        """{"status": ok | degraded | unavailable, "workers": [{name, role, pid, state, restarts}],
        "gateway": {"pid"}}; 503 while no decode-capable worker is ready (`pdserve.server.supervisor`)."""
        status, body = gateway.supervisor.health()
        return JSONResponse({**body, "gateway": {"pid": os.getpid()}}, status_code=status)

    @app.get("/metrics")
    async def metrics():
        gateway.metrics.refresh()  # the windowed gauges, as of now
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        # sampling_defaults (pdserve): what the sampling fields a request leaves unset take (`--generation-config`)
        return {"object": "list", "data": [{"id": gateway.model_name, "object": "model", "created": 0,
                                            "owned_by": "pdserve", "max_model_len": gateway.max_model_len,
                                            "sampling_defaults": gateway.sampling_defaults.in_force()}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        _check_model(gateway, body.model)
        check_supported(body)
        given = completion_prompts(body.prompt)
        prompts = [gateway.encode(p) for p in given]
        echo_only = body.echo and body.max_tokens == 0  # the prompt scored, nothing generated (one token run)
        asked = 1 if echo_only else body.max_tokens
        grammar = gateway.grammars.for_request(body)
        params = [sampling_params(body, gateway.max_tokens_for(p, asked), grammar, gateway.sampling_defaults)
                  for p in prompts]
        shape = Shape(False, gateway.tokenizer, logprobs_asked(body), body.echo, echo_only,
                      [p if isinstance(p, str) else gateway.tokenizer.decode(p) for p in given])
        return await _respond(gateway, http, body, prompts, params, shape)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: Request):
        _check_model(gateway, body.model)
        check_supported(body)
        plan, grammar = plan_tools(body, gateway.grammars), gateway.grammars.for_request(body)
        if plan is not None and grammar is not None:
            raise InvalidRequestError("tools cannot be combined with response_format or guided decoding; "
                                      "use tool_choice none", param="tool_choice")
        prompt = _chat_prompt(gateway, body, plan)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = sampling_params(body, gateway.max_tokens_for(prompt, requested),
                                 plan.grammar if plan is not None else grammar, gateway.sampling_defaults)
        return await _respond(gateway, http, body, [prompt], [params], Shape(True, gateway.tokenizer,
                                                                              logprobs_asked(body), tools=plan))

    @app.post("/v1/kv/prewarm")
    async def prewarm(body: PrewarmRequest):
        _check_model(gateway, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            prompt = gateway.tokenizer.encode_chat(chat_messages(body))
        else:
            prompt = gateway.encode(body.prompt)
        gateway.max_tokens_for(prompt, 1)
        return {"object": "kv.prewarm", **await gateway.prewarm(prompt, body.ttl_s)}

    @app.delete("/v1/kv/prewarm/{prewarm_id}")
    async def unpin(prewarm_id: str):
        return await gateway.unpin(prewarm_id)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        _check_model(gateway, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:  # (as /v1/chat/completions renders them, with any tools)
            tokens = _chat_prompt(gateway, body, plan_tools(body, gateway.grammars), body.add_generation_prompt)
        else:
            tokens = gateway.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": gateway.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _check_model(gateway, body.model)
        vocab = gateway.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": gateway.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/v1/admin/steps")
    async def steps():
        """Each worker's recent engine steps as its stats reported them (read-only): {worker, role, source
        (calibration: its profile steps at load; served), prefill_tokens, prefill_sq, decode_seqs, decode_context,
        seconds, prefill_prefix (sum of prefill chunks' tokens x their cached prefix)}; `pdserve profile
        --from-server URL` fits the simulator's time model to the served ones."""
        return {"object": "list", "data": gateway.conductor.step_records()}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/v1/cluster/workers", status_code=202)
    async def add_worker(body: WorkerRequest):
        """202: placed, `starting`, or `pending` with the resources Ray waits for; 409 when no node could hold it
        (`pdserve.worker.ray_placement`)."""
        cluster = _cluster(gateway)
        try:
            name = cluster.add(body.role)
        except ClusterTooSmall:
            gateway.metrics.workers_unplaced.labels(role=body.role, reason="infeasible").inc()
            raise
        return {"object": "cluster.worker", "name": name, "role": body.role, **await cluster.placements.settle(name)}

    @app.delete("/v1/cluster/workers/{name}", status_code=202)
    async def remove_worker(name: str):
        _cluster(gateway).remove(name)
        return {"object": "cluster.worker", "name": name, "state": "leaving"}

    return app


def _cluster(gateway: Gateway):
    if gateway.cluster is None:
        raise InvalidRequestError("workers are added and removed here only under --cluster ray", param=None,
                                  code="no_cluster")
    return gateway.cluster


def _chat_prompt(gateway, body, plan, add_generation_prompt: bool = True) -> list[int]:
    """A chat request's prompt tokens: its messages through the template, with the tools it offers."""
    messages, tools = prompt_messages(chat_messages(body), plan, gateway.tokenizer.template_takes_tools)
    if plan is not None and tools is None:
        gateway.metrics.fallbacks.labels(kind="tools_in_system_prompt").inc()
    return gateway.tokenizer.encode_chat(messages, add_generation_prompt, tools=tools)


def _check_model(gateway: Gateway, model: str | None) -> None:
    if model is not None and model != gateway.model_name:
        raise ModelNotFoundError(f"The model `{model}` does not exist; this server serves `{gateway.model_name}`.",
                                 param="model")


async def _respond(gateway: Gateway, http: Request, body, prompts, params, shape: Shape):
    tier = gateway.conductor.tiers.resolve(body.service_tier, getattr(http.state, "key_tier", gateway.auto_tier))
    meta = {"id": ("chatcmpl-" if shape.chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
            "model": gateway.model_name, "service_tier": tier}
    n = body.n
    runs = max(n, getattr(body, "best_of", None) or 1)  # sequences generated per prompt
    label = resolve_label(body.kv_sensitivity, getattr(http.state, "key_sensitivity", None), gateway.kv_sensitivity)
    families = [Family(gateway, p, sp, runs, body.priority, tier, _trace(gateway, http, body), runs > n, label)
                for p, sp in zip(prompts, params)]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = include_usage and body.stream_options.continuous_usage_stats  # (as vLLM: needs include_usage)
        if len(prompts) != 1:
            raise InvalidRequestError("streaming takes one prompt per request", param="prompt")
        family = families[0]
        await family.start()  # admitted (or refused with a 4xx/5xx status) before the stream starts
        http.scope.setdefault(ON_CUT, []).append(lambda: asyncio.ensure_future(family.abort()))
        return StreamingResponse(_sse(family, prompts[0], meta, shape, include_usage, continuous),
                                 media_type="text/event-stream")
    try:
        results = await _collect_all(http, families, shape.echo_only)
    except _ClientGone:
        return Response(status_code=499)
    generated = sum(r.num_tokens for seqs in results for r in seqs)
    cached = sum(seqs[0].cached for seqs in results)  # (the first sequence's: it computed the prompt)
    kv = merge_kv([seqs[0].kv for seqs in results if seqs[0].kv])
    if runs > n:
        results = [best(seqs, n) for seqs in results]
    choices = [shape.choice(i * n + j, r, prompts[i], i) for i, seqs in enumerate(results) for j, r in enumerate(seqs)]
    usage = _usage(sum(len(p) for p in prompts), generated, cached, kv)
    return {**meta, "object": "chat.completion" if shape.chat else "text_completion", "choices": choices,
            "usage": usage}


async def _collect_all(http: Request, families: list[Family], echo_only: bool = False) -> list[list[Collected]]:
    """Run every sequence of every prompt to the end, unless the client leaves first: then their requests are
    aborted."""
    tasks = [[asyncio.ensure_future(_collect(s, echo_only)) for s in f.streams()] for f in families]
    every = [t for ts in tasks for t in ts]
    watcher = asyncio.ensure_future(_wait_disconnect(http))
    try:
        pending = set(every)
        while pending:  # one failed sequence (a refusal, a worker error) ends them all, at once
            done, pending = await asyncio.wait(pending | {watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                raise _ClientGone
            pending.discard(watcher)
            for t in done:
                t.result()
        return [[t.result() for t in ts] for ts in tasks]
    finally:
        watcher.cancel()
        for t in every:  # (their streams abort their requests in the workers)
            t.cancel()
        await asyncio.gather(*every, return_exceptions=True)


def _trace(gateway: Gateway, http: Request, body) -> dict | None:
    """The client's W3C trace context headers and its `user`, when the server exports traces (`--otlp-endpoint`)."""
    if gateway.conductor.tracer is None:
        return None
    user = (body.model_extra or {}).get("user")
    return {**{h: http.headers[h] for h in ("traceparent", "tracestate") if h in http.headers},
            **({"enduser.id": str(user)} if user else {})}


async def _wait_disconnect(http: Request) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(0.25)


async def _collect(stream, echo_only: bool) -> Collected:
    out = Collected()
    async for d in stream:
        if d.prompt_logprobs is not None:
            out.prompt_logprobs = d.prompt_logprobs
        out.cached, out.kv = d.cached_tokens, d.kv_transfer or out.kv
        if echo_only:  # (its one generated token is not part of the answer)
            out.reason = "length"
            break
        out.add(d)
    return out


def _usage(prompt_tokens: int, completion_tokens: int, cached: int, kv: dict | None = None) -> dict:
    """OpenAI's usage, and `kv_transfer` (an extension OpenAI clients keep in `model_extra`): how the prompt's KV
    reached its decode worker (`pdserve.core.pd.kv_arrival`)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached},
            "kv_transfer": kv or merge_kv([])}


async def _sse(family: Family, prompt, meta: dict, shape: Shape, include_usage: bool, continuous: bool = False):
    obj = "chat.completion.chunk" if shape.chat else "text_completion"
    count = family.count

    def event(index: int, choice_delta: dict, reason: str | None, usage=None, choices=True, logprobs=None) -> str:
        payload = {**meta, "object": obj, "choices": [{"index": index, **choice_delta, "logprobs": logprobs,
                                                        "finish_reason": reason}] if choices else []}
        if include_usage:
            payload["usage"] = usage
        return f"data: {json.dumps(payload)}\n\n"

    made, cached, logs, started = [0] * count, 0, [shape.stream() for _ in range(count)], [False] * count
    kv = None
    calls = [ToolStream(shape.tools) for _ in range(count)] if shape.tools is not None else None
    try:
        async for i, d in merged(family.streams()):
            if shape.chat and not started[i]:  # the role with the first token, as vLLM sends it (clients time it)
                started[i] = True
                yield event(i, {"delta": {"role": "assistant", "content": ""}}, None)
            cached = d.cached_tokens if i == 0 else cached
            kv = d.kv_transfer if i == 0 and d.kv_transfer else kv
            if shape.echo and d.num_tokens == 1:  # the prompt first, with its logprobs when asked for
                yield event(i, {"text": shape.prompt_texts[0]}, "length" if shape.echo_only else None,
                            logprobs=logs[i].prompt(prompt, d.prompt_logprobs))
            if shape.echo_only:
                continue
            made[i] = d.num_tokens
            logprobs = logs[i].token(d)
            usage = _usage(len(prompt), sum(made), cached, kv) if continuous else None
            if calls is not None:  # tool calls: their pieces as they complete
                deltas = calls[i].feed(d.text)
                reason = calls[i].finish_reason(d.finish_reason)
                for k, delta in enumerate(deltas or ([{}] if d.finished or logprobs is not None else [])):
                    last = k == max(len(deltas), 1) - 1
                    yield event(i, {"delta": delta}, reason if last else None, usage if last else None,
                                logprobs=logprobs if last else None)
            elif d.text or d.finished or logprobs is not None:
                yield event(i, {"delta": {"content": d.text}} if shape.chat else {"text": d.text}, d.finish_reason,
                            usage, logprobs=logprobs)
    except PdserveError as e:
        yield f"data: {json.dumps(error_body(e.message, e.error_type, e.param, e.code))}\n\n"
    if include_usage:
        yield event(0, {}, None, _usage(len(prompt), sum(made), cached, kv), choices=False)
    yield "data: [DONE]\n\n"
