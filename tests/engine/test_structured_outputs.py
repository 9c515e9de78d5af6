"""Structured outputs without a model: what a constraint may be and the errors it gives, through
SamplingParams and the HTTP API's fields (response_format, structured_outputs, guided_*); JSON schemas strict
unless told otherwise (`structured_outputs_config`, a request's `disable_additional_properties`); a constraint
that waits for its `reasoning_end` marker. The constraints on the embedded model (every output valid, other rows
untouched, the openai client) are in tests/e2e/test_embedded_model.py."""

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
    ({"regex": "a", "reasoning_end": ""}, "structured outputs reasoning_end must be a non-empty string, got ''"),
    ({"regex": "a", "disable_additional_properties": "yes"},
     "structured outputs disable_additional_properties must be true or false, got 'yes'"),
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
    waiting = GrammarCompiler(tokenizer, 320, frozenset({2})).matcher(
        StructuredOutputsParams(choice=["ab"], reasoning_end="c"))
    both = BothConstraints(waiting, BadWordsFilter([[a, b]], 320))  # the grammar waits: the bad words alone
    assert allowed(both) == list(range(320))
    assert both.consume(a) and allowed(both) == [t for t in range(320) if t != b]
    assert both.consume(c) and allowed(both) == [a]


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


# ----- strict JSON schemas, and constraints that wait for the reasoning --------------------------------------

ONE_FIELD = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _compiler(**config):
    from jaxserve.config.structured_outputs_config import StructuredOutputsConfig
    from jaxserve.engine.structured_outputs import GrammarCompiler
    from jaxserve.testing.tiny_models import byte_level_tokenizer

    return GrammarCompiler(byte_level_tokenizer(), 320, frozenset({2}), config=StructuredOutputsConfig(**config))


def _feed(compiler, params: StructuredOutputsParams, text: str) -> tuple[str, list[bool]]:
    """How far ``text`` gets under ``params`` (the text before the first token the mask forbids, or all of it and
    "finished" / "open"), and for each token taken whether a mask constrained it."""
    from jaxserve.testing.tiny_models import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    matcher, masked = compiler.matcher(params), []
    for i, token in enumerate(tokenizer(text, add_special_tokens=False).input_ids):
        allowed = matcher.allowed_tokens()
        if allowed is not None and not allowed.view(np.uint32)[token // 32] >> (token % 32) & 1:
            return f"masked after {text[:i]!r}", masked
        masked.append(allowed is not None)
        assert matcher.consume(token)
    return "finished" if matcher.is_finished else "open", masked


def test_json_schemas_allow_no_unnamed_property_unless_told_otherwise():
    """vLLM's default backend is strict; `disable_additional_properties` false (the engine's config or the
    request's, the request's first) allows properties the schema does not name; additionalProperties decides."""
    strict, lenient = _compiler(), _compiler(disable_additional_properties=False)
    extra = '{"a":1,"b":2}'
    assert _feed(strict, StructuredOutputsParams(json=ONE_FIELD), extra)[0] == "masked after '{\"a\":1'"
    assert _feed(strict, StructuredOutputsParams(json=ONE_FIELD), '{"a":1}')[0] == "finished"
    assert _feed(lenient, StructuredOutputsParams(json=ONE_FIELD), extra)[0] == "finished"
    lenient_request = StructuredOutputsParams(json=ONE_FIELD, disable_additional_properties=False)
    assert _feed(strict, lenient_request, extra)[0] == "finished"
    strict_request = StructuredOutputsParams(json=ONE_FIELD, disable_additional_properties=True)
    assert _feed(lenient, strict_request, extra)[0] == "masked after '{\"a\":1'"
    open_schema = {**ONE_FIELD, "additionalProperties": {"type": "integer"}}
    assert _feed(strict, StructuredOutputsParams(json=open_schema), extra)[0] == "finished"


def test_strict_composed_schemas_stay_satisfiable():
    """llguidance intersects the schemas an object meets: closing each allOf member (vLLM's guidance rewrite) would
    refuse every object; here the parent names the members' properties and closes."""
    b = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}
    compiler = _compiler()
    both = StructuredOutputsParams(json={"allOf": [ONE_FIELD, b]})
    assert _feed(compiler, both, '{"a":1,"b":2}')[0] == "finished"
    assert _feed(compiler, both, '{"a":1,"b":2,"c":3}')[0] == "masked after '{\"a\":1,\"b\":2'"
    tagged = StructuredOutputsParams(json={"type": "object", "properties": {"kind": {"type": "string"}},
                                           "required": ["kind"], "anyOf": [ONE_FIELD, b]})
    assert _feed(compiler, tagged, '{"b":2,"kind":"x"}')[0] == "finished"  # llguidance's order: the member's first
    assert _feed(compiler, tagged, '{"b":2,"kind":"x","c":1}')[0] == "masked after '{\"b\":2,\"kind\":\"x\",\"'"


