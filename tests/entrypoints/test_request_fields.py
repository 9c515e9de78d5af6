"""vLLM's request fields in the HTTP request models (`openai_protocol.py`), without an engine: what each field
becomes in SamplingParams, and the warning naming the fields a request sent that nothing takes."""

from __future__ import annotations

import logging

import pytest

from jaxserve.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from jaxserve.sampling_params import BeamSearchParams

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


def test_beam_search_keeps_stop_logprobs_and_seed():
    """vLLM drops them from its BeamSearchParams; jaxserve's beams honour them (`engine/beam_search.py`)."""
    completion = CompletionRequest(prompt="x", use_beam_search=True, n=3, max_tokens=5, temperature=0.5,
                                   stop=["\n"], stop_token_ids=[7], logprobs=4, seed=11)
    assert completion.to_beam_search_params(16) == BeamSearchParams(
        beam_width=3, max_tokens=5, temperature=0.5, stop=["\n"], stop_token_ids=[7], logprobs=4, seed=11)
    chat = ChatCompletionRequest(messages=CHAT, use_beam_search=True, n=2, stop="end", logprobs=True,
                                 top_logprobs=6, seed=3)
    assert chat.to_beam_search_params(16) == BeamSearchParams(
        beam_width=2, max_tokens=16, temperature=1.0, stop=["end"], logprobs=6, seed=3)


def test_vllms_sampling_fields_reach_sampling_params():
    request = ChatCompletionRequest(messages=CHAT, truncate_prompt_tokens=-1, allowed_token_ids=[1, 2],
                                    bad_words=["no"], prompt_logprobs=2, priority=4)
    params = request.to_sampling_params(16)
    assert (params.truncate_prompt_tokens, params.allowed_token_ids, params.bad_words, params.prompt_logprobs) == (
        -1, [1, 2], ["no"], 2)
    assert request.priority == 4
