"""`hyserve serve` as a drop-in for `vllm serve` and `trtllm-serve`: their flags and --config keys reach the
same engine and server options (docs/configuration.md, "Flags of vllm serve and trtllm-serve"), what hyserve
cannot do is refused naming why, and the server answers as vLLM users expect (chat template, generation
config defaults, logprob limit, request log, /ping, 404s naming what is served)."""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from hyserve.cli import build_parser, main
from hyserve.compat import canonical_name, finish, known_names, translate
from hyserve.engine.sampling_params import SamplingParams
from hyserve.model.tokenizer import TINY_CHAT_TEMPLATE, Tokenizer, build_tiny_tokenizer
from hyserve.server.app import ServerOptions, build_app
from tests.server_fixtures import FakeEngine, serve_app_in_thread


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ServerOptions]]:
    """What `hyserve serve` would run with: (engine config, server options) of each call to main()."""
    seen: list[tuple[Any, ServerOptions]] = []

    def fake_run(config: Any, opts: ServerOptions, **_: Any) -> int:
        seen.append((config, opts))
        return 0

    monkeypatch.setattr("hyserve.server.serve.run_server", fake_run)
    return seen


def serve(served: list[tuple[Any, ServerOptions]], *argv: str) -> tuple[Any, ServerOptions]:
    assert main(["serve", *argv]) == 0
    return served[-1]


def attr(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


# ---- flags -> options ------------------------------------------------------------------------------------


ENGINE_FLAGS = [
    (["--model", "/models/m"], "model", "/models/m"),
    (["/models/m", "--model", "/models/m"], "model", "/models/m"),
    (["--max-model-len", "4096"], "scheduler.max_seq_len", 4096),
    (["--gpu-memory-utilization", "0.8"], "cache.gpu_memory_utilization", 0.8),
    (["--gpu-memory-utilization", "0.8"], "cache.free_gpu_memory_fraction", 0.9),
    (["--tensor-parallel-size", "2"], "parallel.tp_size", 2),
    (["-tp", "2"], "parallel.tp_size", 2),
    (["-tp", "2", "--enable-expert-parallel"], "parallel.ep_size", 2),
    (["--kv-cache-dtype", "fp8_e4m3"], "cache.dtype", "fp8"),
    (["--kv-cache-dtype", "fp8"], "cache.dtype", "fp8"),
    (["--kv-cache-dtype", "auto"], "cache.dtype", "auto"),
    (["--mamba-ssm-cache-dtype", "float16"], "cache.mamba_ssm_cache_dtype", "float16"),
    (["--mamba-ssm-cache-dtype", "auto"], "cache.mamba_ssm_cache_dtype", "float32"),
    (["--no-enable-prefix-caching"], "cache.enable_block_reuse", False),
    (["--enable-prefix-caching"], "cache.enable_block_reuse", True),
    (["--no-enable-chunked-prefill"], "scheduler.enable_chunked_prefill", False),
    (["--enable-chunked-prefill"], "scheduler.enable_chunked_prefill", True),
    (["--enforce-eager"], "cuda_graph.enabled", False),
    ([], "cuda_graph.enabled", True),
    (["--dtype", "half"], "dtype", "float16"),
    (["--max-num-seqs", "8", "--max-num-batched-tokens", "1024"], "scheduler.max_batch_size", 8),
    (["--backend", "pytorch", "--max_beam_width", "1"], "ignored_keys", ("backend", "max_beam_width")),
    (["--async-scheduling"], "async_scheduling", True),
    (["--async-scheduling", "off"], "async_scheduling", False),
    (["--kv_cache_free_gpu_memory_fraction", "0.5"], "cache.free_gpu_memory_fraction", 0.5),
    (
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'],
        "speculative.lookup_range",
        (4, 4),
    ),
    (
        ["--speculative_config", '{"method": "[ngram]", "num_speculative_tokens": 2}'],
        "speculative.method",
        "ngram",
    ),
]


@pytest.mark.parametrize(
    ("argv", "path", "want"), ENGINE_FLAGS, ids=[" ".join(a) for a, _, _ in ENGINE_FLAGS]
)
def test_engine_flags(served: list, argv: list[str], path: str, want: Any) -> None:
    config, _ = serve(served, *argv)
    got = attr(config, path)
    assert (got() if callable(got) else got) == want


def test_speculative_config_in_tensorrt_llms_yaml_form(served: list, tmp_path: Path) -> None:
    cfg = tmp_path / "extra.yml"
    cfg.write_text(
        "speculative_config:\n  decoding_type: NGram\n  max_draft_len: 4\n  max_matching_ngram_size: 3\n"
    )
    config, _ = serve(served, "--extra_llm_api_options", str(cfg))
    assert (config.speculative.method, config.speculative.num_speculative_tokens) == ("ngram", 4)
    assert config.speculative.lookup_range() == (3, 3)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ('{"method": "ngram"', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"method": "ngram"}', "num_speculative_tokens: method 'ngram' needs the number of tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens: must be >= 1, got 0"),
        (
            '{"method": "eagle3", "num_speculative_tokens": 2}',
            "speculative_config.method: 'eagle3' is not one",
        ),
        ('{"num_speculative_tokens": 2}', "given without a method"),
    ],
)
def test_bad_speculative_config_names_the_problem(
    served: list, capsys: pytest.CaptureFixture[str], value: str, needle: str
) -> None:
    try:
        rc = main(["serve", "--speculative-config", value])
    except SystemExit as e:  # argparse's own errors (not JSON, not an object)
        rc = e.code
    assert rc == 2
    assert needle in capsys.readouterr().err


