"""SamplingParams and BeamSearchParams: vLLM's defaults, normalizations and every validation error."""

from __future__ import annotations

import math

import pytest

from jaxserve.config.engine_config import EngineConfig
from jaxserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs, p.seed) == (16, 0, None, None, None)
    assert (p.stop, p.stop_token_ids, p.include_stop_str_in_output, p.ignore_eos) == ([], [], False, False)
    assert (p.skip_special_tokens, p.spaces_between_special_tokens, p.logit_bias) == (True, True, None)
    assert p.output_kind == RequestOutputKind.CUMULATIVE
    assert not p.is_greedy and not p.has_penalties and p.output_text_buffer_length == 0


def test_normalizations():
    p = SamplingParams(n=2, stop="###", stop_token_ids=[7, 3, 7], seed=-1, logprobs=True,
                       logit_bias={"5": 250, 9: -0.5, "11": -1e9})
    assert p.best_of == 2 and p.stop == ["###"] and p.stop_token_ids == [7, 3] and p.seed is None
    assert p.logprobs == 1
    assert p.logit_bias == {5: 100.0, 9: -0.5, 11: -100.0}  # OpenAI's clamp
    assert SamplingParams(stop=["ab", "wxyz"]).output_text_buffer_length == 3
    assert SamplingParams(stop=["wxyz"], include_stop_str_in_output=True).output_text_buffer_length == 0
    assert SamplingParams(temperature=0.001).temperature == 0.01  # vLLM's floor for tiny temperatures
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=7, min_p=0.2)
    assert greedy.is_greedy and (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(top_k=-1).top_k == -1  # accepted as "off", like 0
    filters = SamplingParams(bad_words="no way", allowed_token_ids=[4, 2, 4])
    assert filters.bad_words == ["no way"] and filters.allowed_token_ids == [4, 2]  # one word, not its characters
    beams = BeamSearchParams(beam_width=2, max_tokens=3, stop="\n", stop_token_ids=[5, 5], seed=-1)
    assert (beams.stop, beams.stop_token_ids, beams.seed) == (["\n"], [5], None)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": "2"}, "n must be an int, but is of type str."),
        ({"n": 0}, "n must be at least 1, got 0."),
        ({"best_of": 1.5}, "best_of must be an int, but is of type float."),
        ({"best_of": 0}, "best_of must be at least 1, got 0."),
        ({"n": 3, "best_of": 2}, "best_of must be greater than or equal to n, got n=3 and best_of=2."),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5."),
        ({"frequency_penalty": -3.0}, "frequency_penalty must be in [-2, 2], got -3.0."),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than zero, got 0.0."),
        ({"repetition_penalty": math.inf}, "repetition_penalty must be a finite number, got inf."),
        ({"temperature": -0.1}, "temperature must be non-negative, got -0.1."),
        ({"temperature": math.nan}, "temperature must be a finite number, got nan."),
        ({"temperature": 2.5}, "temperature must be in [0, 2], got 2.5."),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0."),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
        ({"top_k": -2}, "top_k must be 0 (disable), or at least 1, got -2."),
        ({"top_k": 1.5}, "top_k must be an integer, got float."),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5."),
        ({"seed": "x"}, "seed must be an integer, got 'x'."),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0."),
        ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1."),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be less than or equal to max_tokens=4, got 5."),
        ({"logprobs": -1}, "logprobs must be non-negative, got -1."),
        ({"prompt_logprobs": -2}, "prompt_logprobs must be non-negative, got -2."),
        ({"stop_token_ids": ["a"]}, "stop_token_ids must contain only integers, got ['a']."),
        ({"stop": ["x", ""]}, "stop cannot contain an empty string."),
        ({"stop": [1]}, "stop must be strings, got [1]."),
        ({"output_kind": "delta"}, "output_kind must be a RequestOutputKind, got 'delta'."),
        ({"logit_bias": [1]}, "logit_bias must be a dict of token id to bias, got [1]."),
        ({"logit_bias": {"a": 1.0}}, "logit_bias keys must be token ids (integers), got 'a'."),
        ({"logit_bias": {1: "x"}}, "logit_bias values must be finite numbers, got 'x'."),
        ({"logit_bias": {1: math.nan}}, "logit_bias values must be finite numbers, got nan."),
        ({"temperature": 0.0, "n": 2}, "n must be 1 when using greedy sampling, got 2."),
        ({"temperature": 0.0, "best_of": 2}, "best_of must be 1 when using greedy sampling, got 2."),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be an integer >= 1 or -1, got 0"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be an integer >= 1 or -1, got -2"),
        ({"allowed_token_ids": []}, "allowed_token_ids is not None and empty!"),
        ({"allowed_token_ids": ["a"]}, "allowed_token_ids must contain only integers, got ['a']."),
        ({"bad_words": ["x", 3]}, "bad_words must be strings, got ['x', 3]."),
    ],
)
def test_sampling_params_validation_errors(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value) == message


def test_beam_search_params_defaults():
    p = BeamSearchParams(beam_width=3, max_tokens=5)
    assert (p.ignore_eos, p.temperature, p.length_penalty, p.include_stop_str_in_output) == (False, 0.0, 1.0, False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"beam_width": 0}, "beam_width must be at least 1, got 0."),
        ({"beam_width": "2"}, "beam_width must be an int, but is of type str."),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0."),
        ({"temperature": -1.0}, "temperature must be in [0, 2], got -1.0."),
        ({"length_penalty": math.nan}, "length_penalty must be a finite number, got nan."),
        ({"stop": ["a", ""]}, "stop must be non-empty strings, got ['a', '']."),
        ({"stop_token_ids": [1.5]}, "stop_token_ids must contain only integers, got [1.5]."),
        ({"logprobs": -1}, "logprobs must be non-negative, got -1."),
        ({"seed": 1.5}, "seed must be an integer, got 1.5."),
    ],
)
def test_beam_search_params_validation_errors(kwargs, message):
    with pytest.raises(ValueError) as err:
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})
    assert str(err.value) == message


def test_engine_config_max_logprobs():
    assert EngineConfig().max_logprobs == 20
    with pytest.raises(ValueError, match=r"^max_logprobs must be a non-negative integer, got -1$"):
        EngineConfig(max_logprobs=-1)
