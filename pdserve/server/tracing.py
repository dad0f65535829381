"""OpenTelemetry traces of requests (`pdserve serve --otlp-endpoint URL`; off by default).

Each request that ends becomes one trace in the client's: a root span `pdserve.request` (SERVER kind), child of
the span the client's W3C `traceparent` header names (a new trace when it sends none), and one child span per
phase, from the conductor core's record of the request (`FlightState`, the gateway's monotonic clock):

- `queue`: arrival -> its prefill was dispatched to a prefill worker (PD: admission, routing, the decode
  worker's reservation of its KV blocks, waiting behind other prompts in the conductor's order);
- `prefill`: dispatched -> the prefill worker reported the prompt computed (its queue there included); in
  colocated mode, arrival -> first token;
- `transfer`: prefilled -> first token (the KV delivered, landed and consumed by the decode worker);
- `decode`: first token -> last token.

Spans are built when a request ends (its times are known then) and exported by a batch processor in the
background over OTLP/HTTP (protobuf), so a slow or absent collector costs the request path nothing; an export
that fails is dropped by the SDK (logged once per failure), never retried into the server's memory.
Attributes follow the GenAI semantic conventions where one fits (`gen_ai.*`), else `pdserve.*`.
"""

from __future__ import annotations

import time
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()


def traces_url(endpoint: str) -> str:
    """`--otlp-endpoint` as the exporter's URL: a bare collector address gets the OTLP/HTTP path `/v1/traces`."""
    return endpoint if urlsplit(endpoint).path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


class RequestTracer:
    def __init__(self, endpoint: str, model: str, schedule_delay_ms: int = 1000) -> None:
        self.model = model
        self.provider = TracerProvider(resource=Resource.create({"service.name": "pdserve"}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint)),
                                                            schedule_delay_millis=schedule_delay_ms))
        self.tracer = self.provider.get_tracer("pdserve")
        self._wall_minus_mono = time.time() - time.monotonic()

    def ended(self, context: dict | None, arrival_s: float, state, now: float, error: str | None = None) -> None:
        """A request that arrived at `arrival_s` ended (`state`: its conductor-core `FlightState`, None for one
        refused or failed after the core let it go; times on the monotonic clock; `error`: what failed it):
        its root span and one span per phase it reached."""
        parent = _propagator.extract(context or {})
        attributes = self._attributes(state) if state is not None else {"gen_ai.request.model": self.model}
        if context and context.get("enduser.id"):
            attributes["enduser.id"] = context["enduser.id"]  # the request's OpenAI `user`
        root = self.tracer.start_span("pdserve.request", context=parent, kind=SpanKind.SERVER,
                                      start_time=self._ns(arrival_s if state is None else state.arrival_s),
                                      attributes=attributes)
        inside = trace.set_span_in_context(root)
        for name, start, end in _phases(state) if state is not None else ():
            if start is not None and end is not None:
                self.tracer.start_span(name, context=inside, start_time=self._ns(start)).end(self._ns(end))
        if error is not None:
            root.set_status(Status(StatusCode.ERROR, error))
        root.end(self._ns(state.last_token_s if error is None and state is not None and state.last_token_s
                          else now))

    def shutdown(self) -> None:
        """Export what is queued (bounded by the SDK's export timeout), then stop."""
        self.provider.shutdown()

    def _attributes(self, state) -> dict:
        attrs = {"gen_ai.system": "pdserve", "gen_ai.request.model": self.model, "gen_ai.response.id": state.rid,
                 "gen_ai.usage.input_tokens": len(state.prompt), "gen_ai.usage.output_tokens": state.num_tokens,
                 "pdserve.service_tier": state.tier}
        if state.first_token_s is not None:
            attrs["gen_ai.latency.time_to_first_token"] = state.first_token_s - state.arrival_s
        for key, worker in (("prefill", state.prefilled_by), ("decode", state.decode)):
            if worker:
                attrs[f"pdserve.{key}_worker"] = worker
        return attrs

    def _ns(self, mono_s: float) -> int:
        return int((mono_s + self._wall_minus_mono) * 1e9)


def _phases(state) -> list[tuple[str, float | None, float | None]]:
    if state.prefilled_s is None:  # colocated (or the decode worker computed the prompt itself)
        return [("prefill", state.arrival_s, state.first_token_s), ("decode", state.first_token_s,
                                                                     state.last_token_s)]
    return [("queue", state.arrival_s, state.dispatched_s), ("prefill", state.dispatched_s, state.prefilled_s),
            ("transfer", state.prefilled_s, state.first_token_s),
            ("decode", state.first_token_s, state.last_token_s)]
