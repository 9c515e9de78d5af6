"""Reasoning parsers: exact (reasoning_content, content) of canned outputs for deepseek_r1 and qwen3, and
streams that reassemble to exactly the same for many splits (pieces of 1, 2, 3 and 7 characters, seeded random
splits, the whole text, every single cut), reasoning first, then content."""

from __future__ import annotations

import pytest

from jaxserve.entrypoints.openai_protocol import DeltaMessage
from jaxserve.entrypoints.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from tests.entrypoints.parser_streams import single_cuts, splits_of, stream

# text -> (reasoning_content, content)
DEEPSEEK_R1 = {
    "both_tags": ("<think>\nLet me think.\n</think>\n\nIt is 4.", ("\nLet me think.\n", "\n\nIt is 4.")),
    "start_tag_in_the_prompt": ("Let me think.\n</think>\n\nIt is 4.", ("Let me think.\n", "\n\nIt is 4.")),
    "cut_off_while_thinking": ("Still thinking, 2 < 3 and </thi", ("Still thinking, 2 < 3 and </thi", None)),
    "opened_and_cut_off": ("<think>\nhmm", ("\nhmm", None)),
    "empty_thinking": ("<think></think>Answer", (None, "Answer")),
    "no_answer": ("thinking</think>", ("thinking", None)),
    "whitespace_before_the_tag": ("  \n<think>x</think>y", ("x", "y")),
    "only_the_first_end_tag_counts": ("a < b </think> c </think> d", ("a < b ", " c </think> d")),
    "start_tag_not_at_the_start_is_text": ("so <think>x</think>y", ("so <think>x", "y")),
    "unicode": ("<think>思考中…</think>答案：４", ("思考中…", "答案：４")),
    "partial_start_tag": ("<thi", ("<thi", None)),
    "empty": ("", (None, None)),
}

QWEN3 = {
    "both_tags": ("<think>\nreason\n</think>\n\nanswer", ("\nreason\n", "\n\nanswer")),
    "thinking_off": ("The answer is 4.", (None, "The answer is 4.")),
    "empty_thinking_block": ("<think>\n\n</think>\n\nHello", ("\n\n", "\n\nHello")),
    "whitespace_before_the_tag": ("\n\n<think>r</think>c", ("r", "c")),
    "cut_off_while_thinking": ("<think>\ncut off at </th", ("\ncut off at </th", None)),
    "tag_in_the_middle_is_content": ("The tag <think> is text</think>.", (None, "The tag <think> is text</think>.")),
    "end_tag_without_start_is_content": ("reason</think>answer", (None, "reason</think>answer")),
    "partial_start_tag": ("<thin", (None, "<thin")),
    "whitespace_only": ("  ", (None, "  ")),
    "unicode": ("<think>🤔 ok</think>✅", ("🤔 ok", "✅")),
    "empty": ("", (None, None)),
}

CASES = {"deepseek_r1": DEEPSEEK_R1, "qwen3": QWEN3}
PARAMS = [pytest.param(parser, case, id=f"{parser}-{case}") for parser, cases in CASES.items() for case in cases]


def reassemble(deltas: list[DeltaMessage]) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a stream; no reasoning after the content began, no empty fields."""
    reasoning, content = "", ""
    for delta in deltas:
        assert set(delta.model_dump(exclude_unset=True)) <= {"reasoning_content", "content"}
        assert delta.reasoning_content != "" and delta.content != ""
        if delta.reasoning_content:
            assert not content, "reasoning after content"
            reasoning += delta.reasoning_content
        content += delta.content or ""
    return reasoning or None, content or None


@pytest.mark.parametrize(("parser_name", "case"), PARAMS)
def test_extract_splits_reasoning_from_content(parser_name, case):
    text, expected = CASES[parser_name][case]
    assert get_reasoning_parser(parser_name)().extract(text) == expected


@pytest.mark.parametrize(("parser_name", "case"), PARAMS)
def test_stream_reassembles_to_extract_for_many_splits(parser_name, case):
    text, expected = CASES[parser_name][case]
    for pieces in splits_of(text, most_random_cuts=6) + single_cuts(text):
        assert reassemble(stream(get_reasoning_parser(parser_name), pieces)) == expected, pieces


@pytest.mark.parametrize(("parser_name", "case"), PARAMS)
def test_split_parts_only_grow_with_the_text(parser_name, case):
    text = CASES[parser_name][case][0]
    parser = get_reasoning_parser(parser_name)()
    splits = [parser.split(text[:end], final=False) for end in range(len(text) + 1)] + [parser.split(text, True)]
    for (reasoning, content), (later_reasoning, later_content) in zip(splits, splits[1:], strict=False):
        assert later_reasoning.startswith(reasoning) and later_content.startswith(content)


@pytest.mark.parametrize(
    ("parser_name", "text", "before_finish", "at_finish"),
    [
        ("deepseek_r1", "abc </th", DeltaMessage(reasoning_content="abc "), DeltaMessage(reasoning_content="</th")),
        ("deepseek_r1", "<th", None, DeltaMessage(reasoning_content="<th")),
        ("qwen3", " <thi", None, DeltaMessage(content=" <thi")),
        ("qwen3", "<think>x</think", DeltaMessage(reasoning_content="x"), DeltaMessage(reasoning_content="</think")),
    ],
)
def test_text_that_may_become_a_tag_is_held_until_finished(parser_name, text, before_finish, at_finish):
    parser = get_reasoning_parser(parser_name)()
    assert parser.extract_streaming("", text, text) == before_finish
    assert parser.extract_streaming(text, text, "", finished=True) == at_finish
    assert parser.extract_streaming(text, text, "", finished=True) is None


def test_one_delta_can_carry_the_end_of_reasoning_and_the_start_of_content():
    parser = get_reasoning_parser("qwen3")()
    assert parser.extract_streaming("", "<think>a", "<think>a") == DeltaMessage(reasoning_content="a")
    delta = parser.extract_streaming("<think>a", "<think>ab</think>cd", "b</think>cd")
    assert delta.model_dump(exclude_unset=True) == {"reasoning_content": "b", "content": "cd"}


def test_registry_names_vllm_parsers():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    for name, parser in REASONING_PARSERS.items():
        assert get_reasoning_parser(name) is parser and parser.name == name
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'; choose one of deepseek_r1, qwen3"):
        get_reasoning_parser("r1")


@pytest.mark.parametrize("parser_name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize(("prompt", "ended"), [
    ("<|im_start|>assistant\n", False),  # Qwen3 thinking: the model opens <think> itself
    ("<｜Assistant｜><think>\n", False),  # DeepSeek-R1: the template opens it
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", True),  # Qwen3 with enable_thinking false
    ("<think>a</think>b<|im_start|>user\nmore<|im_start|>assistant\n<think>\n", False),  # an earlier turn's </think>
])
def test_the_prompt_may_end_the_reasoning_so_constraints_apply_at_once(parser_name, prompt, ended):
    """vLLM's `is_reasoning_end` on the prompt: the last of <think> and </think> decides; the end marker is what
    structured outputs wait for otherwise."""
    parser = get_reasoning_parser(parser_name)
    assert (parser.ended_in_prompt(prompt), parser.end_marker) == (ended, "</think>")
