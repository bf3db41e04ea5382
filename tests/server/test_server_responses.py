"""`POST /v1/responses` over a scripted fake engine, through the official `openai` client
(`client.responses.create`, whole and streamed): text and message-list input, instructions, reasoning
items, function tools and their round trip, usage, the typed stream events, and a 400 naming each
feature this server does not have."""

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

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
CALL_TEXT = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n</function>\n</tool_call>"
)


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    tok = Tokenizer(
        build_tiny_tokenizer(),
        config={"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
        chat_template=TINY_CHAT_TEMPLATE,
    )
    return FakeEngine(tokenizer=tok, max_seq_len=2048)


@pytest.fixture(scope="module")
def url(engine: FakeEngine) -> Iterator[str]:
    app = build_app(engine, ServerOptions(reasoning_parser="nemotron-v3", tool_parser="qwen3_coder"))
    with serve_app_in_thread(app) as u:
        yield u


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)


@pytest.fixture(autouse=True)
def _reset(engine: FakeEngine) -> Iterator[None]:
    engine.script = lambda ids, p: ["Let me think.", "</think>", "Hello", " world"]
    yield


def prompt_of(engine: FakeEngine) -> list[str]:
    seen: list[str] = []
    inner = engine.script

    def script(ids: list[int], p: Any) -> list[str]:
        seen.append(engine.tokenizer.decode(ids, skip_special_tokens=False))
        return inner(ids, p)

    engine.script = script
    return seen


def test_text_input_reasoning_and_message(client: openai.OpenAI, engine: FakeEngine) -> None:
    seen = prompt_of(engine)
    r = client.responses.create(
        model="fake-model", input="Hi there", instructions="Be brief.", max_output_tokens=10
    )
    assert seen[0].startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there")
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Let me think."
    assert r.output_text == "Hello world"
    assert r.usage.output_tokens == 4 and r.usage.output_tokens_details.reasoning_tokens == 2
    assert r.usage.input_tokens == len(engine.tokenizer.encode(seen[0]))
    assert r.instructions == "Be brief." and r.max_output_tokens == 10


def test_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    r = client.responses.create(model="fake-model", input="Hi", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "Hello" and r.output[-1].status == "incomplete"


def test_message_list_input_and_effort_none(client: openai.OpenAI, engine: FakeEngine) -> None:
    engine.script = lambda ids, p: ["Sure."]
    seen = prompt_of(engine)
    r = client.responses.create(
        model="fake-model",
        reasoning={"effort": "none"},
        input=[
            {"role": "developer", "content": "Rules."},
            {"role": "user", "content": [{"type": "input_text", "text": "One"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Two"}]},
            {"role": "user", "content": "Three"},
        ],
    )
    assert r.output_text == "Sure." and [o.type for o in r.output] == ["message"]  # thinking off: all content
    p = seen[0]
    assert (
        p.index("system\nRules.")
        < p.index("user\nOne")
        < p.index("assistant\n<think></think>Two")
        < p.index("user\nThree")
    )
    assert p.endswith("<|im_start|>assistant\n<think></think>")


def test_function_call_round_trip(client: openai.OpenAI, engine: FakeEngine) -> None:
    engine.script = lambda ids, p: ["</think>", CALL_TEXT]
    r = client.responses.create(model="fake-model", input="Weather in Paris?", tools=[WEATHER])
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 3}
    assert call.call_id.startswith("call_") and r.output_text == ""
    engine.script = lambda ids, p: ["</think>", "It is sunny."]
    seen = prompt_of(engine)
    r2 = client.responses.create(
        model="fake-model",
        tools=[WEATHER],
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"},
        ],
    )
    assert r2.output_text == "It is sunny."
    assert '"name": "get_weather"' in seen[0] and "<tool_response>\nsunny, 21C\n</tool_response>" in seen[0]
    assert r2.tools[0].name == "get_weather"


def test_streaming_events(client: openai.OpenAI, engine: FakeEngine) -> None:
    engine.script = lambda ids, p: ["Hmm", "</think>", "Hel", "lo", "\n" + CALL_TEXT]
    events = list(client.responses.create(model="fake-model", input="Hi", tools=[WEATHER], stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Hmm"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello"
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert added == ["reasoning", "message", "function_call"] == [d.type for d in done]
    assert json.loads(done[2].arguments) == {"city": "Paris", "days": 3}
    final = events[-1].response
    assert [o.type for o in final.output] == added and final.output_text == "Hello"
    # the whole reply is the same response
    whole = client.responses.create(model="fake-model", input="Hi", tools=[WEATHER])
    strip = lambda items: [
        {k: v for k, v in o.model_dump().items() if k not in ("id", "call_id")} for o in items
    ]
    assert strip(whole.output) == strip(final.output)
    assert whole.usage == final.usage


def test_stream_failure_is_response_failed(client: openai.OpenAI, engine: FakeEngine) -> None:
    engine.script = lambda ids, p: ["</think>", "a", FakeEngine.FAIL]
    events = list(client.responses.create(model="fake-model", input="Hi", stream=True))
    assert events[-1].type == "response.failed"
    assert "error id" in events[-1].response.error.message  # the detail (the injected failure) is only logged


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"store": True}, "store"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": []}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"n": 2}, "n"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_unsupported_is_a_400_naming_it(url: str, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{url}/v1/responses", json={"input": "Hi", **body}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_openai_client_raises_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="not stored"):
        client.responses.create(model="fake-model", input="Hi", previous_response_id="resp_x")
