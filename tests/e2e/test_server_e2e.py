"""End to end through a real `hyserve serve` process (built-in tiny model, CPU, loopback), driven by the
official `openai` client, plain HTTP for error cases, and the user report's needle client.

One server for the module, started the way the report's user starts trtllm-serve: a YAML in the
report's shape (TRT-LLM-only keys included) plus `--reasoning_parser nemotron-v3 --tool_parser
qwen3_coder --trust_remote_code`, with the engine in its own process as on a GPU (`--engine-process on`;
the tests over an in-thread engine cover the other form). The tiny model has random weights, so tests check
protocol behaviour (shapes, token counts, finish reasons, resource accounting), never the meaning of the text.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from benchmarks.procfs import child_pids
from tests.server_fixtures import KV_TOKEN_CAP, REPORT_STYLE_YAML, ServerProcess, wait_until

MAX_SEQ_LEN = 4096
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    cfg: Path = tmp_path_factory.mktemp("cfg") / "extra-llm-api-config.yml"
    cfg.write_text(REPORT_STYLE_YAML)
    s = ServerProcess(
        args=[
            "--config",
            str(cfg),
            "--max_seq_len",
            str(MAX_SEQ_LEN),
            "--reasoning_parser",
            "nemotron-v3",
            "--tool_parser",
            "qwen3_coder",
            "--trust_remote_code",
            "--disable-log-requests",
            "--engine-process",
            "on",
        ]
    ).start()
    yield s
    rc = s.stop()
    assert rc == 0, s.log()
    assert "hyserve: stopped" in s.log()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def count_chat_tokens(server: ServerProcess, messages: list[dict[str, Any]], **kw: Any) -> int:
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages, **kw}, timeout=30)
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def test_startup_log(server: ServerProcess) -> None:
    log = server.log()
    assert "capacity plan" in log
    # one warning listing every compatibility-only key of the report's YAML, plus the CLI flag
    (warning,) = [line for line in log.splitlines() if "without effect" in line]
    for key in (
        "backend",
        "disable_overlap_scheduler",
        "enable_attention_dp",
        "moe_config",
        "trust_remote_code",
    ):
        assert key in warning
    assert "ready" in log


def test_the_engine_runs_in_a_process_of_its_own(server: ServerProcess) -> None:
    assert server.proc is not None
    children = child_pids(server.proc.pid)
    cmdlines = [Path(f"/proc/{c}/cmdline").read_bytes().replace(b"\0", b" ").decode() for c in children]
    assert any("multiprocessing" in c and "spawn" in c for c in cmdlines), cmdlines


def test_models_health_version(client: openai.OpenAI, server: ServerProcess, model: str) -> None:
    assert model == "hyserve-tiny"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_chat_sync_streaming_matches_non_streaming(
    client: openai.OpenAI, server: ServerProcess, model: str
) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    resp = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, extra_body=NO_THINK
    )
    choice = resp.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens == count_chat_tokens(server, messages, **NO_THINK)
    assert 1 <= resp.usage.completion_tokens <= 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.usage.prompt_tokens_details is not None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_THINK,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (choice.message.content or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        choice.finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == resp.usage.completion_tokens


def test_chat_logprobs(client: openai.OpenAI, model: str) -> None:
    resp = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body=NO_THINK,
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 3
        assert tok.logprob <= 0 and tok.top_logprobs[0].logprob >= tok.top_logprobs[-1].logprob
        # greedy: the chosen token is the most likely one
        assert tok.logprob == pytest.approx(tok.top_logprobs[0].logprob, abs=1e-5)


def test_completions_token_ids_echo_logprobs(client: openai.OpenAI, model: str) -> None:
    resp = client.completions.create(
        model=model, prompt=[1, 300, 301, 302], max_tokens=5, temperature=0, logprobs=2, echo=True
    )
    c = resp.choices[0]
    assert resp.usage.prompt_tokens == 4
    n_out = resp.usage.completion_tokens
    assert len(c.logprobs.tokens) == 4 + n_out
    # the prompt's own logprobs (the first token has none), then the output's
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in c.logprobs.token_logprobs[1:])
    assert all(len(t) == 2 for t in c.logprobs.top_logprobs[1:4])
    assert all(len(t) <= 2 for t in c.logprobs.top_logprobs[4:])
    # streamed: the echo chunk carries the same prompt logprobs
    chunks = list(
        client.completions.create(
            model=model,
            prompt=[1, 300, 301, 302],
            max_tokens=5,
            temperature=0,
            logprobs=2,
            echo=True,
            stream=True,
        )
    )
    first = next(ch.choices[0] for ch in chunks if ch.choices)
    assert first.logprobs.token_logprobs == c.logprobs.token_logprobs[:4]
    # lm-eval style loglikelihood request: max_tokens 1, echo, logprobs 1
    ll = (
        client.completions.create(
            model=model, prompt=[1, 300, 301, 302], max_tokens=1, temperature=0, logprobs=1, echo=True
        )
        .choices[0]
        .logprobs
    )
    assert ll.token_logprobs[1:4] == c.logprobs.token_logprobs[1:4]


def test_seed_reproducible_and_stop_string(client: openai.OpenAI, model: str) -> None:
    kw: dict[str, Any] = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "temperature": 1.0,
        "extra_body": {"ignore_eos": True},
    }
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    assert a == b
    greedy = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0]
    text = greedy.text
    candidates = [ch for ch in text[1:] if ch.isprintable() and ch != "\ufffd" and not ch.isspace()]
    if not candidates:
        pytest.skip(f"greedy output has no printable character to stop on: {text!r}")
    stop = candidates[0]
    stopped = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(stop)]


def test_needle_client_from_the_report(server: ServerProcess, model: str) -> None:
    """repro_needle.py from the report, verbatim except URL/MODEL and a size the tiny model handles."""
    url = f"{server.base_url}/chat/completions"
    needle = "The secret code is ORANGE-MANGO-42."
    filler = "alphabet "
    results: list[tuple[Any, ...]] = []

    def prompt(n_words: int) -> str:
        left, right = n_words // 2, n_words - n_words // 2
        hay = filler * left + needle + " " + filler * right
        return (
            "Find the secret code in the document. "
            "Reply with ONLY the code string, nothing else.\n\nDOCUMENT:\n" + hay
        )

    def once(n_words: int) -> None:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt(n_words)}],
            "max_tokens": 64,
            "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        t0 = time.time()
        req = urllib.request.Request(
            url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=1800) as r:
                d = json.loads(r.read())
                c = d["choices"][0]["message"].get("content")
                u = d.get("usage") or {}
                results.append((n_words, "OK", u.get("prompt_tokens"), c, round(time.time() - t0, 1)))
        except urllib.error.HTTPError as e:
            results.append((n_words, "HTTP", e.code, e.read()[:400]))

    once(100)
    once(200)  # ~1.7k prompt tokens, well inside this server's 3,072-token KV pool
    for n_words, res in zip((100, 200), results):
        assert res[1] == "OK", res
        expected = count_chat_tokens(server, [{"role": "user", "content": prompt(n_words)}], **NO_THINK)
        assert res[2] == expected
        assert isinstance(res[3], str)  # enable_thinking=False: everything is content
    assert results[1][2] > 1500


def test_prefix_cache_reports_cached_tokens(client: openai.OpenAI, model: str) -> None:
    prompt = "The same long shared prefix. " * 40
    kw: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = client.completions.create(**kw)
    second = client.completions.create(**kw)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 256
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_64_concurrent_streams_then_pools_free(server: ServerProcess, model: str) -> None:
    async def main() -> list[tuple[str, int, str | None]]:
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)

        async def one(i: int) -> tuple[str, int, str | None]:
            stream = await aclient.completions.create(
                model=model,
                prompt=f"Request number {i}:",
                max_tokens=8,
                temperature=0.7,
                seed=i,
                stream=True,
                stream_options={"include_usage": True},
            )
            text, usage, reason = "", 0, None
            async for ch in stream:
                if ch.choices:
                    text += ch.choices[0].text
                    reason = ch.choices[0].finish_reason or reason
                if ch.usage:
                    usage = ch.usage.completion_tokens
            return text, usage, reason

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert len(results) == 64
    for _text, n, reason in results:
        assert reason in ("stop", "length") and 1 <= n <= 8
    assert wait_until(server.idle, 15), server.metrics()


def test_disconnect_mid_stream_frees_resources(server: ServerProcess, model: str) -> None:
    aborted0 = server.metrics().get('hyserve_request_success_total{finish_reason="abort"}', 0)
    body = {
        "model": model,
        "prompt": "Go on forever:",
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=30) as c, c.stream("POST", f"{server.base_url}/completions", json=body) as r:
        assert r.status_code == 200
        n = 0
        lines = r.iter_lines()  # keep a reference: dropping the iterator would close the connection
        for line in lines:
            n += line.startswith("data: ")
            if n >= 3:
                break
        assert server.metrics()["hyserve_num_requests_running"] == 1
    assert wait_until(server.idle, 15), server.metrics()
    m = server.metrics()
    assert m.get('hyserve_request_success_total{finish_reason="abort"}', 0) == aborted0 + 1


def test_disconnect_non_streaming_frees_resources(server: ServerProcess, model: str) -> None:
    aborted0 = server.metrics().get('hyserve_request_success_total{finish_reason="abort"}', 0)
    body = {"model": model, "prompt": "Go on forever:", "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    assert wait_until(server.idle, 15), server.metrics()
    assert server.metrics().get('hyserve_request_success_total{finish_reason="abort"}', 0) == aborted0 + 1


def _post(server: ServerProcess, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=30)


def _err(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) >= {"message", "type", "param", "code"}
    return e


def test_too_long_prompt_is_400_naming_max_seq_len(server: ServerProcess, model: str) -> None:
    e = _err(_post(server, "/completions", {"model": model, "prompt": "z" * 5000, "max_tokens": 8}), 400)
    assert e["code"] == "context_length_exceeded" and f"max_seq_len = {MAX_SEQ_LEN}" in e["message"]
    e = _err(_post(server, "/completions", {"model": model, "prompt": "hi", "max_tokens": MAX_SEQ_LEN}), 400)
    assert e["param"] == "max_tokens" and str(MAX_SEQ_LEN) in e["message"]


def test_huge_needle_prompt_is_a_clean_400(server: ServerProcess, model: str) -> None:
    """The report's 256k-word request against a 4k-token server: a 400 naming the limit, no crash."""
    hay = "alphabet " * 128_000 + "The secret code is ORANGE-MANGO-42. " + "alphabet " * 128_000
    body = {
        "model": model,
        "messages": [{"role": "user", "content": hay}],
        "max_tokens": 64,
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    e = _err(_post(server, "/chat/completions", body), 400)
    assert e["code"] == "context_length_exceeded" and f"max_seq_len = {MAX_SEQ_LEN}" in e["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert _post(server, "/completions", {"model": model, "prompt": "ok", "max_tokens": 2}).status_code == 200


def test_prompt_that_never_fits_the_pools_is_400(server: ServerProcess, model: str) -> None:
    e = _err(_post(server, "/completions", {"model": model, "prompt": "z" * 3500, "max_tokens": 8}), 400)
    assert e["code"] == "request_too_large" and str(KV_TOKEN_CAP) in e["message"]
    # ... and the server is still fine afterwards
    assert _post(server, "/completions", {"model": model, "prompt": "ok", "max_tokens": 2}).status_code == 200


def test_openai_client_sees_error_messages(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "z" * 5000}], max_tokens=8
        )
    assert "max_seq_len" in ei.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], n=100)
    assert ei.value.body["param"] == "n" and "between 1 and 64" in ei.value.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [1, 2, 100000]}, "prompt"),
        ({"prompt": "x", "temperature": -0.5}, "temperature"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": ""}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "logit_bias": {"999999": 5}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"1.5": 5}}, "logit_bias"),
        ({"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
        ({"prompt": "x", "repetition_penalty": -1}, "repetition_penalty"),
        ({"prompt": "x", "n": 65}, "n"),
    ],
)
def test_bad_completion_inputs(server: ServerProcess, body: dict[str, Any], param: str) -> None:
    assert _err(_post(server, "/completions", body), 400)["param"] == param


def test_malformed_json(server: ServerProcess) -> None:
    r = httpx.post(
        f"{server.base_url}/chat/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert "JSON" in _err(r, 400)["message"]


def test_metrics_exposed(server: ServerProcess) -> None:
    m = server.metrics()
    for name in (
        "hyserve_num_requests_running",
        "hyserve_num_requests_waiting",
        "hyserve_kv_cache_blocks_total",
        "hyserve_kv_cache_blocks_free",
        "hyserve_kv_cache_usage_ratio",
        "hyserve_state_slots_used",
        "hyserve_snapshot_slots_used",
        "hyserve_prefix_cache_hit_rate",
        "hyserve_num_preemptions_total",
        "hyserve_prompt_tokens_total",
        "hyserve_generation_tokens_total",
        "hyserve_time_to_first_token_seconds_count",
        "hyserve_time_per_output_token_seconds_count",
        "hyserve_e2e_request_latency_seconds_count",
        "hyserve_jit_compiles_after_ready_total",
        "hyserve_overlapped_steps_total",
        "hyserve_engine_steps_total",
        "hyserve_engine_prefill_steps_total",
        "hyserve_prefill_tokens_scheduled_total",
        "hyserve_batch_wait_steps_total",
        "hyserve_step_time_scale",
    ):
        assert name in m, name
    assert m["hyserve_jit_compiles_after_ready_total"] == 0
    assert m["hyserve_step_time_scale"] == 1.0  # the CPU's analytic model is not corrected
    assert m["hyserve_kv_cache_blocks_total"] == KV_TOKEN_CAP // 64


def test_n_choices_on_the_real_engine(client: openai.OpenAI, model: str) -> None:
    """n=3, sampled and seeded: three choices, reproducible; greedy n=2: identical choices."""
    msgs = [{"role": "user", "content": "Tell me"}]
    a = client.chat.completions.create(
        model=model, messages=msgs, n=3, seed=5, temperature=1.0, max_tokens=12
    )
    b = client.chat.completions.create(
        model=model, messages=msgs, n=3, seed=5, temperature=1.0, max_tokens=12
    )
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1  # seeds 5, 6, 7 sample differently
    assert a.usage.completion_tokens <= 3 * 12 and a.usage.prompt_tokens == b.usage.prompt_tokens
    g = client.chat.completions.create(model=model, messages=msgs, n=2, temperature=0, max_tokens=8)
    assert g.choices[0].message.content == g.choices[1].message.content
    stream = client.completions.create(
        model=model, prompt="abc", n=2, max_tokens=6, temperature=0, stream=True
    )
    texts = {0: "", 1: ""}
    for ch in stream:
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts[0] == texts[1] and texts[0]


def test_penalties_and_logit_bias_through_the_openai_client(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(
        model=model,
        prompt=[1, 70, 71],
        max_tokens=5,
        temperature=0,
        logit_bias={"80": 100},
        extra_body={"ignore_eos": True},
    )
    assert len(r.choices[0].text) > 0 and len(set(r.choices[0].text)) == 1  # one token, five times
    r2 = client.completions.create(
        model=model,
        prompt=[1, 70, 71],
        max_tokens=6,
        temperature=0,
        logit_bias={"80": 100, "81": 100},
        frequency_penalty=2.0,
        presence_penalty=2.0,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.1},
    )
    assert len(set(r2.choices[0].text)) == 2  # the penalties alternate the two lifted tokens


def test_n_choices_of_a_long_prompt_share_its_prefill(
    server: ServerProcess, client: openai.OpenAI, model: str
) -> None:
    """n=3 on a 300-token prompt: choices 1 and 2 wait for choice 0's first token and are served from the
    prefix cache (hits counted in /metrics), with the greedy tokens of choice 0. (Started together, all
    three fit one 1024-token step and none could hit.)"""

    def hits() -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        return next(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("hyserve_prefix_cache_hits_total")
        )

    prompt = [1] + [(7 * i) % 200 + 20 for i in range(299)]
    before = hits()
    r = client.completions.create(
        model=model, prompt=prompt, n=3, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.choices[0].text == r.choices[1].text == r.choices[2].text
    assert hits() - before >= 2 * 256  # each follower reused the prompt up to its 256-token snapshot
    assert r.usage.prompt_tokens == 300


def test_echo_with_max_tokens_zero_returns_the_prompt_and_its_logprobs(
    server: ServerProcess, client: openai.OpenAI, model: str
) -> None:
    """Legacy OpenAI loglikelihood request: echo, max_tokens 0, logprobs: the prompt back with its logprobs,
    nothing generated; streamed the same. max_tokens 0 without echo is a 400."""
    full = client.completions.create(
        model=model, prompt=[1, 300, 301, 302], max_tokens=1, temperature=0, logprobs=1, echo=True
    ).choices[0]
    r = client.completions.create(
        model=model, prompt=[1, 300, 301, 302], max_tokens=0, temperature=0, logprobs=1, echo=True
    )
    c = r.choices[0]
    assert len(c.logprobs.tokens) == 4 and c.logprobs.token_logprobs == full.logprobs.token_logprobs[:4]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == 4
    assert c.text == "".join(full.logprobs.tokens[:4])
    chunks = list(
        client.completions.create(
            model=model, prompt=[1, 300, 301, 302], max_tokens=0, logprobs=1, echo=True, stream=True
        )
    )
    texts = [ch.choices[0] for ch in chunks if ch.choices]
    assert texts[0].logprobs.token_logprobs == c.logprobs.token_logprobs
    assert texts[-1].finish_reason == "length" and "".join(t.text for t in texts) == c.text
    assert _err(_post(server, "/completions", {"prompt": "x", "max_tokens": 0}), 400)["param"] == "max_tokens"


def test_logprob_bytes_are_each_tokens_bytes(client: openai.OpenAI, model: str) -> None:
    """Random weights pick byte tokens of partial UTF-8 characters often: their `bytes` are the raw byte, and
    `token` is those bytes with the invalid ones shown as '\\xNN'."""
    resp = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=48,
        temperature=1.0,
        seed=5,
        logprobs=True,
        top_logprobs=5,
        extra_body={**NO_THINK, "ignore_eos": True},
    )
    toks = [t for c in resp.choices[0].logprobs.content for t in (c, *c.top_logprobs)]
    assert len(toks) == 48 * 6
    for t in toks:
        assert t.token == bytes(t.bytes).decode("utf-8", errors="backslashreplace")
    assert any(len(t.bytes) == 1 and t.bytes[0] >= 0x80 for t in toks)  # a partial character was seen


def test_developer_message(client: openai.OpenAI, server: ServerProcess, model: str) -> None:
    msgs = [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": "hi"}]
    resp = client.chat.completions.create(model=model, messages=msgs, max_tokens=4, extra_body=NO_THINK)
    assert resp.choices[0].finish_reason in ("stop", "length")
    as_system = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "hi"}]
    assert count_chat_tokens(server, msgs) == count_chat_tokens(server, as_system)


def test_text_offset_monotonic_with_echo_and_streaming(client: openai.OpenAI, model: str) -> None:
    prompt = "The quick brown fox"
    c = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        logprobs=0,
        echo=True,
        extra_body={"ignore_eos": True},
    ).choices[0]
    offs = c.logprobs.text_offset
    assert c.text.startswith(prompt) and offs[:2] == [0, 0]  # <s> adds nothing to the echoed text
    assert offs == sorted(offs) and offs[-1] <= len(c.text)
    streamed, text = [], ""
    for ch in client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        logprobs=0,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        if ch.choices and ch.choices[0].logprobs:
            # a chunk may carry several tokens (deltas a slow reader had not taken are merged): each
            # token's offset counts the text before it, so the first is where this chunk's text starts
            lp = ch.choices[0].logprobs
            assert len(lp.text_offset) == len(lp.tokens) and lp.text_offset[0] == len(text)
            assert lp.text_offset == sorted(lp.text_offset)
            assert lp.text_offset[-1] <= len(text) + len(ch.choices[0].text)
            streamed += lp.text_offset
        text += ch.choices[0].text if ch.choices else ""
    assert len(streamed) == 12 and streamed == sorted(streamed)
    gen = [o - len(prompt) for o in offs[len(offs) - 12 :]]
    # both runs are greedy, so the text is the same; offsets follow the engine's deltas, which a stream may
    # merge, so a token inside a partial UTF-8 character may point a character apart between the two
    assert text == c.text[len(prompt) :]
    assert gen[0] == streamed[0] == 0 and all(0 <= o <= len(text) for o in gen + streamed)


