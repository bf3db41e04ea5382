"""The Nemotron `<think>` parser: whole-output and streaming must agree for any split of the text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyserve.server.reasoning import ReasoningParser, check_reasoning_parser_name, thinking_enabled


def stream(text_pieces: list[str], *, enabled: bool = True) -> tuple[str, str]:
    p = ReasoningParser(enabled=enabled)
    r, c = "", ""
    for piece in text_pieces:
        dr, dc = p.feed(piece)
        r, c = r + dr, c + dc
    dr, dc = p.finish()
    return r + dr, c + dc


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        # template pre-filled "<think>\n": the output starts inside the reasoning
        ("Let me think.\n</think>\n\nThe answer is 4.", "Let me think.\n", "The answer is 4."),
        # the model wrote the opening tag itself
        ("<think>hmm</think>42", "hmm", "42"),
        ("  <think>hmm</think>\n42\n", "hmm", "42\n"),
        # cut off by max_tokens before </think>: all reasoning
        ("still thinking about it", "still thinking about it", None),
        ("<think>still", "still", None),
        # empty reasoning block
        ("</think>answer", None, "answer"),
        ("", None, None),
        # a tag-like prefix that never completes stays in the text
        ("x </thin", "x </thin", None),
        ("a < b</think>c < d", "a < b", "c < d"),
    ],
)
def test_parse(text: str, reasoning: str | None, content: str | None) -> None:
    assert ReasoningParser(enabled=True).parse(text) == (reasoning, content)


def test_thinking_disabled_everything_is_content() -> None:
    assert ReasoningParser(enabled=False).parse("ORANGE-MANGO-42") == (None, "ORANGE-MANGO-42")
    assert ReasoningParser(enabled=False).parse("a</think>b") == (None, "a</think>b")


def test_streaming_holds_back_a_split_end_tag() -> None:
    p = ReasoningParser(enabled=True)
    assert p.feed("abc</th") == ("abc", "")
    assert p.feed("ink>\n\nde") == ("", "de")
    assert p.feed("f") == ("", "f")
    assert p.finish() == ("", "")


def test_streaming_start_tag_split() -> None:
    p = ReasoningParser(enabled=True)
    assert p.feed("<th") == ("", "")
    assert p.feed("ink>x") == ("x", "")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from(["<think>", "</think>", "<", "</", "th", "ink>", "\n", "a", "b c", "</th", "<t"]),
        max_size=12,
    ),
    st.lists(st.integers(min_value=0, max_value=60), max_size=6),
    st.booleans(),
)
def test_streaming_equals_whole(parts: list[str], cuts: list[int], enabled: bool) -> None:
    text = "".join(parts)
    whole_r, whole_c = ReasoningParser(enabled=enabled).parse(text)
    points = sorted({min(c, len(text)) for c in cuts})
    pieces, prev = [], 0
    for c in points:
        pieces.append(text[prev:c])
        prev = c
    pieces.append(text[prev:])
    r, c = stream(pieces, enabled=enabled)
    assert (r or None, c or None) == (whole_r, whole_c)
    # nothing is lost except the tags and the blank lines after </think>
    if enabled:
        assert len(r) + len(c) <= len(text)
    else:
        assert c == text


def test_thinking_enabled_flags() -> None:
    assert thinking_enabled(None)
    assert not thinking_enabled({"enable_thinking": False})
    assert thinking_enabled({"enable_thinking": True}, ["/no_think"])
    assert not thinking_enabled({}, ["You are helpful. /no_think"])


def test_parser_names() -> None:
    assert check_reasoning_parser_name("nemotron-v3") == "nemotron-v3"
    assert check_reasoning_parser_name(None) is None
    with pytest.raises(ValueError, match="reasoning_parser.*nemotron-v3"):
        check_reasoning_parser_name("bogus")
