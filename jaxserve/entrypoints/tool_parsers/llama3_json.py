"""The Llama 3.x JSON tool call format (vLLM's `llama3_json`): the chat handler's parser for outputs such as

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

An output is tool calls when, after optional whitespace, it starts with `<|python_tag|>` (kept only when the
server keeps special tokens) or `{`; anything else is all content. The objects take `parameters` (Llama's
name) or `arguments`, and are separated by `;` (or just whitespace). The first text that is neither a separator
nor another object ends the calls and is ignored. An object that is not a call (no name, say, as in a plain
JSON answer) or broken JSON makes the whole output content.
"""

from __future__ import annotations

from jaxserve.entrypoints.text_markers import skip_json_whitespace
from jaxserve.entrypoints.tool_parsers.base import ScannedOutput, ToolParser, find_calls_start
from jaxserve.entrypoints.tool_parsers.json_scan import Status, scan_call_object

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def scan(self, text: str, final: bool) -> ScannedOutput:
        calls_start = find_calls_start(text, final, PYTHON_TAG, "{", skip_json_whitespace)
        if isinstance(calls_start, ScannedOutput):
            return calls_start
        return _scan_calls(text, calls_start, final)


def _scan_calls(text: str, pos: int, final: bool) -> ScannedOutput:
    scanned = ScannedOutput()
    while pos < len(text) and text[pos] == "{":
        status, end, call = scan_call_object(text, pos, final, ("parameters", "arguments"))
        if status is Status.BAD:
            return ScannedOutput(all_content=True)
        scanned.calls.append(call)
        if status is Status.MORE:
            break
        pos = skip_json_whitespace(text, end)
        if text.startswith(";", pos):
            pos = skip_json_whitespace(text, pos + 1)
    return scanned
