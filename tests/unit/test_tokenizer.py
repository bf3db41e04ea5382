"""Tokenizer, chat template and incremental detokenizer (hyserve.model.tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hyserve.model.detokenizer import ByteLevelDetokenizer, IncrementalDetokenizer
from hyserve.model.tokenizer import (
    BOS,
    EOS,
    PAD,
    TINY_SPECIAL_TOKENS,
    Tokenizer,
    TokenizerNotFoundError,
    write_tiny_tokenizer,
)

SPECIAL_IDS = {
    "<pad>": 0,
    "<s>": 1,
    "</s>": 2,
    "<|im_start|>": 312,
    "<|im_end|>": 313,
    "<think>": 314,
    "</think>": 315,
    "<tool_call>": 316,
    "</tool_call>": 317,
    "<tool_response>": 318,
    "</tool_response>": 319,
}
FAST = settings(max_examples=60, deadline=None)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 313]}))
    return d


@pytest.fixture(scope="module")
def tok(tiny_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


# Text with plenty of multi-byte characters (accents, CJK, emoji) but no special-token strings.
texts = st.text(
    alphabet=st.one_of(
        st.characters(codec="utf-8", exclude_categories=("Cs",)),
        st.sampled_from(list("aé日本語🙂 \n\tthe and")),
    ),
    max_size=60,
)


# ---- basics ------------------------------------------------------------------------------------------------
def test_special_tokens(tok):
    assert tok.vocab_size == 320
    for text, i in SPECIAL_IDS.items():
        assert tok.token_to_id(text) == i
        assert tok.encode(text) == [i]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_ids) == (0, 1, (2, 313))
    assert tok.encode("hi", add_special_tokens=True) == [1, *tok.encode("hi")]
    ids = tok.encode("<|im_start|>a<think>b</think><tool_call>c</tool_call></s>")
    # control tokens are dropped, markup tokens stay visible for the reasoning / tool parsers
    assert tok.decode(ids) == "a<think>b</think><tool_call>c</tool_call>"
    assert (
        tok.decode(ids, skip_special_tokens=False)
        == "<|im_start|>a<think>b</think><tool_call>c</tool_call></s>"
    )
    assert tok.is_special(313) and not tok.is_special(314)


def test_merges_make_common_words_short(tok):
    assert len(tok.encode(" the")) == 1 and len(tok.encode(" and")) == 1 and len(tok.encode("ing")) == 1
    assert tok.id_to_token(tok.encode(" the")[0]) == "Ġthe"
    assert tok.encode("A") == [3 + ord("A")]  # byte tokens sit at 3 + byte value


@FAST
@given(texts)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


@FAST
@given(st.lists(st.sampled_from(sorted(SPECIAL_IDS)) | texts, max_size=8))
def test_round_trip_with_special_strings(tok, parts):
    text = "".join(parts)
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_token_text_and_bytes(tok):
    (i,) = tok.encode(" the")
    assert tok.token_text(i) == " the" and tok.token_bytes(i) == b" the"
    first = tok.encode("日")[0]  # first byte of a 3-byte character
    assert tok.token_bytes(first) == "日".encode()[:1]
    assert tok.token_text(first) == "\\xe6"
    assert tok.token_text(313) == "<|im_end|>"
    assert tok.id_to_token(10**6) is None


def test_missing_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerNotFoundError, match="token ids") as e:
        Tokenizer.from_dir(tmp_path)
    assert isinstance(e.value, FileNotFoundError)


def test_bad_tokenizer_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


# ---- chat template -----------------------------------------------------------------------------------------
def test_chat_thinking_on_off(tok):
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.has_chat_template
    assert tok.apply_chat_template(msgs) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert tok.apply_chat_template(msgs, enable_thinking=True).endswith("<|im_start|>assistant\n<think>\n")
    assert (
        tok.apply_chat_template(msgs, enable_thinking=False)
        == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think></think>"
    )
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"


def test_chat_system_and_history(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "2+2?"}]},
        {"role": "assistant", "content": "<think>easy</think>\n4"},
        {"role": "user", "content": "Thanks"},
    ]
    assert tok.apply_chat_template(msgs, enable_thinking=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think></think>4<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n<think></think>"
    )


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for <city> & co",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOLS[0], ensure_ascii=False)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


def test_chat_tools_and_tool_calls(tok):
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Nice"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "1", "content": "18C"},
    ]
    out = tok.apply_chat_template(msgs, tools=TOOLS)
    assert out == (
        "<|im_start|>system\n" + TOOL_BLOCK + "<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think></think>"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nice"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\n18C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    with_system = tok.apply_chat_template([{"role": "system", "content": "Sys."}, msgs[0]], tools=TOOLS)
    assert with_system.startswith("<|im_start|>system\nSys.\n\n" + TOOL_BLOCK + "<|im_end|>\n")


def test_chat_errors(tok, tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="Unexpected message role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    (tmp_path / "tokenizer.json").write_text((tiny_dir / "tokenizer.json").read_text())
    bare = Tokenizer.from_dir(tmp_path)
    assert not bare.has_chat_template and bare.eos_token_ids == () and bare.bos_token_id is None
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_sources(tiny_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_text((tiny_dir / "tokenizer.json").read_text())
    config = {
        "eos_token": {"content": "<|im_end|>", "special": True},
        "bos_token": "<s>",
        "chat_template": [
            {"name": "default", "template": "D{{ bos_token }}{{ messages[0].content }}"},
            {"name": "tool_use", "template": "T{{ tools | length }}{{ '<x>' | tojson }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    t = Tokenizer.from_dir(tmp_path)
    assert t.eos_token_ids == (313,)
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "D<s>hi"
    assert t.apply_chat_template([], tools=[{}]) == 'T1"<x>"'  # tojson does not HTML-escape
    (tmp_path / "chat_template.jinja").write_text(
        "{% generation %}J{{ raise_exception('boom') }}{% endgeneration %}"
    )
    with pytest.raises(ValueError, match="boom"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([])


def test_chat_template_matches_transformers(tiny_dir, tok):
    """transformers renders the shipped template identically (same jinja environment semantics)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    convs = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
         {"role": "assistant", "content": "A"}],
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": None,
          "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": [1, "é"]}}}]},
         {"role": "tool", "content": "ok"}],
    ]  # fmt: skip
    for msgs in convs:
        for kwargs in ({}, {"enable_thinking": False}, {"tools": TOOLS}):
            ours = tok.apply_chat_template(msgs, **kwargs)
            theirs = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
            assert ours == theirs
    assert hf.encode("a the 日", add_special_tokens=False) == tok.encode("a the 日")


