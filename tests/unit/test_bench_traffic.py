"""`hyserve bench serve`'s vLLM traffic options: gamma arrivals (--burstiness), ramp-ups, goodput objectives,
percentiles, the ShareGPT file reader, warm-ups (against a small in-process server) and the usage error of
each flag. The run against a real `hyserve serve` is in tests/e2e/test_bench_e2e.py."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from hyserve.bench import cli, report
from hyserve.bench.arrivals import RampUp, arrival_offsets
from hyserve.bench.goodput import goodput, meets, parse_goodput
from hyserve.bench.http_client import BenchError
from hyserve.bench.metrics import RequestResult, compute_metrics
from hyserve.bench.serve import DatasetOptions, build_requests
from hyserve.bench.sharegpt import sharegpt_dataset, tokenizer_counter


def gaps(t: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0, *t], t)]


# ---- arrivals --------------------------------------------------------------------------------------------


def test_arrivals_are_seeded_and_keep_the_mean_rate() -> None:
    t = arrival_offsets(500, 20.0, 7)
    assert t == arrival_offsets(500, 20.0, 7) and t != arrival_offsets(500, 20.0, 8)
    assert all(b >= a for a, b in zip(t, t[1:])) and t[0] > 0
    assert t[-1] == pytest.approx(500 / 20.0)  # scaled so the run sends at exactly the rate
    assert statistics.fmean(gaps(t)) == pytest.approx(1 / 20.0)
    assert arrival_offsets(4, float("inf"), 0) == [0.0] * 4 and arrival_offsets(0, 5.0, 0) == []


def test_burstiness_sets_the_spread_of_the_gaps() -> None:
    cvs = {}
    for k in (0.25, 1.0, 4.0):
        g = gaps(arrival_offsets(4000, 20.0, 7, burstiness=k))
        assert statistics.fmean(g) == pytest.approx(1 / 20, rel=1e-9)
        cvs[k] = statistics.pstdev(g) / statistics.fmean(g)  # a gamma of shape k: 1 / sqrt(k)
        assert cvs[k] == pytest.approx(k**-0.5, rel=0.15), k
    assert cvs[0.25] > cvs[1.0] > cvs[4.0]
    even = gaps(arrival_offsets(10, 4.0, 0, burstiness=float("inf")))
    assert even == pytest.approx([0.25] * 10)


def test_ramp_up_rates_go_from_start_to_end() -> None:
    lin = RampUp(strategy="linear", start_rps=0.0, end_rps=10.0)
    assert [lin.rate(i, 11) for i in (0, 5, 10)] == [0.0, 5.0, 10.0]
    exp = RampUp(strategy="exponential", start_rps=1.0, end_rps=100.0)
    assert [exp.rate(i, 3) for i in range(3)] == pytest.approx([1.0, 10.0, 100.0])
    assert lin.rate(0, 1) == 0.0  # one request: the start rate (vLLM's progress 0 / max(n - 1, 1))

    ramp = RampUp(strategy="linear", start_rps=2.0, end_rps=200.0)
    g = gaps(arrival_offsets(3000, float("inf"), 3, ramp_up=ramp))
    # each gap is drawn at its request's rate, without rescaling: early gaps ~1/2 s, late ones ~1/200 s
    assert statistics.fmean(g[:20]) == pytest.approx(1 / 2.5, rel=0.5)
    assert statistics.fmean(g[-300:]) == pytest.approx(1 / 190, rel=0.2)
    assert gaps(arrival_offsets(3, float("inf"), 0, ramp_up=lin))[0] == 0.0  # rate 0: at once
    evenly = arrival_offsets(3, float("inf"), 0, burstiness=float("inf"), ramp_up=exp)
    assert evenly == pytest.approx([1.0, 1.1, 1.11])


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"strategy": "step", "start_rps": 1, "end_rps": 2}, r"use one of \['linear', 'exponential'\]"),
        ({"strategy": "linear", "start_rps": -1, "end_rps": 2}, "start rate must be a finite number >= 0"),
        ({"strategy": "linear", "start_rps": 0, "end_rps": 0}, "end rate must be > 0"),
        ({"strategy": "linear", "start_rps": 5, "end_rps": 2}, r"start rate \(5\) must be at most its end"),
        (
            {"strategy": "exponential", "start_rps": 0, "end_rps": 2},
            "exponential ramp-up needs a start rate > 0",
        ),
    ],
)
def test_bad_ramp_ups_are_refused(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RampUp(**kw)


def test_bad_rates_and_burstiness_are_refused() -> None:
    with pytest.raises(ValueError, match="burstiness must be a number > 0"):
        arrival_offsets(3, 1.0, 0, burstiness=0.0)
    with pytest.raises(ValueError, match="request rate must be > 0"):
        arrival_offsets(3, -1.0, 0)


# ---- goodput and percentiles -----------------------------------------------------------------------------


def req(ttft: float, e2el: float, out: int, ok: bool = True) -> RequestResult:
    return RequestResult(ok=ok, prompt_len=4, max_tokens=out, ttft_s=ttft, e2el_s=e2el, output_tokens=out)


def test_goodput_counts_requests_within_every_objective() -> None:
    slos = parse_goodput(["ttft:100", "TPOT:10", "e2el:1000"])
    assert slos == {"ttft": 100.0, "tpot": 10.0, "e2el": 1000.0}
    good = req(0.05, 0.5, 46)  # TPOT (0.5 - 0.05) / 45 = 10 ms: within
    slow_tpot = req(0.05, 0.6, 46)
    one_token = req(0.05, 0.05, 1)  # no TPOT: only TTFT and E2EL count (vLLM takes its TPOT as 0)
    results = [good, slow_tpot, one_token, req(0.2, 0.3, 2), req(0.01, 0.02, 2, ok=False)]
    assert [meets(r, slos) for r in results] == [True, False, True, False, False]
    assert goodput(results, 2.0, slos) == {"good_requests": 2, "request_goodput": 1.0}
    assert goodput(results, 2.0, {"e2el": 350.0})["good_requests"] == 2  # good and req(0.2, 0.3, 2)
    assert parse_goodput(["ttft:0"]) == {"ttft": 0.0}  # as vLLM: any value >= 0


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["ttft"], "expected METRIC:MILLISECONDS"),
        (["itl:5"], "unknown metric 'itl'; use ttft, tpot, e2el"),
        (["ttft:fast"], "'fast' is not a number of milliseconds"),
        (["ttft:-1"], "must be a number of milliseconds >= 0"),
        (["ttft:5", "ttft:6"], "ttft is given twice"),
    ],
)
def test_bad_goodput_objectives_are_named(items: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_goodput(items)


def test_metric_percentiles_and_percentile_metrics() -> None:
    results = [req(0.01 * (i + 1), 0.1 * (i + 1), 11) for i in range(10)]
    m = compute_metrics(results, 1.0, (50, 90, 99))
    assert m["p50_ttft_ms"] == pytest.approx(55.0)  # linear interpolation, as numpy
    assert m["p90_ttft_ms"] == pytest.approx(91.0) and m["p99_ttft_ms"] == pytest.approx(99.1)
    assert m["p90_e2el_ms"] == pytest.approx(910.0)
    m.update(rep=1, request_goodput=None)
    point = {"max_concurrency": None, "reps": [m]}
    table = report.serve_point_table(point, (50, 90, 99), ("ttft", "e2el"))
    assert "P90 TTFT (ms)" in table and "P99 E2EL (ms)" in table and "Median TTFT (ms)" in table
    assert "TPOT (ms)" not in table and "ITL (ms)" not in table and "goodput" not in table
    assert cli._latency_metrics("E2EL, ttft,ttft") == ("e2el", "ttft")
    assert cli._percentiles("50,90,99") == (50.0, 90.0, 99.0)


# ---- ShareGPT --------------------------------------------------------------------------------------------


def conv(q: str, a: str) -> dict[str, Any]:
    return {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}


def write_sharegpt(path: Path) -> Path:
    data = [
        conv("one two three four five", "a b c d e f"),
        conv("tell me a story about a cat please", "once upon a time there was a cat"),
        conv("hi", "hello there my friend"),  # prompt under 4 words: left out
        conv("what is the capital of France", "Paris"),  # reply under 4 words: left out
        {"conversations": [{"from": "human", "value": "only one turn here ok"}]},  # one turn: left out
        {"id": "no conversations"},
    ]
    path.write_text(json.dumps(data))
    return path


def test_sharegpt_takes_first_turns_filters_and_cycles(tmp_path: Path) -> None:
    f = write_sharegpt(tmp_path / "sg.json")
    reqs = sharegpt_dataset(str(f), num_prompts=5, seed=1)
    assert len(reqs) == 5 and {r.prompt for r in reqs} == {
        "one two three four five",
        "tell me a story about a cat please",
    }
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(5, 6), (8, 8)}
    fixed = sharegpt_dataset(str(f), num_prompts=3, seed=1, output_len=7)
    assert {r.output_len for r in fixed} == {7} and len({r.prompt for r in fixed}) == 3  # "Paris" fits now
    assert sharegpt_dataset(str(f), num_prompts=2, seed=1) == sharegpt_dataset(str(f), num_prompts=2, seed=1)
    too_long = sharegpt_dataset(str(f), num_prompts=1, output_len=2043)  # longer prompts: over 2,048
    assert too_long[0].prompt == "one two three four five"
    opts = DatasetOptions(name="sharegpt", num_prompts=2, path=str(f), sharegpt_output_len=3)
    assert [r.output_len for r in build_requests(opts, seed=0, text=True)] == [3, 3]


def test_sharegpt_lengths_by_a_tokenizer(tmp_path: Path) -> None:
    from hyserve.model.tiny import make_tiny

    d = make_tiny(tmp_path / "tiny")
    count = tokenizer_counter(str(d))
    reqs = sharegpt_dataset(str(write_sharegpt(tmp_path / "sg.json")), num_prompts=2, seed=0, count=count)
    assert all(r.prompt_len == count(str(r.prompt)) for r in reqs)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("{not json", "not a readable JSON file"),
        ('{"a": 1}', "expected a JSON list of conversations"),
        (
            '[{"conversations": [{"value": "hi"}, {"value": "yo"}]}]',
            "none of its 1 two-turn conversations fits",
        ),
    ],
)
def test_bad_sharegpt_files_are_named(tmp_path: Path, content: str | None, message: str) -> None:
    f = tmp_path / "sg.json"
    if content is not None:
        f.write_text(content)
    with pytest.raises(ValueError, match=message):
        sharegpt_dataset(str(f), num_prompts=2)
    with pytest.raises(BenchError, match=f"--dataset-path {f}: {message}"):
        build_requests(DatasetOptions(name="sharegpt", num_prompts=2, path=str(f)), seed=0, text=True)
    with pytest.raises(ValueError, match="no tokenizer.json there"):
        tokenizer_counter(str(tmp_path))


def test_a_missing_sharegpt_file_is_a_clear_cli_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.server_fixtures import free_port

    missing = tmp_path / "x.json"  # found before the (absent) server is asked anything
    argv = ["serve", "--port", str(free_port()), "--dataset-name", "sharegpt", "--dataset-path", str(missing)]
    assert cli.main([*argv, "--disable-tqdm"]) == cli.EXIT_FAILED
    assert f"hyserve bench serve: error: --dataset-path {missing}: no such file" in capsys.readouterr().err


# ---- warm-ups, goodput and the progress bar against a small server ---------------------------------------


def _app(seen: list[dict[str, Any]]) -> Any:
    """An OpenAI-ish completions server that records each body and streams max_tokens chunks with usage."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        seen.append(body)
        n = body["max_tokens"]

        async def gen() -> Any:
            for i in range(n):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{i}'}]})}\n\n"
            usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return Starlette(
        routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])]
    )