SERVER_FLAGS = [
    (["--tool-call-parser", "qwen3_coder", "--enable-auto-tool-choice"], "tool_parser", "qwen3_coder"),
    (["--tool-call-parser", "qwen3_coder", "--enable-auto-tool-choice"], "enable_auto_tool_choice", True),
    (["--reasoning-parser", "nemotron_v3"], "reasoning_parser", "nemotron_v3"),
    (["--reasoning-parser", "nano_v3"], "reasoning_parser", "nano_v3"),
    (["--reasoning-parser", "super_v3"], "reasoning_parser", "super_v3"),
    (["--reasoning_parser", "nemotron-v3"], "reasoning_parser", "nemotron-v3"),
    (["--max-logprobs", "5"], "max_logprobs", 5),
    (["--max-logprobs", "-1"], "max_logprobs", 20),
    ([], "max_logprobs", 20),
    (["--enable-log-requests"], "log_requests", True),
    ([], "log_requests", False),
    (["--disable-log-stats"], "log_stats", False),
    ([], "log_stats", True),
    (["--uvicorn-log-level", "warning"], "log_level", "warning"),
    (["--log-format", "json"], "log_format", "json"),
    (["--generation-config", "vllm"], "generation_config", "vllm"),
    ([], "generation_config", "auto"),
    (["--chat-template", "{{ messages[0].content }}"], "chat_template", "{{ messages[0].content }}"),
    (["--disable-log-requests"], "access_log", False),
    (["--disable-uvicorn-access-log"], "access_log", False),
]


@pytest.mark.parametrize(
    ("argv", "field", "want"), SERVER_FLAGS, ids=[" ".join(a) for a, _, _ in SERVER_FLAGS]
)
def test_server_flags(served: list, argv: list[str], field: str, want: Any) -> None:
    _, opts = serve(served, *argv)
    assert getattr(opts, field) == want


def test_chat_template_from_a_file_and_generation_config_from_a_directory(
    served: list, tmp_path: Path
) -> None:
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.95}')
    _, opts = serve(
        served, "--chat-template", str(tmp_path / "t.jinja"), "--generation-config", str(tmp_path)
    )
    assert opts.chat_template == "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert opts.generation_config == str(tmp_path)


