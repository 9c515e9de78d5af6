"""What a chat request's `tool_choice` asks of the output, and the tool calls read back from it.

Place in the data flow: the chat handler (`serving_chat.py`) checks the request's tools here before it renders the
conversation (each function's `parameters` must be a JSON schema the grammar engine takes), then:
- "required" or a named function: the output is constrained with structured outputs (`forced_calls_constraint`),
  so on any model it is valid calls whose arguments validate against their function's schema. "required" is a
  JSON list of `{"name": ..., "arguments": {...}}` objects, each of one tool's shape (one call only when
  `parallel_tool_calls` is false), as vLLM constrains it, with each tool's `$defs` lifted to the list's root
  (`jaxserve/json_schemas.py`); a named function is its arguments object alone. The
  generated JSON becomes OpenAI `tool_calls` through a parser like the "auto" ones (`forced_calls_parser`), so
  whole and streamed answers are read the same way.
- "auto": the model's own output is parsed by the server's `--tool-call-parser` (`tool_parsers/`).
- "none": the output is content.
"""

from __future__ import annotations

import json
from typing import Any

from jaxserve.entrypoints.openai_protocol import ChatCompletionRequest, ChatCompletionToolsParam, NamedToolChoice
from jaxserve.entrypoints.tool_parsers.base import ScannedCall, ScannedOutput, ToolParser, new_call_id
from jaxserve.entrypoints.tool_parsers.mistral import TOOL_CALLS, MistralToolParser
from jaxserve.json_schemas import nest_schema
from jaxserve.sampling_params import StructuredOutputsParams

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # the arguments of a function that gives no parameters schema


def arguments_schema(tool: ChatCompletionToolsParam) -> dict[str, Any]:
    return tool.function.parameters or ANY_OBJECT


def check_tool_schemas(tools: list[ChatCompletionToolsParam]) -> None:
    """A ValueError naming the first function whose `parameters` the grammar engine cannot take as a JSON schema."""
    for tool in tools:
        try:
            StructuredOutputsParams(json=arguments_schema(tool))
        except ValueError as err:
            raise ValueError(f"tool {tool.function.name!r} has invalid parameters: {err}") from None


def forced_calls_constraint(request: ChatCompletionRequest) -> dict[str, Any]:
    """The structured outputs (`StructuredOutputsParams` fields) of a request whose tool_choice forces calls: compact
    JSON (`disable_any_whitespace`: no free runs of blanks), since with JSON's free whitespace a small model can
    spend its whole max_tokens on blanks inside the call and never close it."""
    tools = request.tools or []
    if isinstance(request.tool_choice, NamedToolChoice):
        return {"json": arguments_schema(named_tool(request)), "disable_any_whitespace": True}
    definitions: dict[str, Any] = {}
    one_call = {"anyOf": [_call_schema(tool, index, definitions) for index, tool in enumerate(tools)]}
    calls = {"type": "array", "items": one_call, "minItems": 1}
    if request.parallel_tool_calls is False:
        calls["maxItems"] = 1
    if definitions:
        calls["$defs"] = definitions
    return {"json": calls, "disable_any_whitespace": True}


def _call_schema(tool: ChatCompletionToolsParam, index: int, definitions: dict[str, Any]) -> dict[str, Any]:
    """One call of ``tool`` (the ``index``-th): its name and its arguments, whose `$defs` move to the combined
    schema's root ``definitions`` (as vLLM lifts them; a name another tool took is prefixed with this tool's name,
    where vLLM refuses the request) and whose `$ref`s follow them."""
    name = tool.function.name
    arguments = nest_schema(arguments_schema(tool), f"/items/anyOf/{index}/properties/arguments", definitions,
                            prefix=f"{name}_")
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [name]}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def named_tool(request: ChatCompletionRequest) -> ChatCompletionToolsParam:
    (tool,) = (t for t in request.tools or [] if t.function.name == request.tool_choice.function.name)
    return tool


class RequiredCallsParser(MistralToolParser):
    """The output of tool_choice "required", a JSON list of `{"name", "arguments"}` calls, is Mistral's format
    without its marker: read by the same scanner, whole or streamed, with OpenAI-shaped call ids."""

    name = "required"
    keeps_special_tokens = False

    def new_call_id(self) -> str:
        return new_call_id()

    def scan(self, text: str, final: bool) -> ScannedOutput:
        return super().scan(TOOL_CALLS + text, final)


class NamedCallParser(ToolParser):
    """The output of a named tool_choice is the function's arguments object: one call, its arguments the text
    as generated (leading whitespace dropped), streamed as it grows."""

    name = "named"

    def __init__(self, function_name: str):
        super().__init__()
        self.function_name = function_name

    def scan(self, text: str, final: bool) -> ScannedOutput:
        arguments = text.lstrip()
        if final and not _is_json(arguments):  # cut off (max_tokens): the output is content
            return ScannedOutput(all_content=True)
        return ScannedOutput(calls=[ScannedCall(name=self.function_name, arguments=arguments)])


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def forced_calls_parser(request: ChatCompletionRequest) -> ToolParser:
    """The parser of a request whose tool_choice forces calls (one instance per choice)."""
    if isinstance(request.tool_choice, NamedToolChoice):
        return NamedCallParser(request.tool_choice.function.name)
    return RequiredCallsParser()
