"""The pythonic tool call format (Llama 3.2 and 4, ToolACE; vLLM's `pythonic`): the chat handler's parser for
outputs that are a Python list of calls with keyword arguments,

    [get_weather(city='Paris', unit="celsius"), get_time(zone=None, formats=['iso', 24])]

optionally between Llama 4's `<|python_start|>` and `<|python_end|>`. Argument values must be Python literals
(strings, numbers, True/False/None, and lists, tuples and dicts of them; dict keys strings); each is rendered
as JSON with `json.dumps`, so `arguments` is `json.dumps({keyword: value, ...}, ensure_ascii=False)`. An output
is calls when, after optional whitespace (and the start tag), it starts with `[`; inside the list whitespace,
newlines and comments are skipped as Python skips them; text after the list is ignored. Positional
arguments, calls or names inside values, f-strings, bytes, sets, repeated keywords, non-ASCII names, or any
other syntax make the whole output content.

While streaming, a call's name is sent at its `(`, and each keyword argument as soon as its value is
complete (at the `,` or `)` after it), rendered on its own; a finished output is checked once more with
Python's own parser (`ast`) over the whole list, which must read the same calls.
"""

from __future__ import annotations

import ast
import json
import keyword
import math
import re

from jaxserve.entrypoints.tool_parsers.base import ScannedCall, ScannedOutput, ToolParser, find_calls_start
from jaxserve.entrypoints.tool_parsers.json_scan import Status

START_TAG = "<|python_start|>"

_SPACE = re.compile(r"[ \t\f\r\n]*")  # whitespace Python's tokenizer skips inside brackets
_SPACE_OR_COMMENT = re.compile(r"(?:[ \t\f\r\n]+|#[^\r\n]*)*")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PLAIN_RUN = re.compile(r"""[^"'#()\[\]{},]*""")  # value characters that change no nesting
_SINGLE_QUOTED = {q: re.compile(rf"{q}(?:[^{q}\\\r\n]|\\.)*{q}", re.DOTALL) for q in "'\""}
_SINGLE_QUOTED_OPEN = {q: re.compile(rf"{q}(?:[^{q}\\\r\n]|\\.)*\\?\Z", re.DOTALL) for q in "'\""}
_TRIPLE_QUOTED = {q: re.compile(rf"{q * 3}(?:[^\\]|\\.)*?{q * 3}", re.DOTALL) for q in "'\""}


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def scan(self, text: str, final: bool) -> ScannedOutput:
        list_start = find_calls_start(text, final, START_TAG, "[", _skip_space)
        if isinstance(list_start, ScannedOutput):
            return list_start
        scanned = ScannedOutput()
        status, end = _scan_call_list(text, list_start + 1, final, scanned.calls)
        if status is Status.BAD or (final and not _python_reads_same_calls(text[list_start:end], scanned.calls)):
            return ScannedOutput(all_content=True)
        return scanned


