"""Tool call parsers: exact whole-text extraction of canned model outputs per format, and streaming that
reassembles to exactly the same answer for many splits of each output (pieces of 1, 2, 3 and 7 characters,
every single cut, seeded random splits), with each call's name in its first delta and nowhere else."""

from __future__ import annotations

import json
import re

import pytest

from jaxserve.entrypoints.openai_protocol import (
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from jaxserve.entrypoints.tool_parsers import TOOL_PARSERS, get_tool_parser
from jaxserve.entrypoints.tool_parsers.base import ScannedOutput
from jaxserve.entrypoints.tool_parsers.json_scan import Status, scan_call_object, scan_value
from tests.entrypoints.parser_streams import single_cuts, split_in_pieces, splits_of, stream

# ----- canned outputs: (text, expected calls as (name, arguments) or None, expected content) ---------------

HERMES = {
    "one_call": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        [("get_weather", '{"city": "Paris", "unit": "celsius"}')], None),
    "content_then_two_calls": (
        'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')], "Let me check both.\n"),
    "unicode_and_nested_arguments": (
        '<tool_call>{"name": "translate", "arguments": {"text": "北京 — café ☕", '
        '"escaped": "caf\\u00e9 \\ud83d\\ude00", '
        '"nested": {"list": [1, -2.5e-3, true, false, null, {"deep": ["x", []]}], "empty": {}}}}</tool_call>',
        [("translate", '{"text": "北京 — café ☕", "escaped": "caf\\u00e9 \\ud83d\\ude00", '
                       '"nested": {"list": [1, -2.5e-3, true, false, null, {"deep": ["x", []]}], "empty": {}}}')],
        None),
    "strings_with_braces_quotes_and_escapes": (
        '<tool_call>{"name": "run", "arguments": {"code": "if (x) { return \\"}\\"; }\\n", "path": "C:\\\\dir\\\\"}}'
        '</tool_call>',
        [("run", '{"code": "if (x) { return \\"}\\"; }\\n", "path": "C:\\\\dir\\\\"}')], None),
    "arguments_before_name_and_extra_members": (
        '<tool_call>{"id": 7, "arguments": {"q": "a,b"}, "type": "function", "name": "search"}</tool_call>',
        [("search", '{"q": "a,b"}')], None),
    "no_arguments_member": ('<tool_call>{"name": "get_time"}</tool_call>', [("get_time", "{}")], None),
    "compact_and_multiline_json_kept_as_written": (
        '<tool_call>{"name":"f","arguments":{\n  "a" : [ 1 ,2 ],"b":{ }\n}}</tool_call>',
        [("f", '{\n  "a" : [ 1 ,2 ],"b":{ }\n}')], None),
    "unclosed_last_call": (
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', [("f", '{"a": 1}')], None),
    "text_between_and_after_calls_ignored": (
        '<tool_call>{"name": "f", "arguments": {}}</tool_call> and then '
        '<tool_call>{"name": "g", "arguments": {"n": 0}}</tool_call>\nDone. <tool_',
        [("f", "{}"), ("g", '{"n": 0}')], None),
    "no_calls": ("The weather in Paris is sunny, 21 °C.", None, "The weather in Paris is sunny, 21 °C."),
    "tags_that_are_not_the_marker": (
        "Use <b>bold</b>, <tool> or <tool_c", None, "Use <b>bold</b>, <tool> or <tool_c"),
    "empty_output": ("", None, None),
}

HERMES_BROKEN = {
    "not_json": "<tool_call>\nget_weather(city=Paris)\n</tool_call>",
    "missing_name": '<tool_call>{"arguments": {"a": 1}}</tool_call>',
    "empty_name": '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    "name_not_a_string": '<tool_call>{"name": ["f"], "arguments": {}}</tool_call>',
    "empty_call": "Hi <tool_call></tool_call>",
    "marker_at_the_end": "Calling: <tool_call>",
    "broken_arguments": '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>',
    "arguments_a_string": '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
    "arguments_null": '<tool_call>{"name": "f", "arguments": null}</tool_call>',
    "trailing_comma": '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>',
    "nan": '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>',
    "raw_newline_in_string": '<tool_call>{"name": "f", "arguments": {"a": "x\ny"}}</tool_call>',
    "two_names": '<tool_call>{"name": "f", "name": "g", "arguments": {}}</tool_call>',
    "unclosed_json": '<tool_call>{"name": "f", "arguments": {"a": 1}',
    "junk_before_end_tag": '<tool_call>{"name": "f", "arguments": {}} oops</tool_call>',
    "second_call_broken": (
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {]}</tool_call>'),
}