@contextmanager
def served() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """The small server in a thread: (its URL, the bodies it received)."""
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from tests.server_fixtures import serve_app_in_thread

    seen: list[dict[str, Any]] = []
    with serve_app_in_thread(_app(seen)) as url:
        yield url, seen


def _iter_results(tmp_path: Path) -> Iterator[dict[str, Any]]:
    d = json.loads((tmp_path / "r.json").read_text())
    for p in d["points"]:
        yield from p["reps"]


def test_warm_ups_are_sent_first_and_not_counted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with served() as (url, seen):
        argv = [
            "serve",
            "--base-url",
            url,
            "--num-prompts",
            "4",
            "--random-input-len",
            "6",
            "--random-output-len",
            "5",
            "--num-warmups",
            "3",
            "--max-concurrency",
            "2",
            "--goodput",
            "e2el:60000",
            "ttft:60000",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "r.json",
        ]
        assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert len(seen) == 7
    warm, measured = seen[:3], seen[3:]
    assert all(b["prompt"] == warm[0]["prompt"] for b in warm)  # copies of one request
    assert warm[0]["prompt"] not in [b["prompt"] for b in measured]  # drawn with another seed
    (m,) = _iter_results(tmp_path)
    assert (m["completed"], m["failed"], len(m["requests"]), m["total_output_tokens"]) == (4, 0, 4, 20)
    assert m["good_requests"] == 4 and m["request_goodput"] == pytest.approx(4 / m["duration_s"])
    assert "warm-up: 3 requests (0 failed)" in err and "warm-up" in err.split("warm-up: 3")[0]  # its bar
    assert "Request goodput (req/s)" in out and "3 warm-up requests" in out and "SLOs e2el:60000 ms" in out
    d = json.loads((tmp_path / "r.json").read_text())
    assert (d["num_prompts"], d["request_rate"], d["burstiness"], d["max_concurrency"]) == (4, "inf", 1.0, 2)
    assert any(r["name"].endswith("rep 1: request goodput") for r in d["records"])


