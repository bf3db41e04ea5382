"""The HTTP layer over a scripted fake engine (real uvicorn, loopback): parsers end to end, every error
path (bad input -> 4xx naming the field, engine failure -> 500 / SSE error event, disconnects -> abort),
API key, health, metrics. The real-engine end-to-end tests are in test_server_e2e.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from hyserve.engine.sampling_params import SamplingParams
from hyserve.model.tokenizer import TINY_CHAT_TEMPLATE, Tokenizer, build_tiny_tokenizer
from hyserve.server.app import ServerOptions, build_app
from tests.server_fixtures import FakeEngine, parse_metrics, serve_app_in_thread, wait_until


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
    app = build_app(
        engine,
        ServerOptions(
            reasoning_parser="nemotron-v3",
            tool_parser="qwen3_coder",
            model_aliases=("nvidia/Some-Model",),
            default_max_tokens=100,
        ),
    )
    with serve_app_in_thread(app) as u:
        yield u


@pytest.fixture(autouse=True)
def _reset(engine: FakeEngine) -> Iterator[None]:
    engine.script = lambda ids, p: ["Hello", " world"]
    engine.healthy = True
    engine.aborted.clear()
    yield


def chat(url: str, **body: Any) -> httpx.Response:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


def sse_events(resp: httpx.Response) -> list[Any]:
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_error(resp: httpx.Response, status: int, param: str | None = None, *words: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    return err


# ---- reasoning + tool calls --------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
TOOL_OUTPUT = [
    "I should call",
    " the tool.</th",
    "ink>\n\n",
    "<tool_call>\n<function=get_weather>\n",
    "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n",
    "</function>\n</tool_call>",
]


def test_reasoning_and_tool_call_non_streaming(url: str, engine: FakeEngine) -> None:
    engine.script = lambda ids, p: TOOL_OUTPUT
    r = chat(url, tools=[WEATHER_TOOL], max_tokens=50)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    msg = ch["message"]
    assert msg["reasoning_content"] == "I should call the tool."
    assert msg["content"] is None
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}


def test_reasoning_and_tool_call_streaming(url: str, engine: FakeEngine) -> None:
    engine.script = lambda ids, p: TOOL_OUTPUT
    r = chat(url, tools=[WEATHER_TOOL], max_tokens=50, stream=True)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    reasoning = "".join(
        c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks if c["choices"]
    )
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    calls = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert reasoning == "I should call the tool."
    assert content == ""
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


HERMES_OUTPUT = [
    "Checking.\n<tool_",
    'call>\n{"name": "get_weather", "arguments": ',
    '{"city": "Paris", "days": 3}}\n</tool_call>',
]


@pytest.mark.parametrize("stream", [False, True])
def test_a_hermes_server_parses_json_tool_calls(engine: FakeEngine, stream: bool) -> None:
    """`--tool-call-parser hermes` (Granite 4.0's format): a JSON call in <tool_call> tags becomes tool_calls,
    whole and streamed, with the text before it as content."""
    engine.script = lambda ids, p: HERMES_OUTPUT
    app = build_app(engine, ServerOptions(tool_parser="hermes", default_max_tokens=100))
    with serve_app_in_thread(app) as u:
        r = chat(u, tools=[WEATHER_TOOL], max_tokens=50, stream=stream)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [c for c in sse_events(r)[:-1] if c["choices"]]
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        ch = r.json()["choices"][0]
        content, calls, finish = ch["message"]["content"], ch["message"]["tool_calls"], ch["finish_reason"]
    assert content.strip() == "Checking." and finish == "tool_calls"
    (call,) = calls
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}


def test_enable_thinking_false_gives_plain_content(url: str, engine: FakeEngine) -> None:
    seen: list[list[int]] = []
    engine.script = lambda ids, p: seen.append(ids) or ["ORANGE-", "MANGO-42"]
    r = chat(url, chat_template_kwargs={"enable_thinking": False}, max_tokens=10)
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == "ORANGE-MANGO-42" and msg["reasoning_content"] is None
    # the template got the flag: the generation prompt ends with an empty think block
    assert engine.tokenizer.decode(seen[0], skip_special_tokens=False).endswith("<think></think>")


def test_tool_choice_none_does_not_parse(url: str, engine: FakeEngine) -> None:
    engine.script = lambda ids, p: ["</think>", "<tool_call>\n<function=f>\n</function>\n</tool_call>"]
    r = chat(url, tools=[WEATHER_TOOL], tool_choice="none")
    msg = r.json()["choices"][0]["message"]
    assert "tool_calls" not in msg and "<tool_call>" in msg["content"]


# ---- sampling parameters reach the engine -----------------------------------------------------------------


def test_sampling_params_mapping_and_default_max_tokens(url: str, engine: FakeEngine) -> None:
    got: list[tuple[list[int], SamplingParams]] = []
    engine.script = lambda ids, p: got.append((ids, p)) or ["x"]
    r = chat(
        url,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        seed=7,
        stop="END",
        ignore_eos=True,
        max_completion_tokens=9,
        logprobs=True,
        top_logprobs=2,
    )
    assert r.status_code == 200, r.text
    p = got[-1][1]
    assert (
        p.temperature,
        p.top_p,
        p.top_k,
        p.min_p,
        p.seed,
        p.stop,
        p.ignore_eos,
        p.max_tokens,
        p.logprobs,
    ) == (0.5, 0.9, 5, 0.1, 7, ("END",), True, 9, 2)
    lp = r.json()["choices"][0]["logprobs"]["content"][0]
    assert lp["logprob"] == -0.5 and len(lp["top_logprobs"]) == 2
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias) == (
        0.0,
        0.0,
        1.0,
        (),
    )
    r = chat(
        url,
        presence_penalty=0.5,
        frequency_penalty=-1.5,
        repetition_penalty=1.2,
        logit_bias={"7": 5, "3": -100},
    )
    assert r.status_code == 200, r.text
    p = got[-1][1]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias) == (
        0.5,
        -1.5,
        1.2,
        ((3, -100), (7, 5)),
    )
    # max_tokens omitted: the room left in max_seq_len (1024), capped at default_max_tokens (100)
    chat(url)
    assert got[-1][1].max_tokens == 100
    base = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": ""}]}).json()["count"]
    chat(url, messages=[{"role": "user", "content": "z" * (1024 - base - 40)}])  # one token per "z"
    ids, p = got[-1]
    assert p.max_tokens == 1024 - len(ids) == 40


def test_logprobs_minus_inf_is_valid_json(url: str, engine: FakeEngine) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 1, "logprobs": 3}, timeout=10)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-0.5]
    assert min(lp["top_logprobs"][0].values()) == -9999.0


def test_completions_batch_and_echo(url: str, engine: FakeEngine) -> None:
    engine.script = lambda ids, p: ["A", "B"]
    r = httpx.post(
        f"{url}/v1/completions", json={"prompt": ["one", "two"], "max_tokens": 5, "echo": True}, timeout=10
    )
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["text"] for c in body["choices"]] == ["oneAB", "twoAB"]
    assert body["usage"]["completion_tokens"] == 4
    r = httpx.post(
        f"{url}/v1/completions",
        json={
            "prompt": [[5, 6], [7]],
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=10,
    )
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert usage["prompt_tokens"] == 3 and usage["completion_tokens"] == 4
    texts: dict[int, str] = {}
    for e in events[:-2]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: "AB", 1: "AB"}


def test_model_alias_and_models_routes(url: str) -> None:
    assert chat(url, model="nvidia/Some-Model").status_code == 200
    assert chat(url, model="fake-model").status_code == 200
    models = httpx.get(f"{url}/v1/models").json()
    assert models["data"][0]["id"] == "fake-model" and models["data"][0]["max_model_len"] == 1024
    assert httpx.get(f"{url}/v1/models/fake-model").status_code == 200
    assert_error(httpx.get(f"{url}/v1/models/other"), 404, "model")


# ---- bad input -> 4xx naming the field -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"n": 65}, "n", ["n must be between 1 and 64", "65"]),
        ({"n": 0}, "n", ["n must be between 1 and 64"]),
        ({"temperature": -1}, "temperature", ["temperature"]),
        ({"top_p": 0}, "top_p", ["top_p"]),
        ({"top_k": -5}, "top_k", []),
        ({"max_tokens": 0}, "max_tokens", []),
        ({"max_tokens": 5000}, "messages", ["max_seq_len = 1024"]),
        ({"messages": []}, "messages", []),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", []),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
            ["image_url"],
        ),
        ({"top_logprobs": 3}, "top_logprobs", ["logprobs"]),
        ({"logprobs": True, "top_logprobs": 99}, "top_logprobs", []),
        ({"tool_choice": "required"}, "tool_choice", ["needs `tools`"]),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER_TOOL]},
            "tool_choice",
            ["'nope'", "get_weather"],
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", ["'xml'"]),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.schema",
            [],
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            ["send one"],
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", ["exactly one"]),
        ({"presence_penalty": 2.5}, "presence_penalty", ["[-2, 2]"]),
        ({"frequency_penalty": -3}, "frequency_penalty", ["[-2, 2]"]),
        ({"repetition_penalty": 0}, "repetition_penalty", ["(0, 10]"]),
        ({"logit_bias": {"abc": 1}}, "logit_bias", ["token ids", "'abc'"]),
        ({"logit_bias": {"5": 101}}, "logit_bias", ["[-100, 100]"]),
        ({"logit_bias": {"-1": 1}}, "logit_bias", []),
        ({"seed": 2**70}, "seed", []),
        ({"stop": [""]}, "stop", []),
        ({"stop": [f"s{i}" for i in range(65)]}, "stop", ["at most 64 strings", "65 strings"]),
        ({"stop": ["x" * 3000, "y" * 3000]}, "stop", ["at most 4096 characters", "6000"]),
        ({"logit_bias": {"\u00b2": 1}}, "logit_bias", ["token ids"]),  # str.isdigit() is True for '²'
        ({"logit_bias": {"\u0663": 1}}, "logit_bias", ["token ids"]),  # Arabic-Indic 3: not an ASCII id
    ],
)
def test_chat_bad_input_is_400(url: str, body: dict[str, Any], param: str, words: list[str]) -> None:
    assert_error(chat(url, **body), 400, param, *words)


def test_lone_surrogates_are_400_on_every_text_route(url: str) -> None:
    """JSON can carry a lone UTF-16 surrogate (\\ud800), which no tokenizer encodes: a 400 naming it, not the
    tokenizer's TypeError as a 500; and the server keeps serving."""
    bad = "ok \ud800 ok"

    def post(
        route: str, body: dict[str, Any]
    ) -> httpx.Response:  # json.dumps escapes the surrogate as \\ud800
        return httpx.post(
            f"{url}{route}", content=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )

    assert_error(post("/v1/completions", {"prompt": bad}), 400, "prompt", "U+D800", "character 3")
    assert_error(post("/v1/completions", {"prompt": ["fine", bad]}), 400, "prompt[1]", "surrogate")
    assert_error(
        post("/v1/chat/completions", {"messages": [{"role": "user", "content": bad}]}),
        400,
        "messages",
        "lone UTF-16 surrogate",
    )
    assert_error(post("/tokenize", {"prompt": bad}), 400, "prompt", "surrogate")
    assert_error(
        post("/tokenize", {"messages": [{"role": "user", "content": bad}]}), 400, "messages", "surrogate"
    )
    assert post("/v1/completions", {"prompt": "ok \U0001f600 ok", "max_tokens": 2}).status_code == 200


def test_prompt_no_tokenization_can_fit_is_refused_before_tokenizing(url: str, engine: FakeEngine) -> None:
    """A prompt of more characters than max_seq_len tokens of the tokenizer's longest entry can hold (twice
    over) is refused at once, without tokenizing it (seconds for tens of MB), naming the limit."""
    longest = engine.tokenizer.max_token_chars
    n = 2 * longest * 1024 + 1  # the fake engine's max_seq_len is 1024
    err = assert_error(
        httpx.post(f"{url}/v1/completions", json={"prompt": "x" * n}),
        400,
        "prompt",
        f"{n} characters",
        "max_seq_len = 1024",
        f"{longest} characters",
    )
    assert err["code"] == "context_length_exceeded"
    assert_error(chat(url, messages=[{"role": "user", "content": "x" * n}]), 400, "messages", "characters")
    assert_error(httpx.post(f"{url}/tokenize", json={"prompt": "x" * n}), 400, "prompt", "characters")
    # just under the bound it is tokenized and the engine's own token-count check answers
    err = assert_error(httpx.post(f"{url}/v1/completions", json={"prompt": "x" * (n - 1)}), 400, "prompt")
    assert "characters" not in err["message"] and err["code"] == "context_length_exceeded"


def test_unknown_model_is_404(url: str) -> None:
    err = assert_error(chat(url, model="gpt-5"), 404, "model", "gpt-5", "fake-model")
    assert err["code"] == "model_not_found"


def test_malformed_and_missing_bodies(url: str) -> None:
    r = httpx.post(
        f"{url}/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    assert_error(r, 400, None, "JSON")
    r = httpx.post(f"{url}/v1/completions", content=b"", headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = httpx.post(f"{url}/v1/completions", json=[1, 2])
    assert r.status_code == 400
    assert_error(httpx.post(f"{url}/v1/completions", json={"prompt": []}), 400, "prompt")
    assert_error(httpx.post(f"{url}/v1/completions", json={"prompt": [1, 999]}), 400, "prompt", "320")
    assert_error(httpx.post(f"{url}/v1/completions", json={"prompt": [-1]}), 400)
    assert_error(
        httpx.post(f"{url}/v1/completions", json={"prompt": [True, False]}), 400
    )  # JSON bools: not ids
    assert_error(httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "stop_token_ids": [True]}), 400)
    assert_error(httpx.get(f"{url}/no/such/route"), 404)
    assert_error(httpx.get(f"{url}/v1/chat/completions"), 405)


# ---- engine failures, disconnects --------------------------------------------------------------------------


def test_engine_failure_non_streaming_is_500_and_server_keeps_serving(url: str, engine: FakeEngine) -> None:
    engine.script = lambda ids, p: ["a", FakeEngine.FAIL]
    err = assert_error(chat(url), 500, None, "error id")  # a generic message: the detail is only logged
    assert err["error_id"] in err["message"] and "injected failure" not in err["message"]
    engine.script = lambda ids, p: ["ok"]
    msg = chat(url).json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "ok"  # thinking on, no </think> (yet): all reasoning


def test_engine_failure_streaming_sends_error_event_then_done(url: str, engine: FakeEngine) -> None:
    engine.script = lambda ids, p: ["a", FakeEngine.FAIL]
    r = chat(url, stream=True)
    assert r.status_code == 200
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert (
        err["status_code"] == 500 and err["error_id"] in err["message"] and "injected" not in err["message"]
    )
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "stream": True}, timeout=10)
    events = sse_events(r)
    assert events[-1] == "[DONE]" and "error" in events[-2]