LLAMA3_JSON = {
    "one_call_with_python_tag": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "San Francisco, CA"}}',
        [("get_weather", '{"city": "San Francisco, CA"}')], None),
    "one_call_without_tag": (
        '{"name": "get_weather", "parameters": {"city": "SF", "days": 3}}',
        [("get_weather", '{"city": "SF", "days": 3}')], None),
    "several_calls_separated_by_semicolons": (
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": [true, false]}}; '
        '{"name": "c", "parameters": {}}',
        [("a", '{"x": 1}'), ("b", '{"y": [true, false]}'), ("c", "{}")], None),
    "newline_separated_calls_after_whitespace": (
        '\n\n  {"name": "a", "parameters": {"q": "ü\\n"}}\n{"name": "b", "parameters": {"n": {"m": [0.5]}}}',
        [("a", '{"q": "ü\\n"}'), ("b", '{"n": {"m": [0.5]}}')], None),
    "trailing_text_ignored": (
        '{"name": "f", "parameters": {"a": 1}}; That is all.', [("f", '{"a": 1}')], None),
    "no_calls": ("Paris is the capital of France.", None, "Paris is the capital of France."),
    "text_with_braces_later": ("  \nHello {world}", None, "  \nHello {world}"),
    "json_answer_without_name_is_content": ('{"answer": 42, "unit": "km"}', None, '{"answer": 42, "unit": "km"}'),
    "python_tag_then_text": ("<|python_tag|>print(1)", None, "<|python_tag|>print(1)"),
    "python_tag_alone": ("<|python_tag|>", None, "<|python_tag|>"),
    "partial_python_tag": ("<|python", None, "<|python"),
    "whitespace_only": ("\n ", None, "\n "),
}

LLAMA3_JSON_BROKEN = {
    "name_not_a_string": '{"name": 42, "parameters": {}}',
    "broken_json": '{"name": "f", "parameters": {"a": 1 "b": 2}}',
    "parameters_a_list": '{"name": "f", "parameters": [1, 2]}',
    "parameters_and_arguments": '{"name": "f", "parameters": {}, "arguments": {}}',
    "unclosed": '<|python_tag|>{"name": "f", "parameters": {"a": 1}',
    "second_call_not_a_call": '{"name": "f", "parameters": {}}; {"answer": 1}',
}

MISTRAL = {
    "one_call": (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        [("get_weather", '{"city": "Paris"}')], None),
    "two_calls_no_space": (
        '[TOOL_CALLS][{"name": "a", "arguments": {"x": "y"}}, {"arguments": {"z": {"w": [1, 2, 3]}}, "name": "b"}]',
        [("a", '{"x": "y"}'), ("b", '{"z": {"w": [1, 2, 3]}}')], None),
    "content_before": (
        'Sure, checking.[TOOL_CALLS] [{"name": "f", "arguments": {"q": "Zürich 東京"}}]',
        [("f", '{"q": "Zürich 東京"}')], "Sure, checking."),
    "no_arguments_and_trailing_text_ignored": (
        '[TOOL_CALLS] [{"name": "f"}]</s> more', [("f", "{}")], None),
    "no_calls": ("No tools needed: [1, 2] is a list.", None, "No tools needed: [1, 2] is a list."),
    "partial_marker_at_the_end": ("Ends with [TOOL_C", None, "Ends with [TOOL_C"),
}

