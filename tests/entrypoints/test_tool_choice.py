"""tool_choice and the chat output parsers without an engine: the request checks, the constraint a forced choice
puts on the output, forced outputs read as tool calls (whole, and streamed in every split), and a reasoning
parser composed with a tool call parser."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import ValidationError

from jaxserve.entrypoints.chat_output import ChatParserOptions, ChoiceOutputParser, finish_reason
from jaxserve.entrypoints.openai_protocol import ChatCompletionRequest
from jaxserve.entrypoints.tool_choice import check_tool_schemas, forced_calls_constraint
from jaxserve.sampling_params import StructuredOutputsParams

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
AUTO = ChatParserOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=MESSAGES, **fields)


def test_tool_choice_defaults_as_vllm_s():
    assert _request().tool_choice == "none"
    assert _request(tools=TOOLS).tool_choice == "auto"
    assert _request(tools=TOOLS, tool_choice="required").forces_tool_calls
    named = _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.forces_tool_calls and not _request(tools=TOOLS).forces_tool_calls


@pytest.mark.parametrize(("fields", "message"), [
    ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set."),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice names the function 'nope', which is not among the tools (get_weather, get_time)"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools must have distinct function names, got ['get_weather', 'get_time', "
                                   "'get_weather']"),
])
def test_bad_tool_requests_are_refused_naming_the_problem(fields, message):
    with pytest.raises(ValidationError) as error:
        _request(**fields)
    assert error.value.errors()[0]["msg"] == f"Value error, {message}"


def test_a_schema_the_grammar_engine_cannot_take_is_named():
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]
    with pytest.raises(ValueError, match=r"^tool 'f' has invalid parameters: invalid structured outputs json: "):
        check_tool_schemas(_request(tools=bad).tools)
    check_tool_schemas(_request(tools=TOOLS).tools)


def test_required_constrains_to_a_list_of_calls_of_the_tools_shapes():
    constraint = forced_calls_constraint(_request(tools=TOOLS, tool_choice="required"))
    StructuredOutputsParams(**constraint)  # the grammar engine takes it
    schema = constraint["json"]
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}},
                         {"name": "get_time", "arguments": {}}], schema)
    for bad in ([], [{"name": "get_weather", "arguments": {"town": "Oslo"}}],
                [{"name": "other", "arguments": {}}], [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = forced_calls_constraint(_request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert single["json"]["maxItems"] == 1
    assert constraint["disable_any_whitespace"] is single["disable_any_whitespace"] is True  # compact JSON


def test_required_lifts_each_tools_defs_and_renames_clashing_ones():
    """Pydantic's schemas keep their models in `$defs`: nested under "required"'s anyOf, their `$ref`s would point
    at a root without them (a 400 "Pointer '/$defs/Unit' does not exist"). Lifted to the root, a name another tool
    took gets this tool's name as a prefix, and a reference to the tool's own root follows it."""
    temperature = {"type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"],
                   "$defs": {"Unit": {"enum": ["c", "f"]}}}
    money = {"type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}, "then": {"$ref": "#"},
                                              "note": {"const": {"$ref": "#"}}},
             "required": ["unit"], "$defs": {"Unit": {"enum": ["usd", "eur"]}}}
    tools = [{"type": "function", "function": {"name": "convert", "parameters": temperature}},
             {"type": "function", "function": {"name": "pay", "parameters": money}}]
    request = _request(tools=tools, tool_choice="required")
    constraint = forced_calls_constraint(request)
    StructuredOutputsParams(**constraint)  # the grammar engine takes it
    schema = constraint["json"]
    assert schema["$defs"] == {"Unit": {"enum": ["c", "f"]}, "pay_Unit": {"enum": ["usd", "eur"]}}
    convert, pay = (call["properties"]["arguments"] for call in schema["items"]["anyOf"])
    assert convert == {"type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"]}
    assert pay["properties"] == {"unit": {"$ref": "#/$defs/pay_Unit"},
                                 "then": {"$ref": "#/items/anyOf/1/properties/arguments"},
                                 "note": {"const": {"$ref": "#"}}}  # a value, not a reference
    jsonschema.validate([{"name": "convert", "arguments": {"unit": "c"}},
                         {"name": "pay", "arguments": {"unit": "eur", "then": {"unit": "usd"}}}], schema)
    for bad in ([{"name": "convert", "arguments": {"unit": "eur"}}], [{"name": "pay", "arguments": {"unit": "c"}}],
                [{"name": "pay", "arguments": {"unit": "usd", "then": {"unit": "f"}}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert request.tools[1].function.parameters == money  # the request's schemas are left as given


def test_a_named_choice_constrains_to_its_arguments():
    named = _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert forced_calls_constraint(named) == {"json": WEATHER, "disable_any_whitespace": True}
    untyped = _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert forced_calls_constraint(untyped) == {"json": {"type": "object"}, "disable_any_whitespace": True}


def _streamed(parser: ChoiceOutputParser, text: str, width: int) -> dict:
    """A stream of ``text`` in pieces of ``width`` characters, reassembled."""
    content, reasoning, calls = "", "", {}
    for end in [*range(width, len(text), width), len(text)]:
        delta = parser.delta(text[:end], finished=end == len(text))
        if delta is None:
            continue
        content += delta.content or ""
        reasoning += delta.reasoning_content or ""
        for call in delta.tool_calls:
            entry = calls.setdefault(call.index, {"name": None, "arguments": ""})
            if call.function.name is not None:
                assert entry["name"] is None  # a name comes once, first
                entry["name"] = call.function.name
            entry["arguments"] += call.function.arguments or ""
    return {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)]}


REQUIRED_OUTPUT = '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, ' \
                  '{"name": "get_time", "arguments": {}}]'


@pytest.mark.parametrize("width", [1, 2, 3, 7, 1000])
def test_forced_outputs_are_tool_calls_whole_and_streamed(width):
    required = _request(tools=TOOLS, tool_choice="required")
    message = ChoiceOutputParser.for_request(required, ChatParserOptions()).message(REQUIRED_OUTPUT)
    whole = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
    assert whole == [{"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                     {"name": "get_time", "arguments": "{}"}]
    assert message.content is None and all(c.id.startswith("call_") and len(c.id) == 29 for c in message.tool_calls)
    streamed = _streamed(ChoiceOutputParser.for_request(required, ChatParserOptions()), REQUIRED_OUTPUT, width)
    assert streamed == {"content": "", "reasoning": "", "calls": whole}
    named = _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    arguments = '{"city": "Paris"}'
    (call,) = ChoiceOutputParser.for_request(named, ChatParserOptions()).message(arguments).tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", arguments)
    streamed = _streamed(ChoiceOutputParser.for_request(named, ChatParserOptions()), arguments, width)
    assert streamed["calls"] == [{"name": "get_weather", "arguments": arguments}]


def test_a_forced_output_cut_short_is_content():
    named = _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = ChoiceOutputParser.for_request(named, ChatParserOptions()).message('{"city": "Par')
    assert (message.content, message.tool_calls) == ('{"city": "Par', [])
    assert finish_reason("length", bool(message.tool_calls)) == "length"
    assert finish_reason("stop", True) == "tool_calls" and finish_reason("stop", False) == "stop"


HERMES_OUTPUT = ('<think>Paris, so get_weather.</think>Let me check.<tool_call>\n'
                 '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


@pytest.mark.parametrize("width", [1, 3, 7, 1000])
def test_reasoning_then_auto_tool_calls_whole_and_streamed(width):
    options = ChatParserOptions(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    request = _request(tools=TOOLS)
    message = ChoiceOutputParser.for_request(request, options).message(HERMES_OUTPUT)
    assert (message.reasoning_content, message.content) == ("Paris, so get_weather.", "Let me check.")
    (call,) = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    streamed = _streamed(ChoiceOutputParser.for_request(request, options), HERMES_OUTPUT, width)
    assert streamed == {"content": "Let me check.", "reasoning": "Paris, so get_weather.",
                        "calls": [{"name": "get_weather", "arguments": call.function.arguments}]}


def test_without_auto_flags_or_tools_the_output_is_content():
    plain = ChoiceOutputParser.for_request(_request(tools=TOOLS), ChatParserOptions())
    assert plain.message(HERMES_OUTPUT).content == HERMES_OUTPUT and plain.tools is None
    none = ChoiceOutputParser.for_request(_request(tools=TOOLS, tool_choice="none"), AUTO)
    assert none.tools is None
    assert _streamed(ChoiceOutputParser.for_request(_request(), AUTO), "plain text", 3)["content"] == "plain text"


def test_parser_flags_are_checked():
    with pytest.raises(ValueError, match=r"^--enable-auto-tool-choice needs --tool-call-parser \(one of hermes, "):
        ChatParserOptions(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="nope"):
        ChatParserOptions(tool_call_parser="nope")


TWO_HERMES_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
                    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("width", [1, 3, 7, 1000])
def test_auto_without_parallel_tool_calls_keeps_the_first_call_as_vllm_filters(width):
    single = _request(tools=TOOLS, parallel_tool_calls=False)
    (call,) = ChoiceOutputParser.for_request(single, AUTO).message(TWO_HERMES_CALLS).tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    first = {"name": "get_weather", "arguments": call.function.arguments}
    assert _streamed(ChoiceOutputParser.for_request(single, AUTO), TWO_HERMES_CALLS, width)["calls"] == [first]
    parallel = ChoiceOutputParser.for_request(_request(tools=TOOLS), AUTO)
    assert [c.function.name for c in parallel.message(TWO_HERMES_CALLS).tool_calls] == ["get_weather", "get_time"]
    assert len(_streamed(ChoiceOutputParser.for_request(_request(tools=TOOLS), AUTO), TWO_HERMES_CALLS,
                         width)["calls"]) == 2
