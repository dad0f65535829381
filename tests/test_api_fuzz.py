"""Fuzzing the HTTP API from the OpenAPI schema it serves (schemathesis), against a real server (issue 15): for
every operation, generated requests (valid and invalid per the schema) get no 5xx, every error is OpenAI's
`{"error": {message, type, param, code}}`, and no worker dies. A tiny random model keeps a generation to
milliseconds."""

from __future__ import annotations

import itertools
import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from serve_util import Server

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "25"))  # per operation and mode: ~350 cases in all


@pytest.fixture(scope="module")
def api_server(tiny_llama_dir):
    server = Server("--model", str(tiny_llama_dir), "--max-model-len", "128", "--max-body-bytes", "65536")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api_schema(api_server):
    return schemathesis.openapi.from_url(api_server.url + "/openapi.json")


def test_the_schema_covers_every_endpoint(api_server):
    paths = httpx.get(api_server.url + "/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/kv/prewarm", "/v1/kv/prewarm/{prewarm_id}",
            "/health", "/metrics", "/tokenize", "/detokenize", "/version", "/v1/cluster/workers"} <= set(paths)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/kv/prewarm"):
        assert "requestBody" in paths[path]["post"]


def test_generated_requests_get_no_5xx_and_openai_shaped_errors(api_schema, api_server):
    # (schemathesis' pytest plugin does not run under this pytest: each operation's strategy is driven here)
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 7

    for operation, mode in itertools.product(operations, schemathesis.GenerationMode):  # valid and invalid input
        @given(case=operation.as_strategy(mode))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            response = case.call(timeout=60)
            assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:500])
            if response.status_code >= 400 and case.path.startswith("/v1/"):
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text
            assert len(api_server.worker_pids()) == 2, "a worker died"

        try:
            check()
        except Unsatisfiable:  # an operation without parameters has no invalid input
            assert mode is schemathesis.GenerationMode.NEGATIVE
