"""`hyserve bench` pieces without a model: metrics (exact numbers), datasets, the SSE client on scripted
streams, result files, flag validation, and the bench against a minimal server that reports no usage."""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hyserve.bench import cli, plots, report
from hyserve.bench.datasets import WORDS, as_text, random_dataset, sample_lengths, shared_prefix_dataset
from hyserve.bench.http_client import CHAT, COMPLETIONS, build_payload, join_url, send_streaming, server_root
from hyserve.bench.metrics import (
    RequestResult,
    compute_metrics,
    per_user_tps,
    percentile,
    rep_ratio,
    run_to_run_spread,
    summarize,
    tpot_s,
)
from hyserve.bench.needle import haystack_prompt, parse_size, words_for
from hyserve.bench.serve import arrival_offsets

# ---- metrics ---------------------------------------------------------------------------------------------


def test_percentile_interpolates_linearly_like_numpy() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 99) == pytest.approx(3.97)  # rank 2.97 between 3 and 4
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_has_mean_median_population_std_and_requested_percentiles() -> None:
    s = summarize([1.0, 2.0, 3.0, 4.0], (50, 90))
    assert s["mean"] == 2.5
    assert s["median"] == 2.5
    assert s["std"] == pytest.approx(math.sqrt(1.25))  # population std, numpy's default
    assert (s["min"], s["max"]) == (1.0, 4.0)
    assert s["p50"] == 2.5
    assert s["p90"] == pytest.approx(3.7)
    assert s["p99"] == pytest.approx(3.97)  # always there
    empty = summarize([], (99.9,))
    assert set(empty) == {"mean", "median", "std", "min", "max", "p99", "p99.9"}
    assert all(v is None for v in empty.values())


def _synthetic_results() -> list[RequestResult]:
    # request 1: 4 chunks (ttft 100 ms, gaps 20/30/50 ms), ends at 200 ms, usage says 4 tokens
    r1 = RequestResult(
        ok=True,
        prompt_len=10,
        max_tokens=4,
        ttft_s=0.1,
        itl_s=[0.02, 0.03, 0.05],
        e2el_s=0.2,
        output_tokens=4,
        output_tokens_from_usage=True,
        usage_prompt_tokens=10,
        cached_tokens=0,
    )
    # request 2: no usage, 2 chunks counted (ttft 300 ms, one 100 ms gap), ends at 500 ms
    r2 = RequestResult(
        ok=True, prompt_len=20, max_tokens=2, ttft_s=0.3, itl_s=[0.1], e2el_s=0.5, output_tokens=2
    )
    r3 = RequestResult(
        ok=False, prompt_len=99, max_tokens=4, e2el_s=0.01, status=400, error="HTTP 400: too long"
    )
    return [r1, r2, r3]


def test_ttft_tpot_itl_e2el_from_synthetic_timestamps() -> None:
    r1, r2, r3 = _synthetic_results()
    assert tpot_s(r1) == pytest.approx(0.1 / 3)
    assert per_user_tps(r1) == pytest.approx(30.0)
    assert tpot_s(r2) == pytest.approx(0.2)
    assert per_user_tps(r2) == pytest.approx(5.0)
    one = RequestResult(ok=True, prompt_len=1, max_tokens=1, ttft_s=0.1, e2el_s=0.1, output_tokens=1)
    assert tpot_s(one) is None and per_user_tps(one) is None

    m = compute_metrics([r1, r2, r3], duration_s=1.0, percentiles=(50, 90))
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 30  # usage for r1, the sent length for r2
    assert m["prompt_tokens_sent"] == 30
    assert m["prompt_tokens_usage"] == 10
    assert m["cached_tokens"] == 0
    assert m["total_output_tokens"] == 6
    assert m["output_tokens_source"] == "mixed"
    assert m["request_throughput"] == 2.0
    assert m["input_throughput"] == 30.0
    assert m["output_throughput"] == 6.0
    assert m["total_token_throughput"] == 36.0
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)
    assert m["p90_ttft_ms"] == pytest.approx(280.0)
    assert m["std_ttft_ms"] == pytest.approx(100.0)
    assert m["mean_tpot_ms"] == pytest.approx((100 / 3 + 200) / 2)
    assert m["mean_itl_ms"] == pytest.approx(50.0)  # 20, 30, 50, 100
    assert m["median_itl_ms"] == pytest.approx(40.0)
    assert m["p99_itl_ms"] == pytest.approx(98.5)
    assert m["mean_e2el_ms"] == pytest.approx(350.0)
    assert m["p99_e2el_ms"] == pytest.approx(497.0)
    assert m["mean_per_user_output_tps"] == pytest.approx(17.5)
    assert m["errors"] == [{"error": "HTTP 400: too long", "count": 1}]


