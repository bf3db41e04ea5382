"""Tool calls -> OpenAI tool_calls: qwen3_coder XML, typed by the request's schema, and Hermes JSON (Granite
4.0); whole and streamed."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyserve.server.tool_parser import HERMES, ToolCallParser, check_tool_parser_name, convert_value

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "temp": {"type": "number"},
                    "opts": {"type": "object"},
                    "tags": {"type": "array"},
                    "zip": {"type": "string"},
                },
            },
        },
    }
]

ONE_CALL = (
    "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=temp>\n21.5\n"
    '</parameter>\n<parameter=opts>\n{"a": 1}\n</parameter>\n<parameter=tags>\n["x"]\n</parameter>\n'
    "<parameter=zip>\n00123\n</parameter>\n</function>\n</tool_call>"
)


def test_one_call_typed_by_schema() -> None:
    content, calls = ToolCallParser(TOOLS).parse(ONE_CALL)
    assert content == "Let me check."
    assert len(calls) == 1
    assert calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {
        "city": "Paris",
        "days": 3,
        "metric": True,
        "temp": 21.5,
        "opts": {"a": 1},
        "tags": ["x"],
        "zip": "00123",
    }
    assert calls[0].id.startswith("call_")


def test_two_calls_and_no_content() -> None:
    text = (
        "<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=b>\n</function>\n</tool_call>"
    )
    content, calls = ToolCallParser(None).parse(text)
    assert content is None
    assert [c.name for c in calls] == ["a", "b"]
    assert json.loads(calls[0].arguments) == {"x": 1}  # no schema: JSON if it parses
    assert json.loads(calls[1].arguments) == {}


def test_no_call_is_plain_content() -> None:
    assert ToolCallParser(TOOLS).parse("just text, a < b") == ("just text, a < b", [])


def test_bare_function_and_missing_closing_tags() -> None:
    content, calls = ToolCallParser(TOOLS).parse("<function=get_weather>\n<parameter=city>\nRome\n")
    assert content is None
    assert calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Rome"}


def test_multiline_string_value_keeps_inner_newlines() -> None:
    text = (
        "<tool_call>\n<function=f>\n<parameter=code>\nline1\n\nline2\n</parameter>\n</function>\n</tool_call>"
    )
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"properties": {"code": {"type": "string"}}}},
        }
    ]
    _, calls = ToolCallParser(tools).parse(text)
    assert json.loads(calls[0].arguments) == {"code": "line1\n\nline2"}


def test_unparseable_typed_value_falls_back_to_text() -> None:
    assert convert_value("three", {"type": "integer"}) == "three"
    assert convert_value("null", {"type": ["integer", "null"]}) is None
    assert convert_value("7", {"anyOf": [{"type": "integer"}, {"type": "null"}]}) == 7


def test_streaming_emits_call_when_complete() -> None:
    p = ToolCallParser(TOOLS)
    c, calls = p.feed("Checking <tool")
    assert (c, calls) == ("Checking ", [])
    c, calls = p.feed("_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n")
    assert (c, calls) == ("", [])
    c, calls = p.feed("</tool_call>")
    assert c == "" and len(calls) == 1 and json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert p.finish() == ("", [])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(ONE_CALL)), max_size=8))
def test_streaming_equals_whole(cuts: list[int]) -> None:
    points = sorted(set(cuts))
    pieces, prev = [], 0
    for c in points:
        pieces.append(ONE_CALL[prev:c])
        prev = c
    pieces.append(ONE_CALL[prev:])
    p = ToolCallParser(TOOLS)
    content, calls = "", []
    for piece in pieces:
        c, new = p.feed(piece)
        content += c
        calls += new
    c, new = p.finish()
    content += c
    calls += new
    _, whole = ToolCallParser(TOOLS).parse(ONE_CALL)
    assert content.strip() == "Let me check."
    assert [(x.name, x.arguments) for x in calls] == [(x.name, x.arguments) for x in whole]


def test_parser_names() -> None:
    assert check_tool_parser_name("qwen3_coder") == "qwen3_coder"
    assert check_tool_parser_name("Hermes") == "hermes" and check_tool_parser_name("granite4") == "granite4"
    with pytest.raises(ValueError, match="tool_parser: 'mistral' is not one of"):
        check_tool_parser_name("mistral")


# ---- Hermes (Granite 4.0) ----------------------------------------------------------------------------------
HERMES_TWO = (
    "I'll look both up.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n'  # arguments as an escaped string
    "</tool_call>"
)


def _hermes(text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = ToolCallParser(TOOLS, HERMES).parse(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_calls_whole() -> None:
    content, calls = _hermes(HERMES_TWO)
    assert content == "I'll look both up."
    assert calls == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]
    # "parameters" for "arguments", and a list of calls in one block
    _, calls = _hermes(
        '<tool_call>[{"name": "a", "parameters": {}}, {"name": "b", "arguments": {"x": 1}}]</tool_call>'
    )
    assert calls == [("a", {}), ("b", {"x": 1})]


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "a", "arguments": "not an object"}</tool_call>',
        '<tool_call>{"name": "a", "arguments": [1, 2]}</tool_call>',
        '<tool_call>{"name": "a", "arguments": {"n": '
        + "9" * 5000
        + "}}</tool_call>",  # past the digit limit
        '<tool_call>{"name": "a", "arguments": '
        + "[" * 100_000
        + "]" * 100_000
        + "}</tool_call>",  # too deep
        '<tool_call>{"name": "a", "arguments": "' + "[" * 100_000 + '"}</tool_call>',
    ],
)
def test_a_hermes_block_that_is_no_call_stays_content(block: str) -> None:
    content, calls = _hermes("before " + block + " after")
    assert calls == [] and content == "before " + block + " after"


def test_an_unterminated_hermes_call_is_read_at_the_end_or_kept_as_text() -> None:
    assert _hermes('<tool_call>{"name": "a", "arguments": {"x": 1}}') == (None, [("a", {"x": 1})])
    assert _hermes('<tool_call>{"name": ') == ('<tool_call>{"name": ', [])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=60))
def test_hermes_streaming_matches_whole_for_any_split(sizes: list[int]) -> None:
    parser = ToolCallParser(TOOLS, HERMES)
    content, calls, i = "", [], 0
    for n in sizes:
        piece = HERMES_TWO[i : i + n]
        i += n
        c, new = parser.feed(piece)
        content, calls = content + c, calls + new
        assert "<tool" not in content  # a tag's start is held back, never streamed as content
    c, new = parser.feed(HERMES_TWO[i:])
    c2, new2 = parser.finish()
    content, calls = content + c + c2, calls + new + new2
    assert content.strip() == "I'll look both up."
    assert [(x.name, json.loads(x.arguments)) for x in calls] == _hermes(HERMES_TWO)[1]


def test_a_qwen3_parameter_nested_past_the_stack_stays_text() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    assert convert_value(deep, {"type": "array"}) == deep and convert_value(deep, None) == deep
