"""Fuzzes the HTTP server (in-process engine, tiny random llama, max_model_len 64) with schemathesis: 15 requests per
operation of its OpenAPI schema, generated from that schema, none answered with a 5xx; the server is healthy after and
answers a normal completion. `scripts/fuzz_server.py` runs thousands, in either engine mode."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from jaxserve.testing.tiny_models import make_tiny_model
from tests.server import MODEL_NAME, serve

EXAMPLES_PER_OPERATION = 15


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=3)
    running, _ = serve(model_dir, max_model_len=64)  # no request generates more than 64 tokens
    with running:
        yield running


def test_no_generated_request_is_a_server_error(server):
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 14  # every route, the router's and the probes included
    for operation in operations:
        _fuzz(operation)


def _fuzz(operation) -> None:
    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def no_server_error(case):
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL_NAME  # past the model check, to everything behind it
        case.call_and_validate(checks=[not_a_server_error])

    no_server_error()


def test_the_server_still_serves_after_the_fuzzing(server):
    assert httpx.get(server.base_url + "/health").status_code == 200
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    completion = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()
    assert completion["usage"] == {"prompt_tokens": 5, "total_tokens": 9, "completion_tokens": 4}