def test_metrics_of_a_run_where_everything_failed() -> None:
    m = compute_metrics([_synthetic_results()[2]], duration_s=0.5)
    assert (m["completed"], m["failed"]) == (0, 1)
    assert m["output_throughput"] == 0.0
    assert m["mean_ttft_ms"] is None and m["p99_e2el_ms"] is None
    assert m["output_tokens_source"] == "none"


def test_run_to_run_spread_and_run2_over_run1() -> None:
    reps = [
        {"output_throughput": 100.0, "mean_ttft_ms": 10.0, "p99_tpot_ms": None},
        {"output_throughput": 125.0, "mean_ttft_ms": 30.0, "p99_tpot_ms": 5.0},
    ]
    s = run_to_run_spread(reps)
    assert s["output_throughput"] == {
        "values": [100.0, 125.0],
        "mean": 112.5,
        "min": 100.0,
        "max": 125.0,
        "std": 12.5,
        "spread_pct": pytest.approx(25 / 112.5 * 100),
    }
    assert s["mean_ttft_ms"]["spread_pct"] == pytest.approx(100.0)
    assert "p99_tpot_ms" not in s  # missing in one run
    assert "duration_s" not in s  # missing everywhere
    assert rep_ratio(reps) == 1.25
    assert rep_ratio(reps[:1]) is None


# ---- datasets --------------------------------------------------------------------------------------------


def test_random_dataset_lengths_range_and_determinism() -> None:
    a = random_dataset(
        num_prompts=20, input_len=50, output_len=7, prefix_len=16, vocab_size=300, low=3, seed=1
    )
    assert len(a) == 20
    assert all(r.prompt_len == len(r.prompt) == 66 and r.output_len == 7 for r in a)
    assert all(3 <= t < 300 for r in a for t in r.prompt)
    assert len({tuple(r.prompt[:16]) for r in a}) == 1  # the common prefix
    assert len({tuple(r.prompt[16:]) for r in a}) == 20
    assert a == random_dataset(
        num_prompts=20, input_len=50, output_len=7, prefix_len=16, vocab_size=300, low=3, seed=1
    )
    b = random_dataset(
        num_prompts=20, input_len=50, output_len=7, prefix_len=16, vocab_size=300, low=3, seed=2
    )
    assert [r.prompt for r in a] != [r.prompt for r in b]

    c = random_dataset(num_prompts=400, input_len=100, output_len=10, range_ratio=0.5, vocab_size=300, seed=0)
    ins = [r.prompt_len for r in c]
    outs = [r.output_len for r in c]
    assert 50 <= min(ins) and max(ins) <= 150 and len(set(ins)) > 50
    assert 5 <= min(outs) and max(outs) <= 15
    assert set(sample_lengths(random.Random(0), 1, 0.9, 50)) == {1, 2}  # floor(0.1) -> never below 1
    with pytest.raises(ValueError):
        random_dataset(num_prompts=1, input_len=4, output_len=1, vocab_size=10, low=10)


