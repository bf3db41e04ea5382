"""`hyserve` CLI: flag spellings, YAML + flag precedence, one-line config errors (exit 2), make-tiny,
generate, and serve's graceful shutdown with an API key."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from hyserve.cli import build_parser, engine_options_from_args, main
from tests.server_fixtures import REPORT_STYLE_YAML, ServerProcess


def parse(*argv: str):  # noqa: ANN201 - argparse.Namespace
    return build_parser().parse_args(list(argv))


# ---- flags and YAML ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["--max_batch_size", "--max-batch-size"])
def test_underscore_and_hyphen_spellings(spelling: str) -> None:
    assert parse("serve", spelling, "4").max_batch_size == 4


def test_every_serve_flag_reaches_an_option() -> None:
    """A flag the parser takes but no option reads would be dropped without a word: each one is an engine
    or server option (in some server's spelling), a flag accepted and ignored, or one the CLI reads itself."""
    import argparse

    from hyserve.cli import _IGNORED_FLAGS
    from hyserve.compat import known_names

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    dests = {a.dest for a in sub.choices["serve"]._actions if a.dest != "help"}
    cli_only = {"config", "extra_llm_api_options", "model_option"}
    assert dests - known_names() - set(_IGNORED_FLAGS) - cli_only == set()


@pytest.mark.parametrize("mode", ["on", "off", "auto"])
def test_engine_process_flag_reaches_the_server_options(mode: str) -> None:
    from hyserve.cli import _build_config, build_server_options

    opts, server, _ = engine_options_from_args(parse("serve", "--engine-process", mode))
    assert build_server_options(lambda n, d: server.get(n, d), _build_config(opts)).engine_process == mode


def test_report_launch_command_parses() -> None:
    args = parse(
        "serve",
        "nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-NVFP4",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--tp_size",
        "4",
        "--ep_size",
        "4",
        "--max_batch_size",
        "8",
        "--max_num_tokens",
        "16384",
        "--max_seq_len",
        "1048576",
        "--trust_remote_code",
        "--reasoning_parser",
        "nemotron-v3",
        "--tool_parser",
        "qwen3_coder",
        "--config",
        "./extra-llm-api-config.yml",
    )
    assert (args.model, args.host, args.port, args.tp_size, args.max_seq_len) == (
        "nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-NVFP4",
        "0.0.0.0",
        8000,
        4,
        1048576,
    )
    assert (
        args.trust_remote_code
        and args.reasoning_parser == "nemotron-v3"
        and args.tool_parser == "qwen3_coder"
    )
    args = parse(
        "serve",
        "--served-model-name",
        "m",
        "--api-key",
        "k",
        "--load-format",
        "dummy",
        "--kv-cache-free-gpu-memory-fraction",
        "0.5",
    )
    assert (
        args.served_model_name,
        args.api_key,
        args.load_format,
        args.kv_cache_free_gpu_memory_fraction,
    ) == (["m"], "k", "dummy", 0.5)


def test_flags_override_yaml_and_nested_merge(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yml"
    cfg.write_text(REPORT_STYLE_YAML + "host: 0.0.0.0\nreasoning_parser: nemotron-v3\n")
    args = parse(
        "serve", "--config", str(cfg), "--max_batch_size", "4", "--kv_cache_free_gpu_memory_fraction", "0.5"
    )
    opts, server_yaml, ignored = engine_options_from_args(args)
    assert opts["max_batch_size"] == 4  # flag beats YAML (32)
    assert opts["max_num_tokens"] == 1024  # YAML kept
    kv = opts["kv_cache_config"]
    assert kv["free_gpu_memory_fraction"] == 0.5 and kv["tokens_per_block"] == 64  # merged, not replaced
    assert server_yaml == {"host": "0.0.0.0", "reasoning_parser": "nemotron-v3"}
    assert ignored == []
    from hyserve.config import build_engine_config

    config = build_engine_config(opts)
    assert {
        "backend",
        "disable_overlap_scheduler",
        "enable_attention_dp",
        "trust_remote_code",
        "moe_config",
    } <= set(config.ignored_keys)


def test_warmup_flags_reach_the_engine_config(tmp_path: Path) -> None:
    from hyserve.config import build_engine_config

    args = parse("serve", "--warmup", "on", "--strict-warmup", "--cache-dir", str(tmp_path / "kc"))
    config = build_engine_config(engine_options_from_args(args)[0])
    assert (config.warmup, config.strict_warmup, config.cache_dir) == ("on", True, str(tmp_path / "kc"))
    default = build_engine_config(engine_options_from_args(parse("serve"))[0])
    assert (default.warmup, default.strict_warmup, default.cache_dir) == ("auto", False, None)
    with pytest.raises(SystemExit):
        parse("serve", "--warmup", "sometimes")


# ---- config errors: exit 2, one line naming the key --------------------------------------------------------


@pytest.mark.parametrize(
    ("yaml_text", "extra", "words"),
    [
        ("kv_cache_config:\n  bogus_knob: 1\n", [], ["kv_cache_config.bogus_knob"]),
        ("kv_cache_config:\n  mamba_ssm_cache_dtype: int4\n", [], ["mamba_ssm_cache_dtype", "float16"]),
        ("max_batch_size: lots\n", [], ["max_batch_size"]),
        ("", ["--tp_size", "4", "--ep_size", "3"], ["ep_size (3) must divide tp_size (4)"]),
        ("", ["--reasoning_parser", "bogus"], ["reasoning_parser", "nemotron-v3"]),
        ("", ["--tool_parser", "mistral"], ["tool_parser", "qwen3_coder", "hermes"]),
        (": not yaml: [", [], ["not valid YAML"]),
        # refused by the engine as it starts, in its own process: the same one line
        (
            "kv_cache_config:\n  max_gpu_total_bytes: 4194304\nmax_seq_len: 1000000\n",
            ["--engine-process", "on", "--port", "0"],
            ["max_seq_len=1,000,000 does not fit in the KV cache", "lower max_seq_len (to at most"],
        ),
    ],
)
def test_bad_config_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], yaml_text: str, extra: list[str], words: list[str]
) -> None:
    cfg = tmp_path / "bad.yml"
    cfg.write_text(yaml_text)
    rc = main(["serve", "--config", str(cfg), *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err


def test_missing_config_file_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--config", "/nonexistent/x.yml"]) == 2
    assert "not found" in capsys.readouterr().err


def test_console_entry_point_no_traceback(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yml"
    cfg.write_text(
        "kv_cache_config:\n  tokens_per_block: 64\n"
        "  mamba_state_config:\n    periodic_snapshot_interval: 100\n"
    )
    p = subprocess.run(
        [sys.executable, "-m", "hyserve.cli", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert "Traceback" not in p.stderr and "periodic_snapshot_interval" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "serve" in capsys.readouterr().out


# ---- make-tiny, generate -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny") / "m"
    assert main(["make-tiny", str(d), "--variant", "dense", "--seed", "3"]) == 0
    return d


def test_make_tiny(tiny_dir: Path) -> None:
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_dir / f).is_file()


def test_generate_json(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "generate",
            str(tiny_dir),
            "--prompt",
            "Hello",
            "--prompt-ids",
            "1,5,6",
            "--max-tokens",
            "4",
            "--ignore-eos",
            "--json",
            "--logprobs",
            "2",
        ]
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    a, b = (json.loads(line) for line in out)
    assert a["prompt"] == "Hello" and len(a["token_ids"]) == 4 and a["finish_reason"] == "length"
    assert b["prompt_token_ids"] == [1, 5, 6] and len(b["logprobs"]) == 4


def test_generate_config_only_dir_needs_token_ids(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "config-only"
    d.mkdir()
    shutil.copy(tiny_dir / "config.json", d / "config.json")
    assert (
        main(
            [
                "generate",
                str(d),
                "--load-format",
                "dummy",
                "--prompt-ids",
                "1,2,3",
                "--max-tokens",
                "3",
                "--ignore-eos",
            ]
        )
        == 0
    )
    assert len(capsys.readouterr().out.split()) == 3  # no tokenizer: token ids are printed
    assert main(["generate", str(d), "--load-format", "dummy", "--prompt", "text"]) == 2
    assert "token ids" in capsys.readouterr().err


# ---- serve: API key and graceful shutdown ---------------------------------------------------------------


@pytest.mark.slow
def test_serve_api_key_and_graceful_sigint() -> None:
    server = ServerProcess(
        args=["--max_seq_len", "4096", "--served-model-name", "my-model", "--shutdown_timeout", "1"],
        api_key="k3y",
    ).start()  # the drain gives the stream 1 s, then aborts it
    try:
        body = {"model": "my-model", "prompt": "Go:", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        assert httpx.post(f"{server.base_url}/completions", json=body).status_code == 401
        assert httpx.get(f"{server.url}/health").status_code == 200
        events: list[str] = []
        started = threading.Event()

        def reader() -> None:
            with httpx.stream(
                "POST", f"{server.base_url}/completions", json=body, headers=server.headers, timeout=60
            ) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()

        t = threading.Thread(target=reader)
        t.start()
        assert started.wait(30)
        rc = server.stop(signal.SIGINT)
        t.join(30)
    finally:
        server.stop(signal.SIGKILL)
    assert rc == 0, server.log()
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_aborted"
    assert "shutting down" in server.log()


def test_the_server_fixture_moves_off_a_port_taken_before_the_server_binds_it() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        server = ServerProcess(args=["--max_seq_len", "512", "--warmup", "off"], port=taken).start()
        try:
            assert server.port != taken
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        finally:
            assert server.stop() == 0
