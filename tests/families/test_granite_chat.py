"""Granite 4.0's shipped chat template (`templates/granite-4.0-instruct.jinja`: the chat_template.jinja of
IBM's Granite-4.0-H instruct checkpoints, with the default system prompt) through hyserve's chat path:
rendered exactly as transformers renders it (tools, tool calls and responses, documents, content parts),
and a tool call written in the template's own form parsed back by `--tool-call-parser granite4` through
the server, whole and streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hyserve.model.tokenizer import Tokenizer, build_tiny_tokenizer
from hyserve.server.app import ServerOptions, build_app
from tests.server_fixtures import FakeEngine, serve_app_in_thread

TEMPLATE = (Path(__file__).parent / "templates" / "granite-4.0-instruct.jinja").read_text()
GEN_PROMPT = "<|start_of_role|>assistant<|end_of_role|>"
END = "<|end_of_text|>"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
DOCS = [{"doc_id": "1", "title": "Paris", "text": "Paris is the capital of France."}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}


def granite_tokenizer() -> Tokenizer:
    return Tokenizer(
        build_tiny_tokenizer(),
        config={"bos_token": "<|end_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>"},
        chat_template=TEMPLATE,
    )


CONVERSATIONS: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    ([{"role": "user", "content": "Hi"}], {}),  # the default system prompt
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], {}),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], {}),
    ([{"role": "user", "content": "Weather in Paris?"}], {"tools": [WEATHER]}),
    (
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [CALL, CALL]},
            {"role": "tool", "content": '{"temp": 21}'},
            {"role": "tool", "content": '{"temp": 25}'},
            {"role": "user", "content": "Thanks"},
        ],
        {"tools": [WEATHER]},
    ),
    ([{"role": "user", "content": "Capital of France?"}], {"documents": DOCS}),
    ([{"role": "user", "content": "Capital?"}], {"tools": [WEATHER], "documents": DOCS}),
]


@pytest.mark.parametrize("case", range(len(CONVERSATIONS)))
def test_granite_template_renders_as_transformers(case: int) -> None:
    render = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    msgs, kwargs = CONVERSATIONS[case]
    ours = granite_tokenizer().apply_chat_template(msgs, **kwargs)
    (theirs,), _ = render(conversations=[msgs], chat_template=TEMPLATE, add_generation_prompt=True, **kwargs)
    assert ours == theirs
    assert ours.endswith(GEN_PROMPT)


def _assistant_text(tok: Tokenizer, calls: list[dict[str, Any]]) -> str:
    """What the template writes for an assistant turn with these calls: the model's output form."""
    user = [{"role": "user", "content": "q"}]
    full = tok.apply_chat_template([*user, {"role": "assistant", "content": "", "tool_calls": calls}],
                                   add_generation_prompt=False)  # fmt: skip
    head = tok.apply_chat_template(user, add_generation_prompt=True)
    assert full.startswith(head) and full.endswith(END + "\n")
    return full[len(head) : -len(END + "\n")]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, FakeEngine]]:
    engine = FakeEngine(tokenizer=granite_tokenizer(), max_seq_len=4096)
    app = build_app(engine, ServerOptions(tool_parser="granite4", default_max_tokens=100))
    with serve_app_in_thread(app) as u:
        yield u, engine


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_in_the_templates_form_parses_back(served: tuple[str, FakeEngine], stream: bool) -> None:
    url, engine = served
    tok = engine.tokenizer
    second = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    text = _assistant_text(tok, [CALL, second])
    seen: list[list[int]] = []
    engine.script = lambda ids, p: seen.append(ids) or [text[i : i + 7] for i in range(0, len(text), 7)]
    msgs = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    body = {"messages": msgs, "tools": [WEATHER], "max_tokens": 100, "stream": stream}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
        content = "".join(d.get("content") or "" for d in deltas)
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    else:
        choice = r.json()["choices"][0]
        calls, content, finish = (
            choice["message"]["tool_calls"],
            choice["message"]["content"],
            choice["finish_reason"],
        )
    assert finish == "tool_calls" and not (content or "").strip()
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Paris", "days": 3},
        {"city": "Rome"},
    ]
    # the engine saw the template's rendering of the request, tools included
    assert tok.decode(seen[-1], skip_special_tokens=False) == tok.apply_chat_template(msgs, tools=[WEATHER])


def test_documents_reach_the_template(served: tuple[str, FakeEngine]) -> None:
    url, engine = served
    seen: list[list[int]] = []
    engine.script = lambda ids, p: seen.append(ids) or ["Paris."]
    msgs = [{"role": "user", "content": "Capital of France?"}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": msgs, "documents": DOCS}, timeout=30)
    assert r.status_code == 200, r.text
    prompt = engine.tokenizer.decode(seen[-1], skip_special_tokens=False)
    assert "<documents>" in prompt and "Paris is the capital of France." in prompt
    r = httpx.post(f"{url}/tokenize", json={"messages": msgs, "documents": DOCS}, timeout=30)
    assert r.status_code == 200 and r.json()["tokens"] == seen[-1]


@pytest.mark.parametrize("documents", [{"text": "x"}, [{"text": 3}], ["plain"]])
def test_documents_of_the_wrong_shape_are_a_400(served: tuple[str, FakeEngine], documents: Any) -> None:
    url, _ = served
    msgs = [{"role": "user", "content": "q"}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": msgs, "documents": documents}, timeout=30)
    assert r.status_code == 400, r.text
    assert "documents" in r.text