def test_disconnect_mid_stream_aborts(url: str, engine: FakeEngine) -> None:
    engine.script = lambda ids, p: ["first", FakeEngine.HANG]
    with httpx.Client(timeout=10) as client:
        with client.stream(
            "POST",
            f"{url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "stream": True},
        ) as r:
            lines = r.iter_lines()
            for line in lines:
                if "first" in line:
                    break
    assert wait_until(lambda: not engine.running and engine.aborted, 10)


def test_disconnect_non_streaming_aborts(url: str, engine: FakeEngine) -> None:
    engine.script = lambda ids, p: [FakeEngine.HANG]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=0.5)
    assert wait_until(lambda: not engine.running and engine.aborted, 10)


# ---- metrics, health, API key ------------------------------------------------------------------------------


def test_metrics(url: str) -> None:
    chat(url)
    m = parse_metrics(httpx.get(f"{url}/metrics").text)
    assert m['hyserve_requests_total{route="/v1/chat/completions",status="200"}'] >= 1
    assert m["hyserve_time_to_first_token_seconds_count"] >= 1
    assert m["hyserve_e2e_request_latency_seconds_count"] >= 1
    assert "hyserve_time_per_output_token_seconds_count" in m
    assert m["hyserve_jit_compiles_after_ready_total"] == 0
    assert m["hyserve_cuda_alloc_retries_total"] == 0
    assert m["hyserve_num_requests_running"] == 0
    assert m["hyserve_kv_cache_usage_ratio"] == 0