def test_responses_api_whole_and_streamed(client: openai.OpenAI, model: str) -> None:
    """The Responses API on the real engine: greedy, so the streamed events rebuild the whole reply."""
    kw: dict[str, Any] = {
        "model": model,
        "input": "Say something.",
        "instructions": "Be brief.",
        "max_output_tokens": 12,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.responses.create(**kw)
    assert whole.status == "incomplete" and whole.usage.output_tokens == 12  # thinking on: all reasoning
    assert whole.usage.output_tokens_details.reasoning_tokens in range(13)
    events = list(client.responses.create(**kw, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    final = events[-1].response
    assert [o.type for o in final.output] == [o.type for o in whole.output]
    text = lambda r: [(o.type, "".join(c.text for c in (o.content or []))) for o in r.output]  # noqa: E731
    assert text(final) == text(whole)
    deltas = "".join(
        e.delta for e in events if e.type in ("response.reasoning_text.delta", "response.output_text.delta")
    )
    assert deltas == "".join(t for _, t in text(whole))
    off = client.responses.create(**{**kw, "reasoning": {"effort": "none"}})
    assert [o.type for o in off.output] == [
        "message"
    ] and off.usage.output_tokens_details.reasoning_tokens == 0


# ---- structured outputs (random weights: only the constraint is tested) ---------------------------------

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "tags"],
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city"],
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
        },
    },
}
CLOCK_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["zone"],
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
        },
    },
}