def test_shared_prefix_dataset_really_shares_prefixes() -> None:
    reqs = shared_prefix_dataset(
        num_prompts=10,
        num_prefixes=3,
        prefix_len=32,
        input_len=8,
        output_len=4,
        vocab_size=1000,
        low=3,
        seed=5,
    )
    groups: dict[int, list[list[int]]] = {}
    for r in reqs:
        assert r.prefix_index is not None and r.prompt_len == 40 and isinstance(r.prompt, list)
        groups.setdefault(r.prefix_index, []).append(r.prompt)
    assert sorted(len(g) for g in groups.values()) == [3, 3, 4]  # spread evenly
    prefixes = {k: {tuple(p[:32]) for p in g} for k, g in groups.items()}
    assert all(len(s) == 1 for s in prefixes.values())  # shared within a group
    assert len({next(iter(s)) for s in prefixes.values()}) == 3  # distinct across groups
    assert len({tuple(r.prompt[32:]) for r in reqs}) == 10  # own suffixes
    assert reqs == shared_prefix_dataset(
        num_prompts=10,
        num_prefixes=3,
        prefix_len=32,
        input_len=8,
        output_len=4,
        vocab_size=1000,
        low=3,
        seed=5,
    )

    text = as_text(reqs)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == r.prompt_len for r in text)
    same = [r for r in text if r.prefix_index == text[0].prefix_index]
    assert len({" ".join(str(r.prompt).split()[:32]) for r in same}) == 1
    assert set(str(text[0].prompt).split()) <= set(WORDS)


def test_poisson_arrivals() -> None:
    assert arrival_offsets(5, float("inf"), 0) == [0.0] * 5
    t = arrival_offsets(2000, 50.0, 3)
    assert t[0] > 0.0 and all(b >= a for a, b in zip(t, t[1:]))  # the first request waits a gap too
    assert t == arrival_offsets(2000, 50.0, 3)
    assert t[-1] == pytest.approx(2000 / 50)  # scaled as vLLM does: exactly the rate over the run


# ---- the SSE client on scripted streams ------------------------------------------------------------------


def _sse(*events: Any) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _client(body: bytes, status: int = 200) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _ticks() -> Iterator[float]:
    t = 0.0
    while True:
        yield t
        t += 1.0


async def _send(body: bytes, kind: str, status: int = 200) -> RequestResult:
    clock = _ticks()
    async with _client(body, status) as c:
        payload = build_payload(
            kind, "m", [1, 2, 3] if kind == COMPLETIONS else "hi", 3, ignore_eos=True, temperature=0.0
        )
        return await send_streaming(
            c, "http://x/v1/completions", payload, kind=kind, prompt_len=3, clock=lambda: next(clock)
        )


def test_client_times_chunks_and_reads_usage() -> None:
    body = _sse(
        {"choices": [{"text": "a"}]},
        {"choices": [{"text": ""}]},
        {"choices": [{"text": "b"}]},
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 3,
                "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 2},
            },
        },
        "[DONE]",
    )
    r = asyncio.run(_send(body, COMPLETIONS))
    # clock: 0 send, 1 "a", 2 "" (a token that detokenizes to nothing yet: still a step), 3 "b", 4 usage,
    # 5 end
    assert r.ok and r.status == 200
    assert r.ttft_s == 1.0 and r.itl_s == [1.0, 1.0] and r.e2el_s == 5.0
    assert (r.output_tokens, r.output_tokens_from_usage) == (3, True)
    assert (r.usage_prompt_tokens, r.cached_tokens) == (3, 2)
    assert r.text == "ab"


def test_client_times_token_chunks_without_text() -> None:
    """A server without a tokenizer streams token-id completions as chunks with empty text: each chunk is
    still a step (TTFT at the first, one ITL per later one); a bare finish chunk is not a token."""
    body = _sse(
        {"choices": [{"text": ""}]},
        {"choices": [{"text": ""}]},
        {"choices": [{"text": ""}]},
        {"choices": [{"text": "", "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}},
        "[DONE]",
    )
    r = asyncio.run(_send(body, COMPLETIONS))
    assert r.ok and r.ttft_s == 1.0 and r.itl_s == [1.0, 1.0] and r.output_tokens == 3


def test_client_counts_chunks_without_usage_chat() -> None:
    body = _sse(
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"content": "Hi"}}]},
        {"choices": [{"delta": {"reasoning_content": "x"}}]},
        {"choices": [{"delta": {}, "finish_reason": "length"}]},
        "[DONE]",
    )
    r = asyncio.run(_send(body, CHAT))
    assert r.ok and r.ttft_s == 2.0 and r.itl_s == [1.0]
    assert (r.output_tokens, r.output_tokens_from_usage, r.usage_prompt_tokens) == (2, False, None)


