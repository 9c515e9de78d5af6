"""A chat choice's output text as OpenAI message fields: reasoning, content and tool calls, whole or streamed.

Place in the data flow: the chat handler (`serving_chat.py`) makes one `ChoiceOutputParser` per choice of a
request and hands it each output text. The server's `--reasoning-parser` first splits the reasoning from the
answer (`reasoning_parsers.py`); the answer then goes to a tool call parser when the request's `tool_choice`
forces calls (`tool_choice.py`) or is "auto" on a server started with `--enable-auto-tool-choice
--tool-call-parser NAME` (`tool_parsers/`). With `parallel_tool_calls` false only the first call is kept (vLLM's
filter; a forced "required" choice is constrained to one call besides). A choice that produced calls and stopped
by itself finishes with "tool_calls", as OpenAI's do.
"""

from __future__ import annotations

import dataclasses

from jaxserve.entrypoints.openai_protocol import ChatCompletionRequest, DeltaMessage, ToolCall
from jaxserve.entrypoints.reasoning_parsers import REASONING_PARSERS, ReasoningParser, get_reasoning_parser
from jaxserve.entrypoints.tool_choice import forced_calls_parser
from jaxserve.entrypoints.tool_parsers import TOOL_PARSERS, ToolParser, get_tool_parser


@dataclasses.dataclass(frozen=True)
class ChatParserOptions:
    """The server's flags for chat outputs (vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                             f"{', '.join(TOOL_PARSERS)})")
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # a ValueError naming the choices
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)

    @property
    def auto_tool_choice(self) -> bool:
        return self.enable_auto_tool_choice and self.tool_call_parser is not None


AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
REASONING_CHOICES = tuple(REASONING_PARSERS)


@dataclasses.dataclass
class ParsedMessage:
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)


class ChoiceOutputParser:
    """One choice's parsers: whole outputs (`message`) or the growing text of a stream (`delta`)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, parallel_tool_calls: bool = True):
        self.reasoning = reasoning
        self.tools = tools
        self.parallel_tool_calls = parallel_tool_calls  # False: the first call only
        self.streamed_calls = False  # a streamed choice sent tool calls (its finish reason is "tool_calls")
        self._sent_content = 0

    @classmethod
    def for_request(cls, request: ChatCompletionRequest, options: ChatParserOptions) -> ChoiceOutputParser:
        reasoning = get_reasoning_parser(options.reasoning_parser)() if options.reasoning_parser else None
        if request.forces_tool_calls:
            tools = forced_calls_parser(request)
        elif request.tool_choice == "auto" and request.tools and options.auto_tool_choice:
            tools = get_tool_parser(options.tool_call_parser)()
        else:
            tools = None
        return cls(reasoning, tools, parallel_tool_calls=request.parallel_tool_calls is not False)

    @property
    def keeps_special_tokens(self) -> bool:
        """The tool call format's markers are special tokens (Mistral's `[TOOL_CALLS]`)."""
        return self.tools is not None and self.tools.keeps_special_tokens

    def message(self, text: str) -> ParsedMessage:
        """The fields of a finished output's message."""
        reasoning, content = self.reasoning.extract(text) if self.reasoning else (None, text)
        if self.tools is None or content is None:
            return ParsedMessage(content, reasoning)
        extracted = self.tools.extract(content)
        calls = extracted.tool_calls if self.parallel_tool_calls else extracted.tool_calls[:1]
        return ParsedMessage(extracted.content, reasoning, calls)

    def delta(self, text: str, finished: bool) -> DeltaMessage | None:
        """The delta of a streamed output that now reads ``text`` (None: nothing to send yet)."""
        reasoning, content = self._split_streamed(text, finished)
        answer = self._answer_delta(content, finished)
        fields = answer.model_dump(exclude_unset=True) if answer is not None else {}
        if reasoning:
            fields["reasoning_content"] = reasoning
        return DeltaMessage(**fields) if fields else None

    def _split_streamed(self, text: str, finished: bool) -> tuple[str | None, str]:
        """(the reasoning not sent yet, the whole answer so far)."""
        if self.reasoning is None:
            return None, text
        sent = self.reasoning.extract_streaming("", text, "", finished)
        return (sent.reasoning_content if sent else None), self.reasoning.split(text, final=finished)[1]

    def _answer_delta(self, content: str, finished: bool) -> DeltaMessage | None:
        if self.tools is not None:
            delta = self._first_call_only(self.tools.extract_streaming("", content, "", finished))
            self.streamed_calls |= bool(delta is not None and delta.tool_calls)
            return delta
        new, self._sent_content = content[self._sent_content:], len(content)
        return DeltaMessage(content=new) if new else None


    def _first_call_only(self, delta: DeltaMessage | None) -> DeltaMessage | None:
        """Without parallel tool calls, the pieces of calls after the first are dropped (vLLM keeps index 0)."""
        if delta is None or self.parallel_tool_calls or all(call.index == 0 for call in delta.tool_calls):
            return delta
        fields = delta.model_dump(exclude_unset=True)
        fields["tool_calls"] = [call for call in delta.tool_calls if call.index == 0]
        if not fields["tool_calls"]:
            del fields["tool_calls"]
        return DeltaMessage(**fields) if fields else None


def finish_reason(reason: str | None, tool_calls: bool) -> str | None:
    """OpenAI's "tool_calls" for a choice that called tools and stopped by itself."""
    return "tool_calls" if tool_calls and reason == "stop" else reason