def test_strict_schema_closes_objects_and_leaves_data_and_references_alone():
    from jaxserve.json_schemas import strict_schema

    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"x": {"const": {"properties": {}}}}},
                       "items": {"type": "array", "items": {"properties": {"y": {}}}}},
        "$defs": {"Point": {"properties": {"x": {}}}},
    }
    assert strict_schema(schema) == {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"x": {"const": {"properties": {}}}},
                           "additionalProperties": False},
            "items": {"type": "array", "items": {"properties": {"y": {}}, "additionalProperties": False}},
        },
        "$defs": {"Point": {"properties": {"x": {}}, "additionalProperties": False}},
        "additionalProperties": False,
    }
    assert "additionalProperties" not in schema  # a copy
    by_reference = {"properties": {"a": {}}, "allOf": [{"$ref": "#/$defs/Point"}]}
    assert strict_schema(by_reference) == {"properties": {"a": {}}, "allOf": [{"$ref": "#/$defs/Point"}]}
    assert strict_schema({"type": "object"}) == {"type": "object"}  # names nothing: any object


def test_a_constraint_waits_for_its_reasoning_end_marker():
    """Free tokens (no mask) up to and including the one that completes the marker, which may span tokens; the
    grammar from the next token; `enable_in_reasoning` applies it from the first."""
    waiting = StructuredOutputsParams(choice=["yes"], reasoning_end="</think>")
    compiler = _compiler()
    assert _feed(compiler, waiting, "</thi</think>yes") == ("finished", [False] * 13 + [True] * 3)
    assert _feed(compiler, waiting, "hmm </think>no")[0] == "masked after 'hmm </think>'"
    assert _feed(compiler, waiting, "no end, any text")[0] == "open"
    in_reasoning = _compiler(enable_in_reasoning=True)
    assert _feed(in_reasoning, waiting, "hmm")[0] == "masked after ''"
    assert _feed(in_reasoning, waiting, "yes") == ("finished", [True] * 3)


@pytest.mark.parametrize(("value", "message"), [
    ({"enable_in_reasoning": 1}, "structured_outputs_config: enable_in_reasoning must be true or false, got 1"),
    ({"backend": "xgrammar"}, "structured_outputs_config: unknown key(s) 'backend'; known: "
                              "disable_additional_properties, enable_in_reasoning"),
    ("{nope", "structured_outputs_config: not a JSON object"),
])
def test_a_bad_structured_outputs_config_is_named(value, message):
    from jaxserve.config.engine_config import EngineConfig

    with pytest.raises(ValueError) as err:
        EngineConfig(structured_outputs_config=value)
    assert str(err.value).startswith(message)
    lenient = EngineConfig(structured_outputs_config='{"disable_additional_properties": false}')
    config = lenient.structured_outputs_config
    assert (config.disable_additional_properties, config.enable_in_reasoning) == (False, False)