MISTRAL_BROKEN = {
    "marker_alone": "[TOOL_CALLS]",
    "not_a_list": '[TOOL_CALLS] {"name": "f", "arguments": {}}',
    "empty_list": "[TOOL_CALLS] []",
    "not_calls": '[TOOL_CALLS] [{"arguments": {}}]',
    "unclosed_list": '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}',
    "trailing_comma_in_list": '[TOOL_CALLS] [{"name": "f", "arguments": {}},]',
    "broken_arguments": '[TOOL_CALLS] [{"name": "f", "arguments": {"a": tru}}]',
}

PYTHONIC = {
    "one_call": (
        "[get_weather(city='San Francisco', unit=\"celsius\")]",
        [("get_weather", '{"city": "San Francisco", "unit": "celsius"}')], None),
    "two_calls_one_without_arguments": (
        "[get_weather(city='SF'), get_time()]", [("get_weather", '{"city": "SF"}'), ("get_time", "{}")], None),
    "nested_literals_none_true_tuples": (
        "[book(guests=[{'name': 'Ann', 'age': 30, 'vip': True}, {'name': 'Bo', 'age': None}], "
        "dates=('2024-01-01', '2024-01-02'), budget=-1500.5, notes={}, flags=[[], [False]])]",
        [("book", '{"guests": [{"name": "Ann", "age": 30, "vip": true}, {"name": "Bo", "age": null}], '
                  '"dates": ["2024-01-01", "2024-01-02"], "budget": -1500.5, "notes": {}, "flags": [[], [false]]}')],
        None),
    "strings_with_syntax_inside": (
        r"""[run(code='print("a, b"); x = [1]', pattern="it's ) ] , \" here", raw=r'C:\path\'', """
        "multi='''line1\nline2 ) ' ''', empty='')]",
        [("run", r'{"code": "print(\"a, b\"); x = [1]", "pattern": "it'
                 r"""'s ) ] , \" here", "raw": "C:\\path\\'", "multi": "line1\nline2 ) ' ", "empty": ""}""")],
        None),
    "unicode": (
        "[translate(text='北京 café ☕', target=\"ja\", note='\\u00e9')]",
        [("translate", '{"text": "北京 café ☕", "target": "ja", "note": "é"}')], None),
    "numbers": (
        "[f(a=0, b=1e3, c=-0.5, d=+7, e=0x1F, f=1_000, g=12345678901234567890)]",
        [("f", '{"a": 0, "b": 1000.0, "c": -0.5, "d": 7, "e": 31, "f": 1000, "g": 12345678901234567890}')], None),
    "whitespace_comments_and_trailing_commas": (
        "[\n  get_weather(\n    city = 'Paris',  # the capital\n    days=[1,\n 2],\n  ),\n]",
        [("get_weather", '{"city": "Paris", "days": [1, 2]}')], None),
    "llama4_tags_and_trailing_text_ignored": (
        "<|python_start|>[get_time(zone='UTC')]<|python_end|>", [("get_time", '{"zone": "UTC"}')], None),
    "no_calls": ("The answer is 42.", None, "The answer is 42."),
    "markdown_link_is_content": ("[the docs](https://example.com) say so.", None,
                                 "[the docs](https://example.com) say so."),
    "list_is_content": ("[1, 2, 3]", None, "[1, 2, 3]"),
    "bracketed_note_is_content": ("[Note: nothing to call]", None, "[Note: nothing to call]"),
    "markdown_heading": ("# Title\n[get(x=1)]", None, "# Title\n[get(x=1)]"),
}

PYTHONIC_BROKEN = {
    "empty_list": "[]",
    "attribute_call": "[math.floor(x=1)]",
    "keyword_as_name": "[None(x=1)]",
    "positional_argument": "[get_weather('SF')]",
    "call_in_value": "[f(a=g(1))]",
    "name_in_value": "[f(a=x)]",
    "f_string": "[f(a=f'{x}')]",
    "bytes": "[f(a=b'x')]",
    "set": "[f(a={1, 2})]",
    "non_string_key": "[f(a={1: 2})]",
    "infinity": "[f(a=1e999)]",
    "repeated_keyword": "[f(a=1, a=2)]",
    "keyword_named_class": "[f(class_=1, class=2)]",
    "comparison": "[f(a==1)]",
    "two_values": "[f(a=1 2)]",
    "unclosed": "[f(a=1)",
    "missing_comma": "[f(a=1) g()]",
    "unterminated_string": "[f(a='x\n')]",
}