def test_client_failures() -> None:
    r = asyncio.run(
        _send(
            _sse({"choices": [{"text": "a"}]}, {"error": {"message": "boom", "code": 500}}, "[DONE]"),
            COMPLETIONS,
        )
    )
    assert not r.ok and r.error == "stream error: boom"
    r = asyncio.run(
        _send(
            json.dumps({"error": {"message": "prompt is too long", "type": "x"}}).encode(),
            COMPLETIONS,
            status=400,
        )
    )
    assert not r.ok and r.status == 400 and r.error == "HTTP 400: prompt is too long"
    r = asyncio.run(_send(_sse("[DONE]"), COMPLETIONS))
    assert not r.ok and "without any output" in (r.error or "")
    # finished with nothing visible (bytes held back by the detokenizer): served, TTFT at the finish chunk
    r = asyncio.run(
        _send(
            _sse(
                {"choices": [{"text": "", "finish_reason": "length"}]},
                {"choices": [], "usage": {"completion_tokens": 3}},
                "[DONE]",
            ),
            COMPLETIONS,
        )
    )
    assert r.ok and r.ttft_s == 1.0 and r.output_tokens == 3


def test_urls_and_payloads() -> None:
    assert join_url("http://h:1/v1/", "/v1/completions") == "http://h:1/v1/completions"
    assert join_url("http://h:1", "/v1/chat/completions") == "http://h:1/v1/chat/completions"
    assert server_root("http://h:1/v1") == "http://h:1"
    p = build_payload(COMPLETIONS, "m", [5, 6], 8, ignore_eos=True, temperature=0.0, extra_body={"top_k": 1})
    assert p == {
        "model": "m",
        "max_tokens": 8,
        "temperature": 0.0,
        "prompt": [5, 6],
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "top_k": 1,
    }
    q = build_payload(CHAT, "m", "hi", 2, ignore_eos=False, temperature=0.5)
    assert q["messages"] == [{"role": "user", "content": "hi"}] and "ignore_eos" not in q


# ---- needle helpers --------------------------------------------------------------------------------------


def test_needle_sizes_and_prompt() -> None:
    assert [parse_size(s) for s in ("1k", "8K", "1.5k", "1M", "4096", "256_000")] == [
        1000,
        8000,
        1500,
        1_000_000,
        4096,
        256_000,
    ]
    for bad in ("abc", "0", "-1k", ""):
        with pytest.raises(ValueError):
            parse_size(bad)
    p = haystack_prompt(4, needle="NEEDLE.", filler="w ", position=0.5)
    assert p.endswith("w w NEEDLE. w w ") and p.startswith("Find the secret code")
    assert words_for(1000, base=40.0, per_word=2.0) == 480
    assert words_for(10, base=40.0, per_word=2.0) == 0


def test_needle_depths_and_hit_miss_grid() -> None:
    from hyserve.bench.needle import NeedleOptions, hit_or_miss, needle_depths

    assert needle_depths(NeedleOptions(base_url="u", position=0.3)) == (0.3,)
    assert needle_depths(NeedleOptions(base_url="u", depths=(0.0, 1.0))) == (0.0, 1.0)
    with pytest.raises(ValueError, match=r"fractions in \[0, 1\], got \[-0.5\]"):
        needle_depths(NeedleOptions(base_url="u", depths=(0.5, -0.5)))
    rows = [
        {"target_tokens": t, "depth": d, "status": st, "needle_found": f}
        for t, d, st, f in [
            (1000, 0.0, 200, True),
            (1000, 1.0, 200, False),
            (8000, 0.0, 400, False),
            (8000, 1.0, None, False),
        ]
    ]
    assert [hit_or_miss(r) for r in rows] == ["HIT", "MISS", "HTTP 400", "no answer"]
    for r in rows:
        r["outcome"] = hit_or_miss(r)
    grid = report.needle_grid_text(rows)
    assert "(1 of 4 HIT)" in grid and "depth 0" in grid and "depth 1" in grid
    assert [ln.split()[:3] for ln in grid.splitlines() if ln.startswith(("1,000", "8,000"))] == [
        ["1,000", "HIT", "MISS"],
        ["8,000", "HTTP", "400"],
    ]
    labels = [
        r["name"] for r in report.needle_records([dict(r, prompt_tokens=None, latency_s=0.1) for r in rows])
    ]
    assert "needle 1,000 tokens at depth 1: needle found" in labels


