"""Tool call parsers: the chat handler's `--tool-call-parser` choices, by vLLM's names. Each turns the engine's
output text into OpenAI tool calls (`extract` for a whole output, `extract_streaming` per streamed piece);
`base.py` holds the shared streaming logic, each other module one model family's format."""

from __future__ import annotations

from jaxserve.entrypoints.tool_parsers.base import ExtractedToolCalls, ToolParser
from jaxserve.entrypoints.tool_parsers.hermes import HermesToolParser
from jaxserve.entrypoints.tool_parsers.llama3_json import Llama3JsonToolParser
from jaxserve.entrypoints.tool_parsers.mistral import MistralToolParser
from jaxserve.entrypoints.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class named `name`; make one instance per streamed choice (it remembers what it sent)."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]


__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "ToolParser", "get_tool_parser"]