def _skip_space(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()


def _skip_space_in_list(text: str, pos: int) -> int:
    """Whitespace and comments, both of which Python skips inside the list's brackets."""
    return _SPACE_OR_COMMENT.match(text, pos).end()


def _out_of_text(final: bool) -> Status:
    return Status.BAD if final else Status.MORE


def _scan_call_list(text: str, pos: int, final: bool, calls: list[ScannedCall]) -> tuple[Status, int]:
    """The calls of the list whose `[` is before `pos`; DONE's position is right after its `]`."""
    while True:
        pos = _skip_space_in_list(text, pos)
        if pos == len(text):
            return _out_of_text(final), pos
        if calls and text[pos] == "]":  # after a trailing comma
            return Status.DONE, pos + 1
        status, pos = _scan_call(text, pos, final, calls)
        if status is not Status.DONE:
            return status, pos
        pos = _skip_space_in_list(text, pos)
        if pos == len(text):
            return _out_of_text(final), pos
        if text[pos] == "]":
            return Status.DONE, pos + 1
        if text[pos] != ",":
            return Status.BAD, pos
        pos += 1


def _scan_call(text: str, pos: int, final: bool, calls: list[ScannedCall]) -> tuple[Status, int]:
    """`name(keyword=value, ...)`; the call joins `calls` once its `(` is read."""
    match = _IDENTIFIER.match(text, pos)
    if match and match.end() == len(text):  # the name may go on
        return _out_of_text(final), len(text)
    if not match or keyword.iskeyword(match.group()):
        return Status.BAD, pos
    pos = _skip_space_in_list(text, match.end())
    if pos == len(text):
        return _out_of_text(final), pos
    if text[pos] != "(":
        return Status.BAD, pos
    call = ScannedCall(name=match.group())
    calls.append(call)
    return _scan_keywords(text, pos + 1, final, call)


def _scan_keywords(text: str, pos: int, final: bool, call: ScannedCall) -> tuple[Status, int]:
    """The keyword arguments after a call's `(`, each added to `call.arguments` once its value is complete;
    DONE's position is right after the `)`."""
    keywords: list[str] = []
    while True:
        pos = _skip_space_in_list(text, pos)
        if pos == len(text):
            return _out_of_text(final), pos
        if text[pos] == ")":
            call.arguments += "}" if keywords else "{}"
            return Status.DONE, pos + 1
        match = _IDENTIFIER.match(text, pos)
        if match and match.end() == len(text):  # the keyword may go on
            return _out_of_text(final), len(text)
        if not match or keyword.iskeyword(match.group()) or match.group() in keywords:
            return Status.BAD, pos
        pos = _skip_space_in_list(text, match.end())
        if pos == len(text):
            return _out_of_text(final), pos
        if text[pos] != "=" or text.startswith("==", pos):
            return Status.BAD, pos
        status, end = _scan_value(text, pos + 1, final)
        if status is not Status.DONE:
            return status, end
        value_json = _literal_json(text[pos + 1:end])
        if value_json is None:
            return Status.BAD, pos
        call.arguments += ("{" if not keywords else ", ") + f"{json.dumps(match.group())}: {value_json}"
        keywords.append(match.group())
        pos = end + 1 if text[end] == "," else end


def _scan_value(text: str, pos: int, final: bool) -> tuple[Status, int]:
    """How far a keyword's value reaches: DONE's position is the `,` or `)` that ends it. Only nesting,
    strings and comments are followed here; `_literal_json` judges the value itself."""
    depth = 0
    while True:
        pos = _PLAIN_RUN.match(text, pos).end()
        if pos == len(text):
            return _out_of_text(final), pos
        char = text[pos]
        if char in "'\"":
            status, pos = _scan_string(text, pos, final)
            if status is not Status.DONE:
                return status, pos
            continue
        if char == "#":
            pos = text.find("\n", pos)
            if pos < 0:
                return _out_of_text(final), len(text)
            continue
        if char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                return (Status.DONE, pos) if char == ")" else (Status.BAD, pos)
            depth -= 1
        elif depth == 0:  # a comma
            return Status.DONE, pos
        pos += 1


def _scan_string(text: str, pos: int, final: bool) -> tuple[Status, int]:
    """A quoted string (any prefix letters were read before it) starting at `pos`. A `''` at the end of the text
    may yet open a triple-quoted string; reading it as an empty one is harmless, since a value only counts
    once the `,` or `)` after it is read."""
    quote = text[pos]
    if text.startswith(quote * 3, pos):
        match = _TRIPLE_QUOTED[quote].match(text, pos)
        return (Status.DONE, match.end()) if match else (_out_of_text(final), len(text))
    match = _SINGLE_QUOTED[quote].match(text, pos)
    if match:
        return Status.DONE, match.end()
    if not final and _SINGLE_QUOTED_OPEN[quote].match(text, pos):
        return Status.MORE, len(text)
    return Status.BAD, pos


def _literal_json(source: str) -> str | None:
    """A Python literal's JSON text, or None if `source` is not one literal."""
    try:
        return json.dumps(_literal(ast.parse(source.strip(), mode="eval").body), ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


def _literal(node: ast.expr):
    """The value of a literal node: str, int, finite float, bool, None, and lists, tuples (as lists) and
    string-keyed dicts of these. Anything else raises ValueError."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (bool, int, float, str))):
        return _finite(node.value)
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)):
        return _finite(-node.operand.value if isinstance(node.op, ast.USub) else node.operand.value)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(element) for element in node.elts]
    if isinstance(node, ast.Dict):
        if not all(isinstance(key, ast.Constant) and isinstance(key.value, str) for key in node.keys):
            raise ValueError("dict keys must be strings")
        return {key.value: _literal(value) for key, value in zip(node.keys, node.values, strict=True)}
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("JSON has no infinity")
    return value


def _python_reads_same_calls(source: str, calls: list[ScannedCall]) -> bool:
    """Whether Python's parser reads the finished list `source` as exactly `calls` (a guard on the scanner)."""
    try:
        tree = ast.parse(source, mode="eval").body
        if not isinstance(tree, ast.List) or len(tree.elts) != len(calls):
            return False
        for node, call in zip(tree.elts, calls, strict=True):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == call.name
                    and not node.args and all(kw.arg is not None for kw in node.keywords)):
                return False
            arguments = {kw.arg: _literal(kw.value) for kw in node.keywords}
            if json.dumps(arguments, ensure_ascii=False) != call.arguments:
                return False
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return False
    return True
