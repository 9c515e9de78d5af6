"""Structured outputs without a model: what a constraint may be and the errors it gives, through
SamplingParams and the HTTP API's fields (response_format, structured_outputs, guided_*). The constraints on
the embedded model (every output valid, other rows untouched, the openai client) are in
tests/e2e/test_embedded_model.py."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import SamplingParams, StructuredOutputsParams
from jaxserve.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "You must use one kind of structured outputs constraint but none are specified"),
    ({"regex": "a+", "choice": ["a"]},
     "You can only use one kind of structured outputs constraint but multiple are specified: regex, choice"),
    ({"regex": "(("}, "invalid structured outputs regex: "),
    ({"json": {"type": "nope"}}, "invalid structured outputs json: Invalid type: nope"),
    ({"json": "{not json"}, "invalid structured outputs json: the schema is not JSON"),
    ({"json": "[1, 2]"}, "invalid structured outputs json: a schema is a JSON object, got '[1, 2]'"),
    ({"grammar": "start: foo"}, 'invalid structured outputs grammar: at 1(8): unknown name: "foo"'),
    ({"choice": []}, "structured outputs choice must be a non-empty list of strings, got []"),
    ({"choice": ["a", 3]}, "structured outputs choice must be a non-empty list of strings, got ['a', 3]"),
])
def test_a_bad_constraint_is_a_value_error_naming_it(kwargs, message):
    with pytest.raises(ValueError) as err:
        StructuredOutputsParams(**kwargs)
    assert str(err.value).startswith(message)


def test_each_kind_of_constraint_compiles():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for kwargs in ({"json": schema}, {"json": '{"type": "string"}'}, {"regex": r"\d{3}"}, {"choice": ["yes", "no"]},
                   {"json_object": True}, {"grammar": 'start: "a" | "b" x\nx: "c"+'}):
        params = StructuredOutputsParams(**kwargs)
        assert params.kind == next(iter(kwargs)) and params.grammar_text()


def test_disable_any_whitespace_makes_another_json_grammar():
    schema = {"type": "object"}
    assert (StructuredOutputsParams(json=schema, disable_any_whitespace=True).grammar_text()
            != StructuredOutputsParams(json=schema).grammar_text())


def test_a_matcher_allows_the_grammars_next_tokens_then_ends():
    """On the tiny byte-level tokenizer: choice ["ab", "ac"] allows 'a', then 'b' or 'c', then only EOS (id 2); a
    rejected token leaves the matcher finished, with its reason."""
    from jaxserve.engine.structured_outputs import GrammarCompiler
    from jaxserve.testing.tiny_models import byte_level_tokenizer
    from tests.generation_fixtures import LETTERS

    compiler = GrammarCompiler(byte_level_tokenizer(), 320, frozenset({2}))
    a, b, c = (LETTERS[ch] for ch in "abc")

    def allowed(matcher) -> list[int]:
        words = matcher.allowed_tokens().view(np.uint32)
        return [t for t in range(320) if words[t // 32] >> (t % 32) & 1]

    matcher = compiler.matcher(StructuredOutputsParams(choice=["ab", "ac"]))
    assert allowed(matcher) == [a]
    assert matcher.consume(a) and allowed(matcher) == [b, c] and not matcher.is_finished
    assert matcher.consume(c) and allowed(matcher) == [2] and matcher.is_finished
    other = compiler.matcher(StructuredOutputsParams(choice=["ab", "ac"]))  # a copy: the first's state is its own
    assert allowed(other) == [a]
    assert not other.consume(b) and other.is_finished
    assert other.error == ("Parser Error: token \"b\" doesn't satisfy the grammar; forced bytes: got 'a'; "
                           "applying 'b'")


def test_bad_words_tokenize_as_vllms_and_mask_with_a_grammar():
    """vLLM's tokenization (the word, and after a space only when as long with another first token) and rule: a
    word's last token is banned right after its other tokens; with a grammar, only what both allow."""
    from jaxserve.engine.structured_outputs import (
        BadWordsFilter,
        BothConstraints,
        GrammarCompiler,
        bad_words_token_ids,
    )
    from jaxserve.testing.tiny_models import byte_level_tokenizer
    from tests.generation_fixtures import LETTERS

    tokenizer = byte_level_tokenizer()
    a, b, c = (LETTERS[ch] for ch in "abc")
    assert bad_words_token_ids(tokenizer, ["ab", "  c"]) == [[a, b], [c]]  # " ab" is 3 byte tokens: not kept

    def allowed(mask) -> list[int]:
        words = mask.allowed_tokens().view(np.uint32)
        return [t for t in range(320) if words[t // 32] >> (t % 32) & 1]

    words = BadWordsFilter([[a, b], [c]], 320)  # one-token words are the bias row's, not the filter's
    assert allowed(words) == list(range(320))
    assert words.consume(a) and allowed(words) == [t for t in range(320) if t != b]
    matcher = GrammarCompiler(tokenizer, 320, frozenset({2})).matcher(StructuredOutputsParams(choice=["ab", "ac"]))
    both = BothConstraints(matcher, BadWordsFilter([[a, b]], 320))
    assert allowed(both) == [a]
    assert both.consume(a) and allowed(both) == [c] and not both.is_finished
    assert both.consume(c) and both.is_finished

def test_sampling_params_take_the_constraint_or_its_fields():
    assert SamplingParams(structured_outputs={"choice": ["a", "b"]}).structured_outputs == StructuredOutputsParams(
        choice=["a", "b"])
    with pytest.raises(ValueError, match="invalid structured_outputs: .*unexpected keyword argument 'pattern'"):
        SamplingParams(structured_outputs={"pattern": "a"})
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams, got 'a'"):
        SamplingParams(structured_outputs="a")


@pytest.mark.parametrize(("fields", "expected"), [
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                  "strict": True}}},
     StructuredOutputsParams(json={"type": "object"})),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"regex": "[ab]+"}}, StructuredOutputsParams(regex="[ab]+")),
    ({"guided_json": '{"type": "integer"}'}, StructuredOutputsParams(json='{"type": "integer"}')),
    ({"guided_regex": "x+"}, StructuredOutputsParams(regex="x+")),
    ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
    ({"guided_grammar": 'start: "x"'}, StructuredOutputsParams(grammar='start: "x"')),
])
def test_the_http_fields_become_the_constraint(fields, expected):
    chat = ChatCompletionRequest(messages=MESSAGES, **fields).to_sampling_params(16)
    completion = CompletionRequest(prompt="x", **fields).to_sampling_params(16)
    assert chat.structured_outputs == completion.structured_outputs == expected


@pytest.mark.parametrize(("fields", "message"), [
    ({"response_format": {"type": "structural_tag"}},
     "response_format type 'structural_tag' is not supported; use 'text', 'json_object' or 'json_schema'"),
    ({"response_format": {"type": "json_schema"}}, "response_format of type 'json_schema' needs json_schema.schema"),
])
def test_an_unsupported_response_format_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ChatCompletionRequest(messages=MESSAGES, **fields)


def test_several_constraints_or_beam_search_with_one_are_refused():
    request = ChatCompletionRequest(messages=MESSAGES, response_format={"type": "json_object"}, guided_regex="a")
    with pytest.raises(ValueError, match="give one structured outputs constraint, got response_format and guided_"):
        request.to_sampling_params(16)
    request = CompletionRequest(prompt="x", guided_choice=["a"], use_beam_search=True, n=2)
    with pytest.raises(ValueError, match="structured outputs are not supported with beam search"):
        request.to_beam_search_params(16)
    with pytest.raises(ValueError, match="invalid structured outputs regex"):
        CompletionRequest(prompt="x", guided_regex="((").to_sampling_params(16)
