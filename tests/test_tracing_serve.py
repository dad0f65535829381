"""OpenTelemetry traces (issue 17): `pdserve serve --otlp-endpoint URL` exports, for every request, a root span
in the client's trace (its `traceparent` continued) and one span per phase, to an OTLP/HTTP collector — here
one in this process that decodes what it is sent as the OTLP protobuf it is."""

from __future__ import annotations

import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from serve_util import Server

MODEL = "SmolLM2-135M-Instruct"


class Collector:
    """An OTLP/HTTP trace receiver: every span it was sent, as (span, its resource's attributes)."""

    def __init__(self) -> None:
        self.spans: list = []
        self.paths: list[str] = []
        received = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the http.server API
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                received.paths.append(self.path)
                for rs in request.resource_spans:
                    for ss in rs.scope_spans:
                        received.spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *_):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: bytes, count: int, timeout_s: float = 30) -> list:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spans = [s for s in self.spans if s.trace_id == trace_id]
            if len(spans) >= count:
                return spans
            time.sleep(0.2)
        return [s for s in self.spans if s.trace_id == trace_id]


def _attrs(span) -> dict:
    return {a.key: (a.value.string_value or a.value.int_value or a.value.double_value) for a in span.attributes}


def test_a_failed_request_is_an_error_span_and_a_bare_endpoint_gets_the_traces_path():
    from pdserve.server.tracing import RequestTracer, traces_url
    assert traces_url("http://c:4318") == traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/otlp/v1/traces") == "http://c:4318/otlp/v1/traces"
    collector = Collector()
    tracer = RequestTracer(collector.url, "m", schedule_delay_ms=50)
    now = time.monotonic()
    tracer.ended({"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}, now - 0.5, None, now, "queue full")
    tracer.shutdown()  # exports what is queued
    (span,) = collector.trace(bytes.fromhex("ab" * 16), 1)
    assert span.status.code == span.status.STATUS_CODE_ERROR and span.status.message == "queue full"
    assert span.parent_span_id == bytes.fromhex("cd" * 8)
    assert 0.45e9 < span.end_time_unix_nano - span.start_time_unix_nano < 0.55e9
    collector.server.shutdown()


@pytest.fixture(scope="module")
def traced():
    collector = Collector()
    server = Server("--otlp-endpoint", collector.url)
    yield server, collector
    server.stop()
    collector.server.shutdown()


@pytest.mark.slow
def test_a_request_is_a_trace_of_its_phases_under_the_clients_span(traced):
    server, collector = traced
    trace_id, parent_id = secrets.token_bytes(16), secrets.token_bytes(8)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                    temperature=0, extra_body={"ignore_eos": True},
                                    extra_headers={"traceparent": f"00-{trace_id.hex()}-{parent_id.hex()}-01"})
    spans = collector.trace(trace_id, 5)
    assert collector.paths and all(p == "/v1/traces" for p in collector.paths)
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"pdserve.request", "queue", "prefill", "transfer", "decode"}, [s.name for s in spans]
    root = by_name["pdserve.request"]
    assert root.parent_span_id == parent_id  # the client's span is its parent
    assert root.kind == root.SPAN_KIND_SERVER
    attrs = _attrs(root)
    assert attrs["gen_ai.usage.output_tokens"] == out.usage.completion_tokens == 12
    assert attrs["gen_ai.usage.input_tokens"] == out.usage.prompt_tokens
    assert attrs["pdserve.prefill_worker"] == "prefill-0" and attrs["pdserve.decode_worker"] == "decode-0"
    phases = [by_name[n] for n in ("queue", "prefill", "transfer", "decode")]
    assert all(s.parent_span_id == root.span_id for s in phases)
    # the phases follow one another and cover the request
    assert phases[0].start_time_unix_nano == root.start_time_unix_nano
    for a, b in zip(phases, phases[1:]):
        assert a.end_time_unix_nano == b.start_time_unix_nano
    assert phases[-1].end_time_unix_nano == root.end_time_unix_nano
    assert all(s.end_time_unix_nano >= s.start_time_unix_nano for s in phases)
    assert 0 < root.end_time_unix_nano - root.start_time_unix_nano < 120e9
    assert abs(root.end_time_unix_nano / 1e9 - time.time()) < 60  # wall-clock times, not monotonic


@pytest.mark.slow
def test_without_traceparent_a_request_starts_a_trace_of_its_own(traced):
    server, collector = traced
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    before = len(collector.spans)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    deadline = time.monotonic() + 30
    while len(collector.spans) < before + 5 and time.monotonic() < deadline:
        time.sleep(0.2)
    new = collector.spans[before:]
    roots = [s for s in new if s.name == "pdserve.request"]
    assert len(roots) == 1 and roots[0].parent_span_id == b""  # a trace of its own
    assert {s.name for s in new if s.trace_id == roots[0].trace_id} >= {"queue", "prefill", "decode"}
