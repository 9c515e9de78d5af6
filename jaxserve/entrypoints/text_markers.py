"""Text helpers shared by the tool call and reasoning parsers, which read the engine's output text while it
streams: how much of the text's end could still grow into a marker such as `<tool_call>` or `</think>` (and so
cannot be sent as plain text yet), and where a run of whitespace ends."""

from __future__ import annotations

import re

_JSON_WHITESPACE = re.compile(r"[ \t\n\r]*")
_ANY_WHITESPACE = re.compile(r"\s*")


def held_marker_len(text: str, marker: str) -> int:
    """The length of the longest proper prefix of `marker` that `text` ends with (0 if none): that tail may
    still become the marker once more text comes."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def skip_json_whitespace(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not JSON whitespace (space, tab, newline, return)."""
    return _JSON_WHITESPACE.match(text, pos).end()


def skip_whitespace(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not whitespace in Python's sense (str.isspace)."""
    return _ANY_WHITESPACE.match(text, pos).end()