REFUSED = [
    (["--backend", "tensorrt"], "backend: 'tensorrt' is not available: hyserve is one engine, in PyTorch"),
    (["--max_beam_width", "4"], "max_beam_width: 4 is not available: hyserve has no beam search"),
    (["--enable-auto-tool-choice"], "enable_auto_tool_choice: needs a tool parser"),
    (
        ["--chat-template", "/nonexistent/t.jinja"],
        "chat_template: '/nonexistent/t.jinja' is neither a readable",
    ),
    (["--chat-template", "{% if %}"], "chat_template: the chat template does not compile"),
    (["--generation-config", "/nonexistent"], "generation_config: '/nonexistent' is not 'auto', 'vllm' nor"),
    (["--max-logprobs", "21"], "max_logprobs: must be <= 20, got 21"),
    (["--kv-cache-dtype", "fp8_e5m2"], "kv_cache_config.dtype: 'fp8_e5m2' is not supported"),
    (["--dtype", "int8"], "dtype: 'int8' is not one of"),
    (
        ["--gpu-memory-utilization", "0.5", "--kv_cache_free_gpu_memory_fraction", "0.5"],
        "size the same pools: give one of them",
    ),
    (["--gpu-memory-utilization", "1.5"], "kv_cache_config.gpu_memory_utilization: must be in (0, 1]"),
    (["m1", "--model", "m2"], "MODEL ('m1') and --model ('m2') differ"),
    (["-tp", "4", "--ep_size", "2", "--enable-expert-parallel"], "but ep_size is 2"),
    (["--log-format", "xml"], "invalid choice: 'xml'"),
]