def test_json_schema_outputs_parse_and_validate(client: openai.OpenAI, model: str) -> None:
    import jsonschema_rs

    validator = jsonschema_rs.validator_for(PERSON)
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        resp = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Who?"}],
            n=4,
            max_tokens=120,
            temperature=1.0,
            seed=seed,
            response_format=rf,
            extra_body=NO_THINK,
        )
        for c in resp.choices:
            assert c.finish_reason == "stop", c.message.content
            validator.validate(json.loads(c.message.content))
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Who?"}],
        max_tokens=120,
        temperature=1.0,
        seed=7,
        response_format=rf,
        stream=True,
        extra_body=NO_THINK,
    )
    validator.validate(json.loads("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)))
    obj = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "JSON?"}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
        extra_body=NO_THINK,
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # any JSON object may be long: what came out is the start of one
        assert obj.choices[0].message.content.startswith("{")


def test_grammar_starts_after_the_thinking_section(
    server: ServerProcess, client: openai.OpenAI, model: str
) -> None:
    """Thinking on: the reasoning is free text and the schema constrains the content after </think> (pushed
    early here with a logit bias, the schema has no strings where </think> could go)."""
    (end,) = httpx.post(
        f"{server.url}/tokenize", json={"prompt": "</think>", "add_special_tokens": False}
    ).json()["tokens"]
    schema = {
        "type": "object",
        "required": ["n"],
        "additionalProperties": False,
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
    }
    resp = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "n?"}],
        max_tokens=60,
        temperature=1.0,
        seed=1,
        n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        logit_bias={str(end): 8.0},
    )
    for c in resp.choices:
        assert c.finish_reason == "stop"
        assert 0 <= json.loads(c.message.content)["n"] <= 999