CASES = {"hermes": HERMES, "llama3_json": LLAMA3_JSON, "mistral": MISTRAL, "pythonic": PYTHONIC}
BROKEN = {"hermes": HERMES_BROKEN, "llama3_json": LLAMA3_JSON_BROKEN, "mistral": MISTRAL_BROKEN,
          "pythonic": PYTHONIC_BROKEN}



def params_of(outputs: dict[str, dict]) -> list:
    return [pytest.param(parser, case, id=f"{parser}-{case}") for parser, cases in outputs.items() for case in cases]


VALID_PARAMS = params_of(CASES)
BROKEN_PARAMS = params_of(BROKEN)


# ----- helpers -----------------------------------------------------------------------------------------------


def reassemble(deltas: list[DeltaMessage]) -> tuple[str | None, list[tuple[str, str]], list[str]]:
    """(content, [(name, arguments)], ids) of a stream, checking OpenAI's delta shape on the way: a call's first
    piece has index, id, type and name and nothing else; later pieces only a non-empty arguments fragment;
    indices count up from 0; no content after the first call."""
    content, names, arguments, ids = "", [], [], []
    for delta in deltas:
        assert delta.role is None and delta.reasoning_content is None
        if delta.content:
            assert not names, "content after a tool call"
            content += delta.content
        for piece in delta.tool_calls:
            dumped = piece.model_dump(exclude_unset=True)
            if piece.index == len(names):
                assert set(dumped) == {"index", "id", "type", "function"} and piece.type == "function"
                assert dumped["function"] == {"name": piece.function.name} and piece.function.name
                names.append(piece.function.name)
                arguments.append("")
                ids.append(piece.id)
            else:
                assert piece.index < len(names)
                assert dumped == {"index": piece.index, "function": {"arguments": piece.function.arguments}}
                assert piece.function.arguments
                arguments[piece.index] += piece.function.arguments
    return content or None, list(zip(names, arguments, strict=True)), ids


def expected_of(parser_name: str, case: str) -> tuple[str, list[tuple[str, str]], str | None]:
    text, calls, content = CASES[parser_name][case]
    return text, calls or [], content


# ----- whole-text extraction ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("parser_name", "case"), VALID_PARAMS)
def test_extract_gives_exact_calls_and_content(parser_name, case):
    text, calls, content = expected_of(parser_name, case)
    extracted = get_tool_parser(parser_name)().extract(text)
    assert extracted.tools_called == bool(calls)
    assert [(call.function.name, call.function.arguments) for call in extracted.tool_calls] == calls
    assert extracted.content == content
    for call in extracted.tool_calls:
        assert call.type == "function"
        assert isinstance(json.loads(call.function.arguments), dict)


@pytest.mark.parametrize(("parser_name", "case"), BROKEN_PARAMS)
def test_broken_calls_are_plain_content(parser_name, case):
    text = BROKEN[parser_name][case]
    extracted = get_tool_parser(parser_name)().extract(text)
    assert (extracted.tools_called, extracted.tool_calls, extracted.content) == (False, [], text)


def test_call_ids_have_openai_shape_and_mistral_shape():
    extracted = get_tool_parser("hermes")().extract(HERMES["content_then_two_calls"][0])
    ids = [call.id for call in extracted.tool_calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", call_id) for call_id in ids) and len(set(ids)) == 2
    mistral_text = MISTRAL["two_calls_no_space"][0]
    mistral_ids = [call.id for call in get_tool_parser("mistral")().extract(mistral_text).tool_calls]
    _, _, streamed_ids = reassemble(stream(get_tool_parser("mistral"), split_in_pieces(mistral_text, 5)))
    for call_id in mistral_ids + streamed_ids:
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call_id)
    assert len(set(mistral_ids + streamed_ids)) == 4