def test_health_answers_head_probes(url: str, engine: FakeEngine) -> None:
    r = httpx.head(f"{url}/health")
    assert r.status_code == 200 and r.content == b""
    engine.healthy = False
    assert httpx.head(f"{url}/health").status_code == 503


def test_health_unhealthy_is_503(url: str, engine: FakeEngine) -> None:
    assert httpx.get(f"{url}/health").status_code == 200
    engine.healthy = False
    assert_error(httpx.get(f"{url}/health"), 503)
    assert_error(chat(url), 503)


def test_version(url: str) -> None:
    assert httpx.get(f"{url}/version").json()["version"]


def test_tokenize_detokenize(url: str) -> None:
    r = httpx.post(f"{url}/tokenize", json={"prompt": "hello world"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    text = httpx.post(f"{url}/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
    assert text == "hello world"
    chat_tokens = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat_tokens["count"] > 3
    assert_error(httpx.post(f"{url}/tokenize", json={}), 400, "prompt")
    assert_error(httpx.post(f"{url}/detokenize", json={"tokens": [100000]}), 400, "tokens")


def test_api_key() -> None:
    eng = FakeEngine(tokenizer=tiny_tokenizer())
    with serve_app_in_thread(build_app(eng, ServerOptions(api_key="sekret"))) as u:
        body = {"messages": [{"role": "user", "content": "x"}]}
        err = assert_error(httpx.post(f"{u}/v1/chat/completions", json=body), 401)
        assert err["code"] == "invalid_api_key"
        assert_error(
            httpx.post(f"{u}/v1/chat/completions", json=body, headers={"Authorization": "Bearer no"}), 401
        )
        assert_error(httpx.get(f"{u}/v1/models"), 401)
        ok = httpx.post(f"{u}/v1/chat/completions", json=body, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert httpx.get(f"{u}/health").status_code == 200  # probes need no key
        assert httpx.get(f"{u}/metrics").status_code == 200
        # a header with non-ASCII bytes is a wrong key (401), not a 500
        assert_error(httpx.get(f"{u}/v1/models", headers={"Authorization": "Bearer ключ".encode()}), 401)
        assert_error(httpx.get(f"{u}/v1/models", headers={"x-api-key": "é".encode()}), 401)


def test_api_key_with_non_ascii_characters() -> None:
    """A key with non-ASCII characters works (compared as UTF-8 bytes) instead of failing every request."""
    eng = FakeEngine(tokenizer=tiny_tokenizer())
    with serve_app_in_thread(build_app(eng, ServerOptions(api_key="sécret"))) as u:
        assert (
            httpx.get(f"{u}/v1/models", headers={"Authorization": "Bearer sécret".encode()}).status_code
            == 200
        )
        assert httpx.get(f"{u}/v1/models", headers={"x-api-key": "sécret".encode()}).status_code == 200
        assert_error(httpx.get(f"{u}/v1/models", headers={"x-api-key": b"secret"}), 401)


def test_no_tokenizer_model_needs_token_ids() -> None:
    eng = FakeEngine(tokenizer=None)
    with serve_app_in_thread(build_app(eng)) as u:
        r = httpx.post(f"{u}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, "logprobs": 1})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"]["tokens"] == ["token_id:7", "token_id:7"]
        assert_error(httpx.post(f"{u}/v1/completions", json={"prompt": "text"}), 400, "prompt", "token ids")
        assert_error(
            httpx.post(f"{u}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}),
            400,
            "messages",
            "tokenizer",
        )


def test_completion_stream_sends_a_chunk_per_step_without_text() -> None:
    """Tokens that decode to no text yet (token ids without a tokenizer, partial UTF-8) still stream one
    chunk per engine step, as vLLM does: benchmark clients time tokens by chunks (TTFT, ITL, TPOT)."""
    eng = FakeEngine(tokenizer=None, script=lambda ids, p: ["", "", ""])
    with serve_app_in_thread(build_app(eng)) as u:
        r = httpx.post(
            f"{u}/v1/completions",
            json={
                "prompt": [1, 2, 3],
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            timeout=10,
        )
        assert r.status_code == 200, r.text
        events = sse_events(r)
        assert events[-1] == "[DONE]"
        token_chunks = [e for e in events[:-1] if e["choices"]]
        steps = [c for c in token_chunks if c["choices"][0]["finish_reason"] is None]
        assert [c["choices"][0]["text"] for c in steps] == ["", "", ""]
        assert token_chunks[-1]["choices"][0]["finish_reason"] is not None
        assert events[-2]["usage"]["completion_tokens"] == 3


def test_timing_sanity(url: str) -> None:
    t0 = time.monotonic()
    for _ in range(20):
        assert chat(url, max_tokens=2).status_code == 200
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_token_chunks_have_the_full_shape(include_usage: bool) -> None:
    """The per-token chunks (formatted without pydantic) carry what the pydantic model would: every
    field, `usage: null` exactly when usage was asked for, text escaped as JSON."""
    eng = FakeEngine(tokenizer=None, script=lambda ids, p: ['a "q"\n', "\u00e9\\", "z"])
    with serve_app_in_thread(build_app(eng)) as u:
        body: dict[str, Any] = {"prompt": [1, 2], "max_tokens": 3, "stream": True}
        if include_usage:
            body["stream_options"] = {"include_usage": True}
        events = sse_events(httpx.post(f"{u}/v1/completions", json=body, timeout=10))
    chunks = [e for e in events[:-1] if e["choices"]]
    assert [c["choices"][0]["text"] for c in chunks[:3]] == ['a "q"\n', "\u00e9\\", "z"]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and next(iter(ids)).startswith("cmpl-")
    for c in chunks[:3]:
        want = {
            "id": c["id"],
            "object": "text_completion",
            "created": chunks[0]["created"],
            "model": "fake-model",
            "choices": [
                {
                    "index": 0,
                    "text": c["choices"][0]["text"],
                    "logprobs": None,
                    "finish_reason": None,
                    "stop_reason": None,
                }
            ],
        }
        if include_usage:
            want["usage"] = None
        assert c == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert ("usage" in chunks[-1]) == include_usage


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_token_chunks_have_the_full_shape(url: str, engine: FakeEngine, include_usage: bool) -> None:
    """Chat per-token chunks (formatted without pydantic): the same fields as the pydantic model gives,
    reasoning and content deltas included."""
    engine.script = lambda ids, p: ["<think>", 'why "x"', "</think>", "Hi\n", "\u00e9"]
    body: dict[str, Any] = {"stream": True, "max_tokens": 50}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    events = sse_events(chat(url, **body))
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:] if c["choices"][0]["finish_reason"] is None]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == 'why "x"'
    assert "".join(d.get("content", "") for d in deltas) == "Hi\n\u00e9"
    for c in chunks[1:-1]:
        want = {
            "id": chunks[0]["id"],
            "object": "chat.completion.chunk",
            "created": chunks[0]["created"],
            "model": chunks[0]["model"],
            "choices": [
                {
                    "index": 0,
                    "delta": c["choices"][0]["delta"],
                    "logprobs": None,
                    "finish_reason": None,
                    "stop_reason": None,
                }
            ],
        }
        if include_usage:
            want["usage"] = None
        assert c == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_n_choices_streaming_and_not(url: str, engine: FakeEngine) -> None:
    """n choices: each its own engine request (seeded: seed + k), indexed 0..n-1 in the response and in the
    stream, usage counting the prompt once and every choice's output."""
    seen: list[int | None] = []

    def script(ids: list[int], p: Any) -> list[str]:
        seen.append(p.seed)
        return ["<think>", "r", "</think>", f"c{len(seen)}"]

    engine.script = script
    r = chat(url, n=3, seed=10, max_tokens=50)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert sorted(seen) == [10, 11, 12]
    assert sorted(c["message"]["content"] for c in body["choices"]) == ["c1", "c2", "c3"]
    assert all(c["message"]["reasoning_content"] == "r" for c in body["choices"])
    prompt = body["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 3 * 4 and body["usage"]["total_tokens"] == prompt + 12
    seen.clear()
    events = sse_events(chat(url, n=2, max_tokens=50, stream=True, stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]" and seen == [None, None]
    chunks = [e for e in events[:-1] if e["choices"]]
    assert len({c["id"] for c in events[:-1]}) == 1
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role") == "assistant"]
    assert sorted(roles) == [0, 1]
    for k in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == k]
        assert "".join(ch["delta"].get("reasoning_content", "") for ch in mine) == "r"
        assert "".join(ch["delta"].get("content", "") for ch in mine) in ("c1", "c2")
        assert mine[-1]["finish_reason"] == "stop"
    assert events[-2]["usage"]["prompt_tokens"] == prompt and events[-2]["usage"]["completion_tokens"] == 8


def test_large_replies_are_built_off_the_event_loop(
    url: str, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-streaming reply over the size threshold (output tokens x (1 + top logprobs)) is built and
    serialised on a worker thread, with the same content as one built on the loop."""
    import asyncio

    import hyserve.server.state as state_mod

    engine.script = lambda ids, p: ["ab", "cd"]
    body = {"prompt": [[5, 6], [7, 8, 9]], "n": 2, "max_tokens": 4, "logprobs": 1}
    chat_body = {"messages": [{"role": "user", "content": "x"}], "n": 2, "max_tokens": 4}
    small = httpx.post(f"{url}/v1/completions", json=body, timeout=10).json()
    small_chat = chat(url, **chat_body).json()
    threads: list[str] = []
    real = asyncio.to_thread

    async def spy(fn, *a, **kw):  # noqa: ANN001, ANN202 - asyncio.to_thread's own signature
        threads.append(getattr(fn, "__name__", "?"))
        return await real(fn, *a, **kw)

    monkeypatch.setattr(state_mod, "OFF_LOOP_REPLY_TOKENS", 3)
    monkeypatch.setattr(asyncio, "to_thread", spy)
    big = httpx.post(f"{url}/v1/completions", json=body, timeout=10).json()
    big_chat = chat(url, **chat_body).json()
    assert len(threads) == 2  # one reply each
    for a, b in ((small, big), (small_chat, big_chat)):
        assert [c | {"index": 0} for c in a["choices"]] == [c | {"index": 0} for c in b["choices"]]
        assert a["usage"] == b["usage"]


def test_completion_n_choices(url: str, engine: FakeEngine) -> None:
    """Two prompts x n=2: choices ordered prompt-major (index = prompt * n + k); usage counts each prompt
    once."""
    engine.script = lambda ids, p: [f"p{len(ids)}s{p.seed}"]
    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": [[5, 6], [7, 8, 9]], "n": 2, "seed": 3, "max_tokens": 4},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "p2s3"),
        (1, "p2s4"),
        (2, "p3s3"),
        (3, "p3s4"),
    ]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 4
    events = sse_events(
        httpx.post(
            f"{url}/v1/completions",
            json={
                "prompt": [[5, 6], [7, 8, 9]],
                "n": 2,
                "seed": 3,
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            timeout=10,
        )
    )
    texts: dict[int, str] = {}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: "p2s3", 1: "p2s4", 2: "p3s3", 3: "p3s4"}
    assert events[-2]["usage"]["prompt_tokens"] == 5 and events[-2]["usage"]["completion_tokens"] == 4


def test_choice_seeds_stay_in_int64() -> None:
    from hyserve.server.generation import choice_params

    p = SamplingParams(max_tokens=1, seed=2**63 - 1)
    assert choice_params(p, 0) is p
    assert choice_params(p, 1).seed == -(2**63) and choice_params(p, 2).seed == -(2**63) + 1
    assert choice_params(SamplingParams(max_tokens=1), 5).seed is None


def test_staggered_choices_start_after_the_first_token_and_never_hang() -> None:
    """With a prefix cache configured, choices 1.. of a long prompt enter the engine after choice 0's first
    token; when choice 0 fails instead, the others still start (the request ends, it does not hang)."""
    from hyserve.config import EngineConfig

    order: list[tuple[int, int]] = []  # (call number, prompt length) as the engine saw them

    eng = FakeEngine(
        tokenizer=None,
        max_seq_len=1024,
        script=lambda ids, p: order.append((len(order), len(ids))) or ["a", "b"],
    )
    eng.config = EngineConfig()  # prefix cache on: stagger prompts of >= 256 tokens
    prompt = list(range(3, 303))
    with serve_app_in_thread(build_app(eng)) as u:
        r = httpx.post(f"{u}/v1/completions", json={"prompt": prompt, "n": 3, "max_tokens": 2}, timeout=10)
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == ["ab", "ab", "ab"]
        assert len(order) == 3
        short = httpx.post(
            f"{u}/v1/completions", json={"prompt": [5, 6], "n": 2, "max_tokens": 2}, timeout=10
        )
        assert short.status_code == 200
        calls = {"n": 0}

        def failing_leader(ids: list[int], p: Any) -> list[str]:
            calls["n"] += 1
            return [FakeEngine.FAIL] if calls["n"] == 1 else ["z"]

        eng.script = failing_leader
        r = httpx.post(f"{u}/v1/completions", json={"prompt": prompt, "n": 3, "max_tokens": 2}, timeout=10)
        assert r.status_code == 500 and calls["n"] >= 1
        events = sse_events(
            httpx.post(
                f"{u}/v1/completions",
                json={"prompt": prompt, "n": 3, "max_tokens": 2, "stream": True},
                timeout=10,
            )
        )
        assert events[-1] == "[DONE]"


def test_deeply_nested_tool_call_arguments_from_the_client_are_no_500() -> None:
    """A past assistant turn whose tool-call `arguments` string nests 3,000 deep (json.loads raises
    RecursionError): the template gets the string as it is and the request is served."""
    deep = "[" * 3_000 + "]" * 3_000
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": deep}}
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    big = FakeEngine(tokenizer=tiny_tokenizer(), max_seq_len=65_536)
    with serve_app_in_thread(build_app(big, ServerOptions(tool_parser="qwen3_coder"))) as u:
        r = chat(u, messages=messages, tools=[WEATHER_TOOL], max_tokens=5)
    assert r.status_code == 200, r.text
