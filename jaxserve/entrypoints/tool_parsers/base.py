"""The tool call parser base: turns the engine's output text into OpenAI tool calls, whole or streamed.

The chat handler calls `extract` on a finished output (non-streaming answers) or `extract_streaming` on each
new piece of a streamed output; both are written once here. Each format (hermes, llama3_json, mistral,
pythonic) only describes itself in `scan`: what plain content and which calls (name, arguments so far) a text
shows, a text that may be cut anywhere while the model is still writing.

The streaming contract, which the tests check for every parser and many splits of each output:
- plain content before the calls streams as `content` deltas; text that could still turn into a call's
  marker is held back until it cannot (or until the output is finished);
- each call starts with one `DeltaToolCall` carrying index, id, type "function" and the complete name (no
  arguments); `function.arguments` fragments follow, and their concatenation is exactly the `arguments`
  that `extract` gives for the whole text;
- an output that turns out not to be tool calls (no call, or a broken one) streams as plain content, the
  same content `extract` answers, as long as no call has been streamed yet. A call cannot be taken back:
  when an output breaks after its first call has streamed, the stream stops there (vLLM's parsers stream
  garbage in that case) while `extract` answers the whole text as content.

Arguments are never re-serialised, so they can stream as soon as they are written: the JSON formats hand on
the model's own JSON text of the arguments object, checked to be valid JSON; pythonic renders each keyword
argument with `json.dumps` as soon as its value is complete. Call ids are "call_" and 24 hex digits (OpenAI's
shape); a streamed call's id differs from the one `extract` would make for the same text.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from jaxserve.entrypoints.openai_protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall
from jaxserve.entrypoints.text_markers import may_become_marker


@dataclass
class ScannedCall:
    """A call as far as a text shows it."""

    name: str | None = None  # the complete name; None while the model is still writing it
    arguments: str = ""  # arguments JSON text known to be final: grows, never changes, as the text grows


@dataclass
class ScannedOutput:
    """What a parser's `scan` sees in a text. As the text grows, `content` and each call only grow (a text's
    scan is a prefix of any longer text's scan): that is what makes the generic streaming correct."""

    content: str = ""  # plain content known so far (a prefix of the text)
    calls: list[ScannedCall] = field(default_factory=list)
    all_content: bool = False  # the output is not tool calls (or broken ones): all of it is content


@dataclass(frozen=True)
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None  # None when there is none (OpenAI's null content of a pure tool call answer)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def find_calls_start(
    text: str, final: bool, start_tag: str, opener: str, skip_space: Callable[[str, int], int]
) -> int | ScannedOutput:
    """For the formats whose calls are the whole output, after whitespace and an optional start tag
    (llama3_json's `<|python_tag|>` before `{`, pythonic's `<|python_start|>` before `[`): the position of the
    calls' `opener`; or, where the text has none there, what it shows instead: content (it is not calls),
    nothing yet (it may still become the tag), or a broken output (the tag and no call)."""
    pos = skip_space(text, 0)
    if text.startswith(start_tag, pos):
        pos = skip_space(text, pos + len(start_tag))
    elif may_become_marker(text, pos, start_tag):
        return ScannedOutput(content=text) if final else ScannedOutput()
    if pos == len(text):  # the tag and no call
        return ScannedOutput(all_content=True) if final else ScannedOutput()
    if text[pos] != opener:
        return ScannedOutput(content=text)
    return pos


class ToolParser:
    """One instance per streamed choice: it remembers what it has sent. `extract` keeps no state."""

    name: ClassVar[str] = ""
    # The format's markers are special tokens, so the server must not skip special tokens when detokenizing.
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self) -> None:
        self._sent_content = 0
        self._sent_arguments: list[int] = []  # per streamed call: how much of its arguments has been sent
        self._stopped = False

    def scan(self, text: str, final: bool) -> ScannedOutput:
        """What `text` shows. `final`: the text is the whole output (held-back text is content, an unfinished
        call is broken); otherwise only what more text cannot change."""
        raise NotImplementedError

    def new_call_id(self) -> str:
        return new_call_id()

    def extract(self, text: str) -> ExtractedToolCalls:
        """The tool calls of a finished output, or the whole output as content when it has none or is broken."""
        scanned = self.scan(text, final=True)
        if scanned.all_content or not scanned.calls:
            content = text if scanned.all_content else scanned.content
            return ExtractedToolCalls(tools_called=False, tool_calls=[], content=content or None)
        tool_calls = [
            ToolCall(id=self.new_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))
            for call in scanned.calls
        ]
        return ExtractedToolCalls(tools_called=True, tool_calls=tool_calls, content=scanned.content or None)

    def extract_streaming(
        self, previous_text: str, current_text: str, delta_text: str, finished: bool = False
    ) -> DeltaMessage | None:
        """The delta to send now that the output reads `current_text` (None: nothing to send yet). `finished`:
        this is the output's last piece (the engine gave a finish reason), so held-back text is flushed. The
        parser remembers what it sent, so only `current_text` is read; `previous_text` and `delta_text` keep
        vLLM's signature."""
        if self._stopped:
            return None
        scanned = self.scan(current_text, final=finished)
        if scanned.all_content:
            if self._sent_arguments:  # calls already streamed cannot be taken back
                self._stopped = True
                return None
            scanned = ScannedOutput(content=current_text)
        content = scanned.content[self._sent_content:]
        self._sent_content = max(self._sent_content, len(scanned.content))
        tool_calls = self._call_deltas(scanned.calls)
        fields: dict = {}
        if content:
            fields["content"] = content
        if tool_calls:
            fields["tool_calls"] = tool_calls
        return DeltaMessage(**fields) if fields else None

    def _call_deltas(self, calls: list[ScannedCall]) -> list[DeltaToolCall]:
        deltas = []
        for index, call in enumerate(calls):
            if call.name is None:  # only the last call can still be nameless
                break
            if index == len(self._sent_arguments):
                deltas.append(DeltaToolCall(
                    index=index, id=self.new_call_id(), type="function", function=DeltaFunctionCall(name=call.name)))
                self._sent_arguments.append(0)
            fragment = call.arguments[self._sent_arguments[index]:]
            if fragment:
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment)))
                self._sent_arguments[index] = len(call.arguments)
        return deltas