def test_ramp_up_run_and_no_progress_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with served() as (url, seen):
        argv = [
            "serve",
            "--base-url",
            url,
            "--num-prompts",
            "5",
            "--random-input-len",
            "4",
            "--random-output-len",
            "2",
            "--ramp-up-strategy",
            "exponential",
            "--ramp-up-start-rps",
            "50",
            "--ramp-up-end-rps",
            "400",
            "--burstiness",
            "2",
            "--percentile-metrics",
            "ttft",
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "r.json",
        ]
        assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert len(seen) == 5 and "\r" not in err and "it/s" not in err and "req/s]" not in err
    assert "ramp-up exponential 50 -> 400 req/s, burstiness 2.0" in out
    assert "TTFT (ms)" in out and "TPOT (ms)" not in out and "goodput" not in out
    d = json.loads((tmp_path / "r.json").read_text())
    assert (d["ramp_up_strategy"], d["ramp_up_start_rps"], d["ramp_up_end_rps"]) == ("exponential", 50, 400)
    (m,) = _iter_results(tmp_path)
    assert m["completed"] == 5 and m["request_goodput"] is None
    starts = [r["start_s"] for r in m["requests"]]
    assert starts[0] > 0 and starts == sorted(starts)  # the first request waited its gap too


# ---- usage errors: each names the flag and what it takes -------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ramp-up-strategy", "step"], "argument --ramp-up-strategy: invalid choice: 'step' (choose from"),
        (["--ramp-up-strategy", "linear", "--ramp-up-end-rps", "5"], "needs both --ramp-up-start-rps and"),
        (["--ramp-up-start-rps", "1"], "need --ramp-up-strategy linear|exponential"),
        (["--ramp-up-start-rps", "-1"], "argument --ramp-up-start-rps: must be a number >= 0"),
        (
            ["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "5"]
            + ["--request-rate", "3"],
            "leave out --request-rate",
        ),
        (
            ["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "6", "--ramp-up-end-rps", "5"],
            "--ramp-up-start-rps (6) must be at most --ramp-up-end-rps (5)",
        ),
        (
            ["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "0", "--ramp-up-end-rps", "0"],
            "argument --ramp-up-end-rps: must be a number > 0",
        ),
        (
            ["--ramp-up-strategy", "exponential", "--ramp-up-start-rps", "0", "--ramp-up-end-rps", "5"],
            "--ramp-up-start-rps must be > 0",
        ),
        (["--request-rate", "-2"], "argument --request-rate: must be > 0 requests/s or inf"),
        (["--burstiness", "0"], "argument --burstiness: burstiness must be a number > 0 (or inf)"),
        (["--burstiness", "-1"], "argument --burstiness"),
        (["--goodput", "ttft:-3"], "argument --goodput: 'ttft:-3': the objective must be a number of"),
        (
            ["--goodput", "latency:3"],
            "argument --goodput: 'latency:3': unknown metric 'latency'; use ttft, tpot, e2el",
        ),
        (["--goodput"], "argument --goodput: expected at least one argument"),
        (
            ["--percentile-metrics", "ttft,latency"],
            "argument --percentile-metrics: expected a comma-separated subset of ttft,tpot,itl,e2el",
        ),
        (["--metric-percentiles", "0,50"], "argument --metric-percentiles: percentiles must be in (0, 100]"),
        (["--metric-percentiles", "-5"], "argument --metric-percentiles"),
        (["--num-warmups", "-1"], "argument --num-warmups: must be an integer >= 0"),
        (["--dataset-path", "x.json"], "--dataset-path FILE goes with --dataset-name sharegpt"),
        (["--dataset-name", "sharegpt"], "sharegpt needs it"),
        (
            ["--sharegpt-output-len", "5"],
            "--sharegpt-output-len and --tokenizer go with --dataset-name sharegpt",
        ),
        (["--sharegpt-output-len", "0"], "argument --sharegpt-output-len: must be an integer >= 1"),
        (["--dataset-name", "sharegpt2"], "argument --dataset-name: invalid choice: 'sharegpt2'"),
    ],
)
def test_bad_traffic_flags_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_burstiness_without_a_rate_is_noted(capsys: pytest.CaptureFixture[str]) -> None:
    with served() as (url, seen):
        argv = ["serve", "--base-url", url, "--num-prompts", "2", "--random-input-len", "3"]
        assert cli.main([*argv, "--random-output-len", "1", "--burstiness", "0.5", "--disable-tqdm"]) == 0
    assert len(seen) == 2
    assert "--burstiness shapes the gaps between arrivals; with --request-rate inf" in capsys.readouterr().err