# ---- result files ----------------------------------------------------------------------------------------


def test_records_table_and_json(tmp_path: Path) -> None:
    m1 = compute_metrics(_synthetic_results(), 1.0)
    m2 = dict(m1, output_throughput=12.0)
    for i, m in enumerate((m1, m2)):
        m["rep"] = i + 1
    point = {
        "max_concurrency": 4,
        "reps": [m1, m2],
        "spread": run_to_run_spread([m1, m2]),
        "run2_run1_output_throughput_ratio": rep_ratio([m1, m2]),
    }
    recs = report.serve_records([point])
    assert all(set(r) == {"name", "value", "unit", "reference", "reference_value", "ratio"} for r in recs)
    r2 = next(r for r in recs if r["name"] == "concurrency 4, rep 2: output throughput")
    assert (r2["value"], r2["reference"], r2["reference_value"], r2["ratio"]) == (
        12.0,
        "concurrency 4, rep 1",
        6.0,
        2.0,
    )
    text = report.serve_point_table(point, (50, 99))
    assert "Output token throughput (tok/s)" in text and "run2/run1 output throughput: 2.000" in text
    assert "error (1x): HTTP 400: too long" in text
    res = {
        **report.stamp("serve", ["hyserve", "bench", "serve"], "abc123"),
        "model": "org/My Model",
        "points": [point],
        "records": recs,
        "x": float("nan"),
    }
    path = report.write_json(report.sanitize(res), tmp_path / "out", None, "serve")
    assert path.name.startswith("serve-My-Model-") and path.suffix == ".json"
    d = json.loads(path.read_text())
    assert d["git_sha"] == "abc123" and d["command"] == ["hyserve", "bench", "serve"] and d["x"] is None
    assert isinstance(d["gpu"], str) and d["gpu"] and d["date"][:2] == "20"
    assert report.git_sha() != ""


def test_plot_without_matplotlib_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"kind": "needle", "model": "m", "results": []}))
    monkeypatch.setattr(plots, "matplotlib_available", lambda: False)
    assert cli.main(["plot", str(f)]) == 1
    assert "pip install matplotlib" in capsys.readouterr().err
    assert cli.main(["plot", str(tmp_path / "missing.json")]) == 1
    assert "no such file" in capsys.readouterr().err
    f.write_text("{}")
    assert cli.main(["plot", str(f)]) == 1
    assert "not a hyserve bench result" in capsys.readouterr().err


def test_plots_render_pngs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    reqs = [r.to_json(with_itl=False, with_text=False) for r in _synthetic_results()]
    m = {**compute_metrics(_synthetic_results(), 1.0), "rep": 1, "requests": reqs}
    res = {"kind": "serve", "model": "m", "points": [{"max_concurrency": c, "reps": [m]} for c in (1, 8)]}
    pngs = plots.render(res, tmp_path / "serve")
    assert sorted(p.name for p in pngs) == [
        "serve_e2el_cdf.png",
        "serve_throughput_vs_concurrency.png",
        "serve_ttft_cdf.png",
    ]
    assert all(p.stat().st_size > 1000 for p in pngs)
    needle = {
        "kind": "needle",
        "model": "m",
        "results": [
            {"target_tokens": 1000, "prompt_tokens": 999, "status": 200, "latency_s": 0.5},
            {"target_tokens": 9000, "prompt_tokens": None, "status": 400, "latency_s": 0.01},
        ],
    }
    assert [p.name for p in plots.render(needle, tmp_path / "n")] == ["n_latency.png"]
    offline = {
        "kind": "offline",
        "model": "m",
        "reps": [{"output_throughput": 5.0, "total_token_throughput": 9.0}],
    }
    assert [p.name for p in plots.render(offline, tmp_path / "o")] == ["o_throughput.png"]


