"""Reads JSON as a model writes it, for the `scan` of the JSON tool call formats (hermes, llama3_json, mistral,
and tool_choice "required", read as mistral's list): how far a JSON value reaches in a text that may still be
growing, and what a call object `{"name": ..., "arguments": {...}}` shows so far: its name once complete, the
raw text of its arguments as far as written.

Every scan answers a status and a position: DONE (the value ends at the position), MORE (the text ends inside
the value: more output is needed) or BAD (the text is not valid JSON at the position). With `final=True` the
text is the whole output: running out of text is BAD, and a number at the very end is complete. The grammar is
strict JSON (RFC 8259: no NaN, no control characters in strings, no trailing commas), checked as far as the
text goes, so a broken call is found at its first wrong character. Tokens are matched with regular expressions,
so a long string costs one match, not a Python loop over its characters.
"""

from __future__ import annotations

import enum
import json
import re

from jaxserve.entrypoints.text_markers import skip_json_whitespace
from jaxserve.entrypoints.tool_parsers.base import ScannedCall


class Status(enum.Enum):
    DONE = "done"
    MORE = "more"
    BAD = "bad"


_STRING_BODY = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*'
_STRING = re.compile(rf'"{_STRING_BODY}"')
_STRING_START = re.compile(rf'"{_STRING_BODY}(?:\\(?:u[0-9a-fA-F]{{0,3}})?)?\Z')  # an unfinished string
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = re.compile(r"[-+0-9.eE]*")
_LITERALS = ("true", "false", "null")

# what a container scan expects next
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _AFTER_VALUE = range(5)


def _out_of_text(final: bool) -> Status:
    return Status.BAD if final else Status.MORE


def scan_scalar(text: str, pos: int, final: bool) -> tuple[Status, int]:
    """A string, number, true, false or null starting at `pos` (< len(text))."""
    char = text[pos]
    if char == '"':
        match = _STRING.match(text, pos)
        if match:
            return Status.DONE, match.end()
        unfinished = not final and _STRING_START.match(text, pos)
        return (Status.MORE, len(text)) if unfinished else (Status.BAD, pos)
    if char == "-" or char.isdigit():
        return _scan_number(text, pos, final)
    for literal in _LITERALS:
        if text.startswith(literal, pos):
            return Status.DONE, pos + len(literal)
        if not final and len(text) - pos < len(literal) and literal.startswith(text[pos:]):
            return Status.MORE, len(text)
    return Status.BAD, pos


def _scan_number(text: str, pos: int, final: bool) -> tuple[Status, int]:
    end = _NUMBER_CHARS.match(text, pos).end()
    number = text[pos:end]
    if end == len(text) and not final:  # the number may go on; "1e" or "-" are fine if a digit can follow
        valid_so_far = _NUMBER.fullmatch(number) or _NUMBER.fullmatch(number + "0")
        return (Status.MORE, len(text)) if valid_so_far else (Status.BAD, pos)
    return (Status.DONE, end) if _NUMBER.fullmatch(number) else (Status.BAD, pos)


def scan_value(text: str, pos: int, final: bool) -> tuple[Status, int]:
    """Any JSON value starting at `pos` (< len(text)); DONE's position is right after it (trailing whitespace
    is not part of it). Nesting is tracked on a list, not by recursion, so depth costs no stack."""
    closers: list[str] = []
    expect = _VALUE
    while True:
        if expect == _AFTER_VALUE and not closers:
            return Status.DONE, pos
        pos = skip_json_whitespace(text, pos)
        if pos == len(text):
            return _out_of_text(final), len(text)
        char = text[pos]
        if expect == _AFTER_VALUE:
            if char == ",":
                expect = _KEY if closers[-1] == "}" else _VALUE
            elif char == closers[-1]:
                closers.pop()
            else:
                return Status.BAD, pos
            pos += 1
        elif (expect == _VALUE_OR_CLOSE and char == "]") or (expect == _KEY_OR_CLOSE and char == "}"):
            closers.pop()
            expect = _AFTER_VALUE
            pos += 1
        elif expect in (_KEY, _KEY_OR_CLOSE):
            status, pos = _scan_key(text, pos, final)
            if status is not Status.DONE:
                return status, pos
            expect = _VALUE
        elif char in "{[":
            closers.append("}" if char == "{" else "]")
            expect = _KEY_OR_CLOSE if char == "{" else _VALUE_OR_CLOSE
            pos += 1
        else:
            status, pos = scan_scalar(text, pos, final)
            if status is not Status.DONE:
                return status, pos
            expect = _AFTER_VALUE