# ----- streaming ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("parser_name", "case"), VALID_PARAMS)
def test_stream_reassembles_to_extract_for_many_splits(parser_name, case):
    text, calls, content = expected_of(parser_name, case)
    for pieces in splits_of(text, most_random_cuts=12):
        assert "".join(pieces) == text
        streamed_content, streamed_calls, ids = reassemble(stream(get_tool_parser(parser_name), pieces))
        assert (streamed_content, streamed_calls) == (content, calls), pieces
        assert len(set(ids)) == len(ids)


@pytest.mark.parametrize(("parser_name", "case"), VALID_PARAMS)
def test_stream_reassembles_to_extract_for_every_single_cut(parser_name, case):
    text, calls, content = expected_of(parser_name, case)
    for pieces in single_cuts(text):
        streamed_content, streamed_calls, _ = reassemble(stream(get_tool_parser(parser_name), pieces))
        assert (streamed_content, streamed_calls) == (content, calls), pieces


@pytest.mark.parametrize(("parser_name", "case"), VALID_PARAMS)
def test_scans_only_grow_with_the_text(parser_name, case):
    """The property the generic streaming rests on: each prefix's scan is a prefix of the next one's."""
    text = CASES[parser_name][case][0]
    parser = get_tool_parser(parser_name)()
    scans = [parser.scan(text[:end], final=False) for end in range(len(text) + 1)] + [parser.scan(text, final=True)]
    for before, after in zip(scans, scans[1:], strict=False):
        assert_grows(before, after)


def assert_grows(before: ScannedOutput, after: ScannedOutput) -> None:
    if before.all_content:
        assert after.all_content
        return
    if after.all_content:  # fine while no call has a name, so none has been sent
        assert all(call.name is None for call in before.calls)
        return
    assert after.content.startswith(before.content)
    assert len(after.calls) >= len(before.calls)
    for old, new in zip(before.calls, after.calls, strict=False):
        assert old.name is None or old.name == new.name
        assert new.arguments.startswith(old.arguments)


@pytest.mark.parametrize(("parser_name", "case"), BROKEN_PARAMS)
def test_broken_streams_are_content_or_stop_after_the_calls_they_sent(parser_name, case):
    """Before any call streamed, a broken output streams as the plain content `extract` answers; a call already
    streamed cannot be taken back, so then the stream stops with what it sent (which was written in the text)."""
    text = BROKEN[parser_name][case]
    for pieces in splits_of(text, most_random_cuts=12):
        streamed_content, streamed_calls, _ = reassemble(stream(get_tool_parser(parser_name), pieces))
        if not streamed_calls:
            assert streamed_content == text, pieces
            continue
        assert text.startswith(streamed_content or "")
        if parser_name != "pythonic":
            assert all(name in text and arguments in text for name, arguments in streamed_calls)


@pytest.mark.parametrize(
    ("parser_name", "text", "sent_before_finish"),
    [
        ("hermes", "abc <tool_", "abc "),
        ("mistral", "see [TOOL_", "see "),
        ("llama3_json", "  <|py", None),
        ("pythonic", "[get_weather", None),
    ],
)
def test_text_that_may_become_a_marker_is_held_until_finished(parser_name, text, sent_before_finish):
    parser = get_tool_parser(parser_name)()
    delta = parser.extract_streaming("", text, text)
    assert (delta.content if delta else None) == sent_before_finish
    final = parser.extract_streaming(text, text, "", finished=True)
    assert final is not None and (sent_before_finish or "") + final.content == text and not final.tool_calls


def test_a_call_is_named_before_its_arguments_even_when_they_come_first():
    text = '<tool_call>{"arguments": {"a": [1, 2]}, "name": "f"}</tool_call>'
    parser = get_tool_parser("hermes")()
    cut = text.index('"name"')
    assert parser.extract_streaming("", text[:cut], text[:cut]) is None
    delta = parser.extract_streaming(text[:cut], text, text[cut:], finished=True)
    first, arguments = delta.tool_calls
    assert (first.index, first.function.name, first.function.arguments) == (0, "f", None)
    assert (arguments.index, arguments.id, arguments.function.arguments) == (0, None, '{"a": [1, 2]}')


