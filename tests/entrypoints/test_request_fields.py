"""vLLM's request fields in the HTTP request models (`openai_protocol.py`), without an engine: what each field
becomes in SamplingParams, and the warning naming the fields a request sent that nothing takes."""

from __future__ import annotations

import logging

import pytest

from jaxserve.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def warnings():
    """The jaxserve.entrypoints.openai_protocol logger's warnings (the jaxserve logger does not propagate)."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logger = logging.getLogger("jaxserve.entrypoints.openai_protocol")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_unknown_fields_are_logged_as_vllm_logs_them(warnings):
    CompletionRequest(prompt="x", best_of_typo=3, frobnicate=True)
    ChatCompletionRequest(messages=[{"role": "user", "content": "hi", "name": "me"}], top_k=2)
    assert warnings == ["The following fields were present in the request but ignored: "
                        "['best_of_typo', 'frobnicate']"]


def test_known_fields_and_aliases_log_nothing(warnings):
    ChatCompletionRequest(messages=CHAT, response_format={"type": "json_schema",
                                                          "json_schema": {"name": "n", "schema": {}}})
    assert warnings == []