# ---- flags -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--request-rate", "0"], "--request-rate"),
        (["serve", "--num-prompts", "0"], "--num-prompts"),
        (["serve", "--random-range-ratio", "1"], "--random-range-ratio"),
        (["serve", "--metric-percentiles", "50,0"], "--metric-percentiles"),
        (["serve", "--sweep-concurrency", "1,x"], "--sweep-concurrency"),
        (["serve", "--endpoint", "/v1/embeddings"], "--endpoint"),
        (["serve", "--dataset-name", "sharegpt"], "--dataset-name"),
        (["serve", "--extra-body", "[1]"], "--extra-body"),
        (["serve", "--max-concurrency", "2", "--sweep-concurrency", "1,2"], "not both"),
        (["serve", "--min-token-id", "400"], "--min-token-id"),
        (["serve", "--dataset-name", "shared-prefix", "--random-prefix-len", "8"], "--shared-prefix-len"),
        (["needle", "--sizes", "1k,lots"], "--sizes"),
        (["needle", "--needle-position", "2"], "--needle-position"),
        (["needle", "--needle-depths", "0,1.5"], "--needle-depths"),
        (["needle", "--needle-depths", ","], "--needle-depths"),
        (["offline", "--output-len", "-1"], "--output-len"),
    ],
)
def test_bad_flag_values_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


# ---- against a minimal server that reports no usage ------------------------------------------------------


def _no_usage_app() -> Any:
    """An OpenAI-ish server that streams one chunk per token and never reports usage."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "other-model", "object": "model"}]})

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        assert body["model"] == "other-model" and isinstance(body["prompt"], list)

        async def gen() -> Any:
            for i in range(body["max_tokens"]):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{i}'}]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return Starlette(
        routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])]
    )


def test_serve_bench_counts_chunks_when_the_server_reports_no_usage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from tests.server_fixtures import serve_app_in_thread

    with serve_app_in_thread(_no_usage_app()) as url:
        rc = cli.main(
            [
                "serve",
                "--base-url",
                url + "/v1",
                "--num-prompts",
                "5",
                "--random-input-len",
                "8",
                "--random-output-len",
                "6",
                "--max-concurrency",
                "2",
                "--save-result",
                "--result-dir",
                str(tmp_path),
                "--result-filename",
                "r.json",
            ]
        )
    out = capsys.readouterr().out
    assert rc == 0, out
    d = json.loads((tmp_path / "r.json").read_text())
    m = d["points"][0]["reps"][0]
    assert d["model"] == "other-model" and d["points"][0]["max_concurrency"] == 2
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (5, 0, 30)
    assert m["output_tokens_source"] == "chunks"
    assert m["prompt_tokens_usage"] is None and m["cached_tokens"] is None
    assert m["total_input_tokens"] == 40  # the sent lengths
    assert all(r["num_chunks"] == 6 for r in m["requests"])


def test_parse_counters_reads_hyserve_counters_only() -> None:
    from hyserve.bench.http_client import parse_counters

    text = (
        "# HELP hyserve_num_preemptions_total Requests preempted\n"
        "# TYPE hyserve_num_preemptions_total counter\n"
        "hyserve_num_preemptions_total 3.0\n"
        "hyserve_prefix_cache_hits_total 128.0\n"
        "hyserve_jit_compiles_after_ready_total 0.0\n"
        "hyserve_cuda_alloc_retries_total 2.0\n"
        "hyserve_kv_cache_usage_ratio 0.5\n"
        "vllm:num_preemptions_total 9.0\n"
        "hyserve_generation_tokens_total not-a-number\n"
    )
    assert parse_counters(text) == {
        "num_preemptions": 3.0,
        "prefix_cache_hits": 128.0,
        "jit_compiles_after_ready": 0.0,
        "cuda_alloc_retries": 2.0,
    }
    assert parse_counters("") == {}
