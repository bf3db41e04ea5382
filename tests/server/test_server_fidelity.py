"""OpenAI-API fidelity over a scripted fake engine (real uvicorn, loopback): logprob
`bytes` are the token's bytes, the `developer` role, monotonic `text_offset` (echo and streaming), no
`tool_calls: []` on plain messages."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from hyserve.model.tokenizer import TINY_CHAT_TEMPLATE, Tokenizer, build_tiny_tokenizer
from hyserve.server.app import ServerOptions, build_app
from tests.server_fixtures import FakeEngine, serve_app_in_thread

BYTE_80 = 131  # the tiny tokenizer's token for the lone byte 0x80 (a UTF-8 continuation byte)


def tiny_tokenizer() -> Tokenizer:
    return Tokenizer(
        build_tiny_tokenizer(),
        config={"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
        chat_template=TINY_CHAT_TEMPLATE,
    )


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(tokenizer=tiny_tokenizer(), max_seq_len=1024)


@pytest.fixture(scope="module")
def url(engine: FakeEngine) -> Iterator[str]:
    with serve_app_in_thread(
        build_app(engine, ServerOptions(reasoning_parser="nemotron-v3", tool_parser="qwen3_coder"))
    ) as u:
        yield u


@pytest.fixture(autouse=True)
def _reset(engine: FakeEngine) -> Iterator[None]:
    engine.script = lambda ids, p: ["Hello", " world"]
    engine.logprob_ids = (7, 8, 9)
    yield


def sse_events(resp: httpx.Response) -> list[Any]:
    return [
        json.loads(line[6:])
        for line in resp.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def test_chat_logprob_bytes_are_the_tokens_bytes(url: str, engine: FakeEngine) -> None:
    engine.logprob_ids = (BYTE_80, 75, 7)
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
    for stream in (False, True):
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": stream}, timeout=10)
        assert r.status_code == 200, r.text
        if stream:
            content = [
                t
                for e in sse_events(r)
                for c in e["choices"]
                for t in (c.get("logprobs") or {}).get("content") or []
            ]
        else:
            content = r.json()["choices"][0]["logprobs"]["content"]
        assert content
        for tok in content:
            assert tok["token"] == "\\x80" and tok["bytes"] == [0x80]
            assert [t["bytes"] for t in tok["top_logprobs"]] == [[0x80], list(b"H")]


def test_developer_role_is_the_system_role(url: str, engine: FakeEngine) -> None:
    seen: list[list[int]] = []
    engine.script = lambda ids, p: seen.append(ids) or ["ok"]
    tok = engine.tokenizer
    for role in ("developer", "system"):
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": [{"role": role, "content": "Be brief."}, {"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert r.status_code == 200, r.text
    assert seen[0] == seen[1]
    assert "<|im_start|>system\nBe brief." in tok.decode(seen[0], skip_special_tokens=False)


def test_developer_role_through_the_openai_client(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    resp = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    )
    assert resp.choices[0].message.reasoning_content == "Hello world"  # no </think>: all reasoning


def test_plain_message_has_no_tool_calls_key(url: str) -> None:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"enable_thinking": False},
        },
        timeout=10,
    )
    msg = r.json()["choices"][0]["message"]
    assert "tool_calls" not in msg and msg["content"] == "Hello world"


def _check_offsets(lp: dict[str, Any], text: str) -> None:
    offs = lp["text_offset"]
    assert len(offs) == len(lp["tokens"])
    assert offs == sorted(offs) and all(0 <= o <= len(text) for o in offs), (offs, len(text))


def test_echo_text_offset_is_monotonic_and_skips_bos(url: str, engine: FakeEngine) -> None:
    engine.script = lambda ids, p: ["ab", "cd", "e"]
    prompt = "Hello, my name is"
    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 3},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert text == prompt + "abcde"
    _check_offsets(lp, text)
    assert lp["tokens"][0] == "<s>" and lp["text_offset"][:2] == [0, 0]  # <s> is not in the echoed text
    n_prompt = len(lp["tokens"]) - 3
    for i in range(1, n_prompt):  # each prompt token's text starts at its offset
        assert text[lp["text_offset"][i] :].startswith(lp["tokens"][i])
    assert lp["text_offset"][n_prompt:] == [len(prompt), len(prompt) + 2, len(prompt) + 4]


def test_token_id_prompt_echo_offsets(url: str, engine: FakeEngine) -> None:
    ids = engine.tokenizer.encode("the cat", add_special_tokens=True)
    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1},
        timeout=10,
    )
    choice = r.json()["choices"][0]
    assert choice["text"].startswith("<s>the cat")  # a token-id prompt echoes its decoded ids
    _check_offsets(choice["logprobs"], choice["text"])
    assert choice["logprobs"]["text_offset"][:2] == [0, 3]


def test_streamed_text_offset_is_cumulative(url: str, engine: FakeEngine) -> None:
    engine.script = lambda ids, p: ["ab", "", "cde", "f"]
    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": [5, 6], "logprobs": 0, "max_tokens": 4, "stream": True},
        timeout=10,
    )
    offs, text = [], ""
    for e in sse_events(r):
        c = e["choices"][0]
        if c["logprobs"]:
            offs += c["logprobs"]["text_offset"]
        text += c["text"]
    assert text == "abcdef" and offs == [0, 2, 2, 5]
    whole = httpx.post(
        f"{url}/v1/completions", json={"prompt": [5, 6], "logprobs": 0, "max_tokens": 4}, timeout=10
    ).json()["choices"][0]
    assert whole["logprobs"]["text_offset"] == offs  # streaming and whole agree