# ---- incremental detokenizer -------------------------------------------------------------------------------
KINDS = ("bytes", "window")


def _det(tok: Tokenizer, kind: str, **kw):
    """The byte-level detokenizer (what the tiny byte-level tokenizer streams with) or the windowed one."""
    if kind == "bytes":
        det = tok.incremental_detokenizer(**kw)
        assert isinstance(det, ByteLevelDetokenizer)
        return det
    return IncrementalDetokenizer(tok, **kw)


def _stream(tok: Tokenizer, ids: list[int], kind: str, **kw) -> tuple[list[str], str]:
    det = _det(tok, kind, **kw)
    deltas = [det.feed(i) for i in ids]
    tail = det.flush()
    assert det.text == "".join(deltas) + tail
    return deltas, tail


@FAST
@given(texts)
def test_detokenizer_never_splits_characters(tok, text):
    # a special token's spelling in the text ("<s>") encodes to that token, which decoding skips
    assume(not any(sp in text for sp in (PAD, BOS, EOS, *TINY_SPECIAL_TOKENS)))
    ids = tok.encode(text)
    for kind in KINDS:
        deltas, tail = _stream(tok, ids, kind)
        assert "".join(deltas) == text and tail == ""
        assert not any("\ufffd" in d for d in deltas)


@FAST
@given(st.lists(st.integers(0, 319), max_size=40), st.booleans())
def test_detokenizer_random_ids_match_full_decode(tok, ids, skip):
    """Arbitrary ids (invalid UTF-8, specials): deltas + flush == one-shot decode."""
    for kind in KINDS:
        deltas, tail = _stream(tok, ids, kind, skip_special_tokens=skip)
        assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip), kind


@pytest.mark.parametrize("kind", KINDS)
def test_detokenizer_holds_multibyte_until_complete(tok, kind):
    ids = tok.encode("a🙂b")  # 🙂 is 4 byte tokens
    assert len(ids) == 6
    det = _det(tok, kind)
    assert [det.feed(i) for i in ids] == ["a", "", "", "", "🙂", "b"]
    det = _det(tok, kind)
    assert det.feed_many(ids[:3]) == "a" and det.flush() == "\ufffd"  # stream ended mid-character


def test_a_sentencepiece_tokenizer_streams_through_the_window(tmp_path):
    """A tokenizer whose decoder is not plain ByteLevel (Metaspace: '▁' is a space, dropped at the start) has
    no byte table, so its streams decode a window; deltas + flush still equal the one-shot decode."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "▁the": 1, "▁world": 2, "▁": 3, "h": 4, "i": 5, "é": 6}
    hf = HFTokenizer(models.WordPiece(vocab, unk_token="<unk>", max_input_chars_per_word=100))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    tok = Tokenizer(hf)
    assert tok.stream_bytes is None
    ids = [1, 2, 4, 5, 3, 6, 1]
    det = tok.incremental_detokenizer()
    assert isinstance(det, IncrementalDetokenizer)
    assert det.feed_many(ids) + det.flush() == tok.decode(ids) == "the worldhi é the"
    # after a prompt, the first output token's word boundary is a space
    det = tok.incremental_detokenizer(prompt_ids=[2])
    assert det.feed_many(ids) + det.flush() == " the worldhi é the"


def test_detokenizer_prompt_context(tok):
    prompt = tok.encode("Hello")
    det = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert det.feed_many(tok.encode(" the world")) == " the world"