@pytest.mark.parametrize(("argv", "message"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_refused_with_the_reason(
    served: list, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    try:
        rc = main(["serve", *argv])
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert not served


# ---- --config and --extra_llm_api_options ------------------------------------------------------------------


def test_vllm_style_config_keys(served: list, tmp_path: Path) -> None:
    cfg = tmp_path / "vllm.yaml"
    cfg.write_text(
        "model: /models/m\nmax-model-len: 4096\ntensor-parallel-size: 1\nport: 9001\n"
        "uvicorn-log-level: warning\nenable-prefix-caching: false\ngpu-memory-utilization: 0.7\n"
        "tool-call-parser: qwen3_coder\nenable-auto-tool-choice: true\nreasoning-parser: nano_v3\n"
        "kv-cache-dtype: fp8\nenforce-eager: true\ndisable-log-stats: true\n"
    )
    config, opts = serve(served, "--config", str(cfg), "--max_seq_len", "8192")
    assert config.model == "/models/m" and config.scheduler.max_seq_len == 8192  # the flag wins
    assert (config.cache.enable_block_reuse, config.cache.gpu_memory_utilization) == (False, 0.7)
    assert (config.cache.dtype, config.cuda_graph.enabled) == ("fp8", False)
    assert (opts.port, opts.log_level, opts.tool_parser, opts.reasoning_parser) == (
        9001,
        "warning",
        "qwen3_coder",
        "nano_v3",
    )
    assert opts.enable_auto_tool_choice and not opts.log_stats


def test_trtllm_extra_options_file_with_top_level_mamba_state_config(served: list, tmp_path: Path) -> None:
    extra = tmp_path / "extra-llm-api-config.yml"
    extra.write_text(
        "backend: pytorch\nmax_batch_size: 8\nkv_cache_config:\n  free_gpu_memory_fraction: 0.8\n"
        "mamba_state_config:\n  periodic_snapshot_interval: 128\n"
    )
    config, _ = serve(served, "--extra_llm_api_options", str(extra), "--backend", "pytorch")
    assert config.cache.mamba_state_config.periodic_snapshot_interval == 128
    assert config.scheduler.max_batch_size == 8 and config.cache.free_gpu_memory_fraction == 0.8
    # the flag's gpu_memory_utilization replaces the file's free_gpu_memory_fraction
    config, _ = serve(served, "--extra-llm-api-options", str(extra), "--gpu-memory-utilization", "0.9")
    assert config.cache.gpu_memory_utilization == 0.9


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        (
            "max_seq_len: 4096\nmax-model-len: 8192\n",
            "'max_seq_len' (4096) and 'max-model-len' (8192) set the",
        ),
        (
            "kv_cache_config:\n  dtype: auto\nkv-cache-dtype: fp8\n",
            "set the same option (kv_cache_config.dtype)",
        ),
        ("tool_parser: qwen3_coder\ntool-call-parser: x\n", "set the same option (tool_parser)"),
        ("max-model-lenn: 3\n", "unknown option 'max-model-lenn' (did you mean 'max_model_len'?)"),
        (
            "kv_cache_config:\n  mamba_state_config:\n    periodic_snapshot_intervall: 64\n",
            "unknown option 'kv_cache_config.mamba_state_config.periodic_snapshot_intervall' (did you mean "
            "'kv_cache_config.mamba_state_config.periodic_snapshot_interval'?)",
        ),
        ("backend: tensorrt\n", "backend: 'tensorrt' is not available"),
        ("max_beam_width: 2\n", "max_beam_width: 2 is not available"),
    ],
)
def test_config_conflicts_and_typos_exit_2_naming_them(
    served: list, capsys: pytest.CaptureFixture[str], tmp_path: Path, yaml_text: str, message: str
) -> None:
    cfg = tmp_path / "c.yml"
    cfg.write_text(yaml_text)
    assert main(["serve", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_config_and_extra_options_must_agree(
    served: list, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    a, b = tmp_path / "a.yml", tmp_path / "b.yml"
    a.write_text("max_seq_len: 4096\n")
    b.write_text("max_seq_len: 8192\n")
    assert main(["serve", "--config", str(a), "--extra_llm_api_options", str(b)]) == 2
    assert "set the same option (max_seq_len) to different values" in capsys.readouterr().err
    b.write_text("max_batch_size: 4\n")
    config, _ = serve(served, "--config", str(a), "--extra_llm_api_options", str(b))
    assert (config.scheduler.max_seq_len, config.scheduler.max_batch_size) == (4096, 4)


# ---- the table of docs/configuration.md --------------------------------------------------------------------


DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
# a value for each YAML key of the table that sets an option (an ignored key is given `true`)
YAML_SAMPLES: dict[str, Any] = {
    "moe_expert_parallel_size": 1,
    "mamba_state_config": {"periodic_snapshot_interval": 128},
}


def table_rows() -> list[tuple[list[str], list[str], str]]:
    """(flags, YAML key paths, hyserve option cell) of each row of the table "Flags of vllm serve and
    trtllm-serve": the flag cell's code spans, those before the word YAML read as flags, those after as
    keys."""
    text = DOCS.read_text().split("## Flags of vllm serve and trtllm-serve", 1)[1]
    table = text[text.index("\n| flag |") :].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")][2:]
    out = []
    for row in rows:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        flag_cell, yaml_cell = (cells[0].split("YAML", 1) + [""])[:2]
        flags = [s.split()[0] for s in re.findall(r"`([^`]+)`", flag_cell) if s.startswith("-")]
        keys = [s.split(":")[0] for s in re.findall(r"`([^`]+)`", yaml_cell)]
        out.append((flags, keys, cells[1]))
    return out


def test_the_table_is_read() -> None:
    rows = table_rows()
    assert len(rows) >= 30 and (["--max-model-len"], [], "`max_seq_len`") in rows
    assert any("kv_cache_config.copy_on_partial_reuse" in keys for _, keys, _ in rows)


def test_every_flag_of_the_table_is_a_serve_flag_and_a_config_key() -> None:
    serve_parser = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices["serve"]
    known = known_names()
    flags = [f for row_flags, _, _ in table_rows() for f in row_flags]
    assert not [f for f in flags if f not in serve_parser._option_string_actions]
    # vLLM's --config takes a flag's name as a key; a negation (--no-X) is written `X: false`
    keys = [f.lstrip("-") for f in flags if f.startswith("--") and not f.startswith("--no-")]
    assert not [k for k in keys if canonical_name(k, known) not in known and k != "extra_llm_api_options"]


def nested(path: str, value: Any) -> dict[str, Any]:
    head, _, rest = path.partition(".")
    return {head: nested(rest, value) if rest else value}


@pytest.mark.parametrize(
    ("key", "option"), [(k, cell) for _, keys, cell in table_rows() for k in keys], ids=lambda v: v[:40]
)
def test_every_yaml_key_of_the_table_is_accepted_as_documented(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, key: str, option: str
) -> None:
    seen: list[tuple[Any, list[str]]] = []

    def fake_run(config: Any, opts: ServerOptions, warnings: list[str], **_: Any) -> int:
        seen.append((config, warnings))
        return 0

    monkeypatch.setattr("hyserve.server.serve.run_server", fake_run)
    ignored = "ignored" in option or "without effect" in option
    assert ignored or key in YAML_SAMPLES, f"{key}: give it a sample value in YAML_SAMPLES"
    value = True if ignored else YAML_SAMPLES[key]
    cfg = tmp_path / "extra-llm-api-config.yml"
    cfg.write_text(yaml.safe_dump(nested(key, value)))
    assert main(["serve", "--extra_llm_api_options", str(cfg)]) == 0
    ((config, warnings),) = seen
    if ignored:
        assert key in config.ignored_keys and any(key in w for w in warnings), warnings
    else:  # the value reaches the option the table names
        target = re.findall(r"`([^`]+)`", option)[0]
        node: Any = finish(translate(nested(key, value), "yaml"))
        for part in target.split("."):
            node = node[part]
        assert node == value and not config.ignored_keys


def test_mamba_state_config_at_the_top_level_and_under_kv_cache_config_must_agree(
    served: list, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    cfg = tmp_path / "c.yml"
    both = "mamba_state_config:\n  periodic_snapshot_interval: {}\nkv_cache_config:\n  mamba_state_config:\n"
    cfg.write_text(both.format(128) + "    periodic_snapshot_interval: 128\n")
    assert serve(served, "--config", str(cfg))[0].cache.mamba_state_config.periodic_snapshot_interval == 128
    cfg.write_text(both.format(64) + "    periodic_snapshot_interval: 128\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "(kv_cache_config.mamba_state_config) to different values" in err, err


def test_moe_expert_parallel_size_is_ep_size(served: list, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yml"
    cfg.write_text("tp_size: 2\nmoe_expert_parallel_size: 2\n")
    assert serve(served, "--config", str(cfg))[0].parallel.ep_size == 2
    assert serve(served, "-tp", "2", "--moe-expert-parallel-size", "2")[0].parallel.ep_size == 2
    assert serve(served, "-tp", "2", "--ep_size", "2")[0].parallel.ep_size == 2


# ---- the API key from the environment ----------------------------------------------------------------------


def test_api_key_from_the_environment(served: list, monkeypatch: pytest.MonkeyPatch) -> None:
    from hyserve import envs

    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    monkeypatch.delenv("HYSERVE_API_KEY", raising=False)
    assert envs._secret("HYSERVE_API_KEY", "VLLM_API_KEY") == "from-vllm"
    monkeypatch.setenv("HYSERVE_API_KEY", "from-hyserve")
    assert envs._secret("HYSERVE_API_KEY", "VLLM_API_KEY") == "from-hyserve"
    monkeypatch.setenv("HYSERVE_API_KEY", "")
    assert envs._secret("HYSERVE_API_KEY", "VLLM_API_KEY") == "from-vllm"  # empty reads as unset

    monkeypatch.setattr(envs, "HYSERVE_API_KEY", "env-key")
    assert serve(served)[1].api_key == "env-key"
    assert serve(served, "--api-key", "flag-key")[1].api_key == "flag-key"
    assert serve(served, "--no_auth")[1].api_key is None


# ---- the server ------------------------------------------------------------------------------------------


def tiny_tokenizer(generation_config: dict[str, Any] | None = None) -> Tokenizer:
    return Tokenizer(
        build_tiny_tokenizer(),
        config={"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
        chat_template=TINY_CHAT_TEMPLATE,
        generation_config=generation_config,
    )


class Recorder:
    """A FakeEngine script that keeps each request's SamplingParams."""

    def __init__(self) -> None:
        self.params: list[SamplingParams] = []

    def __call__(self, ids: list[int], p: SamplingParams) -> list[str]:
        self.params.append(p)
        return ["Hello", " world"]


@pytest.fixture
def app_url() -> Iterator[Any]:
    """Serve apps over fake engines: yields start(options, generation_config) -> (url, engine)."""
    stack: list[Any] = []

    def start(opts: ServerOptions, generation_config: dict[str, Any] | None = None) -> tuple[str, FakeEngine]:
        engine = FakeEngine(tokenizer=tiny_tokenizer(generation_config), max_seq_len=1024)
        engine.script = Recorder()
        cm = serve_app_in_thread(build_app(engine, opts))
        url = cm.__enter__()
        stack.append(cm)
        return url, engine

    yield start
    for cm in stack:
        cm.__exit__(None, None, None)


def test_chat_template_replaces_the_checkpoints(app_url: Any) -> None:
    url, _ = app_url(
        ServerOptions(chat_template="CUSTOM:{% for m in messages %}[{{ m.content }}]{% endfor %}")
    )
    r = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 200, r.text
    text = httpx.post(f"{url}/detokenize", json={"tokens": r.json()["tokens"]}, timeout=30).json()["prompt"]
    assert text == "CUSTOM:[hi]"


def test_generation_config_gives_the_defaults_a_request_leaves_out(app_url: Any) -> None:
    gen = {"temperature": 0.6, "top_p": 0.95, "top_k": 50, "repetition_penalty": 1.1, "max_new_tokens": 7}
    url, engine = app_url(ServerOptions(), generation_config=gen)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 200
    explicit = {**body, "temperature": 0.0, "top_p": 1.0, "max_tokens": 20}
    assert httpx.post(f"{url}/v1/chat/completions", json=explicit, timeout=30).status_code == 200
    a, b = engine.script.params
    # top_k 50 is transformers' own default, not the model's recommendation: left out, as vLLM does
    assert (a.temperature, a.top_p, a.top_k, a.repetition_penalty, a.max_tokens) == (0.6, 0.95, 0, 1.1, 7)
    assert (b.temperature, b.top_p, b.max_tokens) == (0.0, 1.0, 20)
    url, engine = app_url(ServerOptions(generation_config="vllm"), generation_config=gen)
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=30).status_code == 200
    (c,) = engine.script.params
    assert (c.temperature, c.top_p, c.repetition_penalty) == (1.0, 1.0, 1.0)


def test_generation_config_from_a_directory(app_url: Any, tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "min_p": 0.05}))
    url, engine = app_url(
        ServerOptions(generation_config=str(tmp_path)), generation_config={"temperature": 0.9}
    )
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=30).status_code == 200
    (p,) = engine.script.params
    assert (p.temperature, p.min_p) == (0.3, 0.05)


def test_max_logprobs_is_a_400_naming_the_limit(app_url: Any) -> None:
    url, _ = app_url(ServerOptions(max_logprobs=2))
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "logprobs": 3}, timeout=30)
    assert r.status_code == 400 and "limit of 2 (--max-logprobs)" in r.json()["error"]["message"], r.text
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 5}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "logprobs": 2}, timeout=30)
    assert r.status_code == 200, r.text


