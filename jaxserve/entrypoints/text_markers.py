"""Text helpers shared by the tool call and reasoning parsers, which read the engine's output text while it
streams: where a marker such as `<tool_call>` or `</think>` stands, how much of the text's end could still grow
into one (and so cannot be sent as plain text yet), and where a run of whitespace ends."""

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


def may_become_marker(text: str, pos: int, marker: str) -> bool:
    """Whether all of the text from `pos` on is a proper beginning of `marker` (or nothing), so that more text
    may still make it the marker."""
    return len(text) - pos < len(marker) and marker.startswith(text[pos:])


def find_marker(text: str, marker: str, final: bool, start: int = 0) -> tuple[int, bool]:
    """Where `marker` first stands in `text` at or after `start`, and True; or, when it is not there, where the
    text that cannot be part of it ends, and False: at the text's end once the text is `final`, otherwise
    before a tail that may still grow into the marker (never before `start`)."""
    found = text.find(marker, start)
    if found >= 0:
        return found, True
    if final:
        return len(text), False
    return max(len(text) - held_marker_len(text, marker), start), False


def skip_json_whitespace(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not JSON whitespace (space, tab, newline, return)."""
    return _JSON_WHITESPACE.match(text, pos).end()


def skip_whitespace(text: str, pos: int) -> int:
    """The first position at or after `pos` that is not whitespace in Python's sense (str.isspace)."""
    return _ANY_WHITESPACE.match(text, pos).end()
