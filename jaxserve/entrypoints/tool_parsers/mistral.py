"""The Mistral tool call format of tokenizers before v11 (vLLM's `mistral`): the chat handler's parser for
outputs such as

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]

`[TOOL_CALLS]` is a special token, so the server must keep special tokens in the output text. Text before it
is content; after it comes one JSON list of call objects, and text after the list is ignored. A list that is
broken, empty, or holds something other than calls makes the whole output content. Call ids are 9 letters and
digits, the only ids Mistral's chat templates accept back in later turns.
"""

from __future__ import annotations

import random
import string

from jaxserve.entrypoints.text_markers import find_marker, skip_json_whitespace
from jaxserve.entrypoints.tool_parsers.base import ScannedOutput, ToolParser
from jaxserve.entrypoints.tool_parsers.json_scan import Status, scan_call_object

TOOL_CALLS = "[TOOL_CALLS]"
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def new_call_id(self) -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def scan(self, text: str, final: bool) -> ScannedOutput:
        start, found = find_marker(text, TOOL_CALLS, final)
        scanned = ScannedOutput(content=text[:start])
        if not found:
            return scanned
        pos = skip_json_whitespace(text, start + len(TOOL_CALLS))
        if pos == len(text):
            return ScannedOutput(all_content=True) if final else scanned
        if text[pos] != "[":
            return ScannedOutput(all_content=True)
        status = _scan_call_list(text, pos + 1, final, scanned)
        if status is Status.BAD or (status is Status.MORE and final):
            return ScannedOutput(all_content=True)
        return scanned


def _scan_call_list(text: str, pos: int, final: bool, scanned: ScannedOutput) -> Status:
    """The call objects of the list whose `[` is before `pos`, appended to `scanned.calls`."""
    while True:
        pos = skip_json_whitespace(text, pos)
        if pos == len(text):
            return Status.MORE
        status, end, call = scan_call_object(text, pos, final, ("arguments",))
        if status is not Status.BAD:
            scanned.calls.append(call)
        if status is not Status.DONE:
            return status
        pos = skip_json_whitespace(text, end)
        if pos == len(text):
            return Status.MORE
        if text[pos] == "]":
            return Status.DONE
        if text[pos] != ",":
            return Status.BAD
        pos += 1