def test_streamed_deltas_serialise_as_openai_chunks():
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    deltas = stream(get_tool_parser("hermes"), split_in_pieces(text, 30))
    dumped = [json.loads(delta.model_dump_json(exclude_unset=True)) for delta in deltas]
    call_id = deltas[0].tool_calls[0].id
    assert dumped == [
        {"tool_calls": [{"index": 0, "id": call_id, "type": "function", "function": {"name": "f"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]},
    ]


def test_a_stream_that_stopped_sends_nothing_more():
    text = '<tool_call>{"name": "f", "arguments": {"a": }}</tool_call> more text'
    parser = get_tool_parser("hermes")()
    cut = text.index("{", text.index("arguments"))
    first = parser.extract_streaming("", text[:cut], text[:cut])
    assert first.tool_calls[0].function.name == "f"
    assert parser.extract_streaming(text[:cut], text, text[cut:]) is None
    assert parser.extract_streaming(text, text, "", finished=True) is None


# ----- the JSON prefix scanner ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "unfinished", "finished"),
    [
        ('{"a": [1, "x"]} tail', (Status.DONE, 15), (Status.DONE, 15)),
        ("12", (Status.MORE, 2), (Status.DONE, 2)),  # a number at the end may go on
        ("-", (Status.MORE, 1), (Status.BAD, 0)),
        ("1e+", (Status.MORE, 3), (Status.BAD, 0)),
        ("01", (Status.BAD, 0), (Status.BAD, 0)),
        ("tr", (Status.MORE, 2), (Status.BAD, 0)),
        ('"ab\\u00', (Status.MORE, 7), (Status.BAD, 0)),
        ('"a\\x"', (Status.BAD, 0), (Status.BAD, 0)),
        ('{"a": 1,}', (Status.BAD, 8), (Status.BAD, 8)),
        ('{"a" 1}', (Status.BAD, 5), (Status.BAD, 5)),
        ("[[[[", (Status.MORE, 4), (Status.BAD, 4)),
        ("[" * 5000 + "]" * 5000, (Status.DONE, 10000), (Status.DONE, 10000)),  # no recursion
    ],
)
def test_scan_value_statuses(text, unfinished, finished):
    assert scan_value(text, 0, final=False) == unfinished
    assert scan_value(text, 0, final=True) == finished


def test_scan_call_object_reports_what_is_written_so_far():
    text = '{"name": "f", "arguments": {"a": "b'
    status, end, call = scan_call_object(text, 0, False, ("arguments",))
    assert (status, end, call.name, call.arguments) == (Status.MORE, len(text), "f", '{"a": "b')
    status, end, call = scan_call_object(text + '"}} tail', 0, True, ("arguments",))
    assert (status, end, call.name, call.arguments) == (Status.DONE, len(text) + 3, "f", '{"a": "b"}')


# ----- registry and protocol ---------------------------------------------------------------------------------


def test_registry_names_vllm_parsers():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
    for name, parser in TOOL_PARSERS.items():
        assert get_tool_parser(name) is parser and parser.name == name
    assert get_tool_parser("mistral").keeps_special_tokens and not get_tool_parser("hermes").keeps_special_tokens
    with pytest.raises(ValueError, match="unknown tool call parser 'qwen'.*hermes, llama3_json, mistral, pythonic"):
        get_tool_parser("qwen")


def test_chat_message_without_tool_calls_dumps_as_before():
    assert json.loads(ChatMessage(role="assistant", content="hi").model_dump_json()) == {
        "role": "assistant", "content": "hi"}
    message = ChatMessage(role="assistant", reasoning_content="hmm", tool_calls=[
        ToolCall(id="call_1", function=FunctionCall(name="f", arguments="{}"))])
    assert json.loads(message.model_dump_json()) == {
        "role": "assistant", "content": None, "reasoning_content": "hmm",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert DeltaMessage(content="x").model_dump_json(exclude_unset=True) == '{"content":"x"}'
    piece = DeltaToolCall(index=1, function=DeltaFunctionCall(arguments='{"'))
    assert piece.model_dump_json(exclude_unset=True) == '{"index":1,"function":{"arguments":"{\\""}}'
