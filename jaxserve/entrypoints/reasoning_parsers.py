"""Reasoning parsers (the chat handler's `--reasoning-parser` choices, by vLLM's names): split a reasoning
model's output text into `reasoning_content`, the thinking between `<think>` and `</think>`, and `content`, the
answer after it; whole (`extract`) or streamed (`extract_streaming`). The handler hands the content on to a
tool call parser, if one is on.

- `deepseek_r1`: DeepSeek-R1's template opens `<think>` in the prompt, so the output may start right with the
  reasoning and hold only `</think>` (a leading `<think>` is dropped if the model writes one). Everything
  before `</think>` is reasoning; without `</think>` the whole output is reasoning (cut off while thinking).
- `qwen3`: Qwen3 writes both tags. An output that starts with `<think>` (after optional whitespace) is read as
  above; an output that does not (thinking switched off) is all content. An unclosed `<think>` is all
  reasoning, streamed or not (vLLM's non-streaming qwen3 calls it content; its streaming calls it reasoning).
  Qwen3 thinking models whose template opens `<think>` in the prompt (the 2507 "Thinking" ones) need
  `deepseek_r1`.

Structured outputs wait for the reasoning (vLLM's rule): under a reasoning parser, a request's constraint (a
forced tool call, `response_format`, `guided_*`) applies once the output holds `end_marker`, unless the prompt
ended the reasoning already (`ended_in_prompt`: its last `<think>` or `</think>` is `</think>`, as Qwen3's
template writes `<think>\n\n</think>` with `enable_thinking` false). vLLM reads the same on token ids.

A `<think>` counts only at the start of the output (whitespace before it is dropped with it); elsewhere it is
ordinary text. Whitespace after `<think>` and around `</think>` is kept as the model wrote it. Empty parts are
None in `extract`. While streaming, text that may still
become a tag is held back until it cannot, or until the output is finished; a streamed output's concatenated
deltas always equal `extract` of the whole text.
"""

from __future__ import annotations

from typing import ClassVar

from jaxserve.entrypoints.openai_protocol import DeltaMessage
from jaxserve.entrypoints.text_markers import find_marker, may_become_marker, skip_whitespace

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser:
    """One instance per streamed choice: it remembers what it has sent. `extract` keeps no state."""

    name: ClassVar[str] = ""
    # the chat template opens <think> in the prompt (DeepSeek-R1): an output without it is reasoning up to
    # </think>; otherwise such an output is all content (Qwen3 with thinking switched off)
    opened_by_template: ClassVar[bool] = False
    end_marker: ClassVar[str] = THINK_END  # the text that ends the reasoning: structured outputs start after it

    def __init__(self) -> None:
        self._sent_reasoning = 0
        self._sent_content = 0

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) that `text` shows. `final`: the text is the whole output; otherwise only what
        more text cannot change, so both parts only grow as the text grows."""
        pos = skip_whitespace(text, 0)
        if text.startswith(THINK_START, pos):
            return _split_at_think_end(text, pos + len(THINK_START), final)
        if not final and may_become_marker(text, pos, THINK_START):
            return "", ""
        return _split_at_think_end(text, 0, final) if self.opened_by_template else ("", text)

    @classmethod
    def ended_in_prompt(cls, prompt_text: str) -> bool:
        """Whether the prompt ends the reasoning: `</think>` comes after its last `<think>` (vLLM's
        `is_reasoning_end` on the prompt's tokens)."""
        return prompt_text.rfind(THINK_END) > prompt_text.rfind(THINK_START)

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a finished output; an empty part is None."""
        reasoning, content = self.split(text, final=True)
        return reasoning or None, content or None

    def extract_streaming(
        self, previous_text: str, current_text: str, delta_text: str, finished: bool = False
    ) -> DeltaMessage | None:
        """The delta to send now that the output reads `current_text` (None: nothing yet). `finished`: this is
        the output's last piece, so held-back text is flushed. Only `current_text` is read; the other two
        arguments keep vLLM's signature."""
        reasoning, content = self.split(current_text, final=finished)
        fields = {}
        if len(reasoning) > self._sent_reasoning:
            fields["reasoning_content"] = reasoning[self._sent_reasoning:]
            self._sent_reasoning = len(reasoning)
        if len(content) > self._sent_content:
            fields["content"] = content[self._sent_content:]
            self._sent_content = len(content)
        return DeltaMessage(**fields) if fields else None


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    opened_by_template = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


def _split_at_think_end(text: str, reasoning_start: int, final: bool) -> tuple[str, str]:
    """(reasoning, content) around the first `</think>` after `reasoning_start`; without one, all reasoning
    (but for a tail that may still become `</think>`)."""
    reasoning_end, found = find_marker(text, THINK_END, final, reasoning_start)
    content = text[reasoning_end + len(THINK_END):] if found else ""
    return text[reasoning_start:reasoning_end], content


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class named `name`; make one instance per streamed choice."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]
