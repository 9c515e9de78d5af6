"""The hermes tool call format (Hermes 2 Pro, Qwen2.5, Qwen3; vLLM's `hermes`): the chat handler's parser for
outputs such as

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"zone": "CET"}}
    </tool_call>

Text before the first `<tool_call>` is content; text between and after the calls is ignored (vLLM does the
same). The last call may lack its `</tool_call>` when the output ends right after its JSON. Any call whose JSON
is broken, has no name, or has arguments that are not an object makes the whole output content.
"""

from __future__ import annotations

from jaxserve.entrypoints.text_markers import find_marker, may_become_marker, skip_json_whitespace
from jaxserve.entrypoints.tool_parsers.base import ScannedOutput, ToolParser
from jaxserve.entrypoints.tool_parsers.json_scan import Status, scan_call_object

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> ScannedOutput:
        start, found = find_marker(text, CALL_START, final)
        scanned = ScannedOutput(content=text[:start])
        while found:
            pos = skip_json_whitespace(text, start + len(CALL_START))
            if pos == len(text):
                return ScannedOutput(all_content=True) if final else scanned
            status, end, call = scan_call_object(text, pos, final, ("arguments",))
            if status is Status.BAD:
                return ScannedOutput(all_content=True)
            scanned.calls.append(call)
            if status is Status.MORE:
                return scanned
            end_status, end = _scan_call_end(text, end, final)
            if end_status is not Status.DONE:
                return ScannedOutput(all_content=True) if end_status is Status.BAD else scanned
            start, found = find_marker(text, CALL_START, final, end)
        return scanned


def _scan_call_end(text: str, pos: int, final: bool) -> tuple[Status, int]:
    """The `</tool_call>` after a call's JSON (optional at the very end of a finished output)."""
    pos = skip_json_whitespace(text, pos)
    if text.startswith(CALL_END, pos):
        return Status.DONE, pos + len(CALL_END)
    if pos == len(text):
        return (Status.DONE, pos) if final else (Status.MORE, pos)
    if not final and may_become_marker(text, pos, CALL_END):
        return Status.MORE, pos
    return Status.BAD, pos