def test_enable_log_requests_logs_each_request(app_url: Any, caplog: pytest.LogCaptureFixture) -> None:
    url, _ = app_url(ServerOptions(log_requests=True))
    with caplog.at_level(logging.INFO, logger="hyserve.requests"):
        body = {"prompt": "hi", "max_tokens": 2, "temperature": 0.5}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "hyserve.requests"]
    assert len(lines) == 2, lines
    assert "prompt tokens, max_tokens=2, temperature=0.5" in lines[0]
    assert "finished: length, 2 output tokens" in lines[1]
    url, _ = app_url(ServerOptions())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hyserve.requests"):
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
    assert not [r for r in caplog.records if r.name == "hyserve.requests"]


@pytest.mark.parametrize(
    ("method", "path", "what"),
    [
        ("POST", "/v1/embeddings", "embeddings"),
        ("POST", "/v1/audio/transcriptions", "audio"),
        ("POST", "/v1/audio/speech", "audio"),
        ("POST", "/v1/images/generations", "images"),
        ("GET", "/v1/images", "images"),
    ],
)
def test_other_kinds_of_endpoint_are_404s_naming_what_is_served(
    app_url: Any, method: str, path: str, what: str
) -> None:
    url, _ = app_url(ServerOptions())
    r = httpx.request(method, f"{url}{path}", json={"input": "x", "model": "fake-model"}, timeout=30)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_endpoint" and f"does not serve {what}" in err["message"]
    assert "'fake-model'" in err["message"] and "/v1/chat/completions" in err["message"]


def test_ping_answers_like_health(app_url: Any) -> None:
    url, engine = app_url(ServerOptions(api_key="k"))
    for method in ("GET", "POST", "HEAD"):
        assert httpx.request(method, f"{url}/ping", timeout=10).status_code == 200  # no key needed
    assert httpx.get(f"{url}/ping").json() == httpx.get(f"{url}/health").json() == {"status": "ok"}
    engine.healthy = False
    assert httpx.get(f"{url}/ping").status_code == httpx.get(f"{url}/health").status_code == 503