def _scan_key(text: str, pos: int, final: bool) -> tuple[Status, int]:
    """An object member's key and its colon; DONE's position is where the member's value starts."""
    if text[pos] != '"':
        return Status.BAD, pos
    status, pos = scan_scalar(text, pos, final)
    if status is not Status.DONE:
        return status, pos
    return _scan_colon(text, pos, final)


def _scan_colon(text: str, pos: int, final: bool) -> tuple[Status, int]:
    """The colon after a key, with the whitespace around it; DONE's position is where the value starts."""
    pos = skip_json_whitespace(text, pos)
    if pos == len(text):
        return _out_of_text(final), len(text)
    if text[pos] != ":":
        return Status.BAD, pos
    pos = skip_json_whitespace(text, pos + 1)
    return (Status.DONE, pos) if pos < len(text) else (_out_of_text(final), len(text))


def scan_call_object(
    text: str, pos: int, final: bool, argument_keys: tuple[str, ...]
) -> tuple[Status, int, ScannedCall]:
    """A tool call object starting at `pos` (< len(text)): `{"name": "...", "<argument key>": {...}}` in any
    member order, other members allowed and ignored. The name must be a non-empty string, the arguments an
    object (absent: "{}"); a second name or arguments member is BAD. The call carries the raw arguments text
    written so far, which is final as far as it goes."""
    call = ScannedCall()
    if text[pos] != "{":
        return Status.BAD, pos, call
    pos = skip_json_whitespace(text, pos + 1)
    while pos < len(text) and text[pos] != "}":
        status, pos = _scan_call_member(text, pos, final, argument_keys, call)
        if status is Status.DONE:
            status, pos = _scan_member_separator(text, pos)
        if status is not Status.DONE:
            return status, pos, call
    if pos == len(text):
        return _out_of_text(final), len(text), call
    if call.name is None:
        return Status.BAD, pos, call
    if not call.arguments:  # no arguments member (one that was read is an object's text, never empty)
        call.arguments = "{}"
    return Status.DONE, pos + 1, call


def _scan_call_member(
    text: str, pos: int, final: bool, argument_keys: tuple[str, ...], call: ScannedCall
) -> tuple[Status, int]:
    """One `"key": value` member of a call object, from its key on: the name and the arguments go into `call`,
    other members are skipped. DONE's position is right after the value."""
    if text[pos] != '"':
        return Status.BAD, pos
    status, key_end = scan_scalar(text, pos, final)
    if status is Status.DONE:
        status, value_start = _scan_colon(text, key_end, final)
    if status is not Status.DONE:
        return status, pos
    key = json.loads(text[pos:key_end])
    if key == "name":
        return _scan_name(text, value_start, final, call)
    if key in argument_keys:
        return _scan_arguments(text, value_start, final, call)
    return scan_value(text, value_start, final)


def _scan_member_separator(text: str, pos: int) -> tuple[Status, int]:
    """What follows a member's value: a comma and the next member's key, or the object's `}`. DONE's position
    is that key or `}` (or the text's end, which the caller judges)."""
    pos = skip_json_whitespace(text, pos)
    if pos < len(text) and text[pos] == ",":
        pos = skip_json_whitespace(text, pos + 1)
        if pos < len(text) and text[pos] != '"':  # a key must follow a comma
            return Status.BAD, pos
    elif pos < len(text) and text[pos] != "}":
        return Status.BAD, pos
    return Status.DONE, pos


def _scan_arguments(text: str, pos: int, final: bool, call: ScannedCall) -> tuple[Status, int]:
    """The arguments object, its text so far into `call.arguments`; BAD when it is not an object or the call
    has arguments already."""
    if call.arguments or text[pos] != "{":
        return Status.BAD, pos
    status, end = scan_value(text, pos, final)
    call.arguments = text[pos:end]
    return status, end


def _scan_name(text: str, pos: int, final: bool, call: ScannedCall) -> tuple[Status, int]:
    """The name member's string, into `call.name` once complete; BAD when empty or the call has a name already."""
    if call.name is not None or text[pos] != '"':
        return Status.BAD, pos
    status, end = scan_scalar(text, pos, final)
    if status is Status.DONE:
        name = json.loads(text[pos:end])
        if not name:
            return Status.BAD, pos
        call.name = name
    return status, end