def test_tool_choice_required_always_returns_a_valid_call(client: openai.OpenAI, model: str) -> None:
    import jsonschema_rs

    schemas = {
        t["function"]["name"]: jsonschema_rs.validator_for(t["function"]["parameters"])
        for t in (WEATHER_TOOL, CLOCK_TOOL)
    }
    for seed in range(2):
        resp = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[WEATHER_TOOL, CLOCK_TOOL],
            tool_choice="required",
            n=4,
            parallel_tool_calls=False,
            max_tokens=150,
            temperature=1.0,
            seed=seed,
            extra_body=NO_THINK,
        )
        for c in resp.choices:
            assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message
            for call in c.message.tool_calls:
                schemas[call.function.name].validate(json.loads(call.function.arguments))
    named = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Time?"}],
        tools=[WEATHER_TOOL, CLOCK_TOOL],
        max_tokens=60,
        temperature=1.0,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        extra_body=NO_THINK,
    )
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "W?"}],
            tools=[WEATHER_TOOL],
            tool_choice="required",
            max_tokens=150,
            parallel_tool_calls=False,
            temperature=1.0,
            seed=3,
            stream=True,
            extra_body=NO_THINK,
        )
    )
    calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert calls and all(tc.function.name == "get_weather" for tc in calls)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_structured_outputs_extra_body_on_completions(client: openai.OpenAI, model: str) -> None:
    import re

    for so, ok in (
        ({"regex": "[a-d]{3}-[0-9]{2}"}, lambda s: re.fullmatch("[a-d]{3}-[0-9]{2}", s)),
        ({"choice": ["red", "green", "blue"]}, lambda s: s in ("red", "green", "blue")),
        ({"grammar": 'root ::= "<" [0-9] ("," [0-9])* ">"'}, lambda s: re.fullmatch(r"<[0-9](,[0-9])*>", s)),
        (
            {"json": {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}},
            lambda s: isinstance(json.loads(s)["k"], bool),
        ),
    ):
        resp = client.completions.create(
            model=model,
            prompt=[1, 300, 301],
            max_tokens=40,
            temperature=1.0,
            n=3,
            seed=2,
            extra_body={"structured_outputs": so},
        )
        for c in resp.choices:
            assert c.finish_reason == "stop" and ok(c.text), (so, c.text)


def test_schema_that_cannot_compile_is_a_400(server: ServerProcess, model: str) -> None:
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        timeout=30,
        json={
            "model": model,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 8,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objectx"}},
            },
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "objectx" in r.json()["error"]["message"] and ".cc:" not in r.json()["error"]["message"]
    r = httpx.post(
        f"{server.url}/v1/completions",
        timeout=30,
        json={"model": model, "prompt": [1, 2], "max_tokens": 8, "structured_outputs": {"regex": "([a-z"}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
    assert "regex" in r.json()["error"]["message"]


def test_responses_api_structured(client: openai.OpenAI, model: str) -> None:
    import jsonschema_rs

    r = client.responses.create(
        model=model,
        input="Who?",
        max_output_tokens=120,
        temperature=1.0,
        reasoning={"effort": "none"},
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
    )
    assert r.status == "completed"
    jsonschema_rs.validator_for(PERSON).validate(json.loads(r.output_text))
    tools = [{"type": "function", **WEATHER_TOOL["function"]}]
    r = client.responses.create(
        model=model,
        input="Weather?",
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=150,
        temperature=1.0,
        reasoning={"effort": "none"},
    )
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
