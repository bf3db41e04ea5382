"""vllm serve's and trtllm-serve's option names read as hyserve's (hyserve/compat.py), the values they spell
differently (hyserve/config.py), and vLLM's gpu_memory_utilization turned into the pools' byte budget."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hyserve import compat
from hyserve.cache.capacity import device_cache_budget
from hyserve.config import build_engine_config

GiB = 2**30


def engine_options(raw: dict, source: str = "test.yml") -> dict:
    return compat.finish(compat.translate(raw, source))


def test_vllm_config_keys_in_either_spelling_reach_hyserve_options() -> None:
    opts = compat.translate(
        {
            "model": "/m",
            "max-model-len": 4096,
            "gpu_memory_utilization": 0.85,
            "tensor-parallel-size": 2,
            "kv-cache-dtype": "fp8_e4m3",
            "mamba_ssm_cache_dtype": "float16",
            "enable-prefix-caching": False,
            "enforce-eager": True,
            "max-num-seqs": 16,
            "max_num_batched_tokens": 2048,
            "tool-call-parser": "qwen3_coder",
            "uvicorn-log-level": "warning",
            "port": 9000,
            "served-model-name": "m",
        },
        "vllm.yml",
    )
    assert opts.engine == {
        "model": "/m",
        "max_seq_len": 4096,
        "tp_size": 2,
        "max_batch_size": 16,
        "max_num_tokens": 2048,
        "served_model_name": "m",
        "kv_cache_config": {
            "gpu_memory_utilization": 0.85,
            "dtype": "fp8_e4m3",
            "mamba_ssm_cache_dtype": "float16",
            "enable_block_reuse": False,
        },
        "cuda_graph_config": {"enabled": False},
    }
    assert opts.server == {"tool_parser": "qwen3_coder", "log_level": "warning", "port": 9000}
    cfg = build_engine_config(compat.finish(opts))
    assert (cfg.cache.dtype, cfg.cache.gpu_memory_utilization, cfg.cuda_graph.enabled) == ("fp8", 0.85, False)


def test_trtllm_yaml_keys_pass_through_and_mamba_state_config_at_the_top_level() -> None:
    raw = {
        "max_batch_size": 8,
        "backend": "pytorch",
        "max_beam_width": 1,
        "kv_cache_config": {"free_gpu_memory_fraction": 0.8, "tokens_per_block": 64},
        "mamba_state_config": {"periodic_snapshot_interval": 128},
    }
    cfg = build_engine_config(engine_options(raw))
    assert cfg.cache.mamba_state_config.periodic_snapshot_interval == 128
    assert cfg.cache.free_gpu_memory_fraction == 0.8 and cfg.scheduler.max_batch_size == 8
    assert set(cfg.ignored_keys) == {"backend", "max_beam_width"}
    # the config builder takes it at the top level too (LLM keywords, bench offline)
    direct = build_engine_config({"mamba_state_config": {"periodic_snapshot_interval": 128}})
    assert direct.cache.mamba_state_config.periodic_snapshot_interval == 128


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"max_seq_len": 4096, "max-model-len": 8192},
            "'max_seq_len' (4096) and 'max-model-len' (8192) set the same option (max_seq_len) to different",
        ),
        (
            {"kv_cache_config": {"dtype": "auto"}, "kv-cache-dtype": "fp8"},
            "'kv_cache_config.dtype' ('auto') and 'kv-cache-dtype' ('fp8') set the same option",
        ),
        ({"tp_size": 2, "tensor_parallel_size": 4}, "set the same option (tp_size)"),
        ({"tool_parser": "qwen3_coder", "tool-call-parser": "other"}, "set the same option (tool_parser)"),
        (
            {"mamba_state_config": {"periodic_snapshot_interval": 64}, "kv_cache_config": {
                "mamba_state_config": {"periodic_snapshot_interval": 128}}},
            "set the same option (kv_cache_config.mamba_state_config)",
        ),
        ({"max-model-lenght": 5}, "unknown option 'max-model-lenght' (did you mean 'max_model_len'?)"),
        ({"enforce-eager": "yes"}, "enforce_eager: expected true or false, got 'yes'"),
    ],
)  # fmt: skip
def test_one_option_given_twice_or_unknown_is_refused(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^test.yml: ") as e:
        compat.translate(raw, "test.yml")
    assert message in str(e.value), e.value


def test_the_same_value_given_both_ways_is_accepted() -> None:
    assert engine_options({"max_seq_len": 4096, "max-model-len": 4096}) == {"max_seq_len": 4096}


def test_later_source_wins_and_a_memory_share_replaces_the_other() -> None:
    yaml = compat.translate({"max_seq_len": 4096, "kv_cache_config": {"free_gpu_memory_fraction": 0.8}}, "y")
    flags = compat.translate({"max_model_len": 8192, "gpu_memory_utilization": 0.5}, "flags")
    merged = compat.finish(compat.merge(yaml, flags))
    assert merged == {"max_seq_len": 8192, "kv_cache_config": {"gpu_memory_utilization": 0.5}}
    with pytest.raises(
        ValueError, match="gpu_memory_utilization .* and kv_cache_config.free_gpu_memory_fraction"
    ):
        build_engine_config(
            {"kv_cache_config": {"gpu_memory_utilization": 0.5, "free_gpu_memory_fraction": 0.8}}
        )


def test_two_files_must_agree() -> None:
    a = compat.translate({"max_seq_len": 4096, "port": 1}, "a.yml")
    b = compat.translate({"max-model-len": 8192}, "b.yml")
    with pytest.raises(ValueError, match=r"a\.yml.*b\.yml.*max_seq_len"):
        compat.combine(compat.combine(compat.Options("none"), a), b)
    ok = compat.combine(compat.combine(compat.Options("none"), a), compat.translate({"host": "h"}, "b.yml"))
    assert ok.server == {"port": 1, "host": "h"} and ok.engine == {"max_seq_len": 4096}


def test_enable_expert_parallel_is_ep_size_tp_size() -> None:
    assert engine_options({"tensor_parallel_size": 4, "enable_expert_parallel": True}) == {
        "tp_size": 4,
        "ep_size": 4,
    }
    assert engine_options({"enable_expert_parallel": False, "tp_size": 2}) == {"tp_size": 2}
    with pytest.raises(ValueError, match="all tp_size = 4 ranks, but ep_size is 2"):
        engine_options({"tp_size": 4, "ep_size": 2, "enable_expert_parallel": True})


@pytest.mark.parametrize(
    ("opts", "attr", "want"),
    [
        ({"dtype": "half"}, "dtype", "float16"),
        ({"dtype": "float"}, "dtype", "float32"),
        ({"dtype": "BFloat16"}, "dtype", "bfloat16"),
        ({"kv_cache_config": {"dtype": "fp8_e4m3"}}, "cache.dtype", "fp8"),
        ({"kv_cache_config": {"dtype": "auto"}}, "cache.dtype", "auto"),
        ({"kv_cache_config": {"mamba_ssm_cache_dtype": "auto"}}, "cache.mamba_ssm_cache_dtype", "float32"),
    ],
)
def test_value_spellings(opts: dict, attr: str, want: str) -> None:
    node = build_engine_config(opts)
    for part in attr.split("."):
        node = getattr(node, part)
    assert node == want


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        ({"kv_cache_config": {"dtype": "fp8_e5m2"}}, "kv_cache_config.dtype: 'fp8_e5m2' is not supported: "),
        ({"dtype": "int8"}, "dtype: 'int8' is not one of ['auto', 'bfloat16', 'float16', 'float32'] (or "),
        ({"backend": "tensorrt"}, "backend: 'tensorrt' is not available: hyserve is one engine, in PyTorch"),
        ({"backend": "_autodeploy"}, "backend: '_autodeploy' is not available"),
        ({"max_beam_width": 4}, "max_beam_width: 4 is not available: hyserve has no beam search"),
        (
            {"kv_cache_config": {"tokens_per_blok": 32}},
            "unknown option 'kv_cache_config.tokens_per_blok' (did you mean "
            "'kv_cache_config.tokens_per_block'?)",
        ),
        (
            {"kv_cache_config": {"mamba_state_config": {"periodic_snapshot_intervall": 64}}},
            "unknown option 'kv_cache_config.mamba_state_config.periodic_snapshot_intervall' (did you mean "
            "'kv_cache_config.mamba_state_config.periodic_snapshot_interval'?)",
        ),
        ({"max_batch_sise": 3}, "unknown option 'max_batch_sise' (did you mean 'max_batch_size'?)"),
        ({"kv_cache_config": {"gpu_memory_utilization": 1.5}}, "gpu_memory_utilization: must be in (0, 1]"),
    ],
)
def test_refusals_name_the_key_and_why(opts: dict, message: str) -> None:
    with pytest.raises(ValueError) as e:
        build_engine_config(opts)
    assert message in str(e.value), e.value


def test_gpu_memory_utilization_is_a_share_of_the_total() -> None:
    # 80 GiB GPU, 20 GiB in use after the weights (60 free), 2 GiB reserved for activations
    free, total, reserved = 60 * GiB, 80 * GiB, 2 * GiB
    assert device_cache_budget(free, 0.9, reserved) == int(0.9 * 60 * GiB) - reserved
    # vLLM's 0.9: the server holds 72 GiB in all; 20 are in use, 2 reserved -> 50 GiB of pools
    assert device_cache_budget(free, 0.9, reserved, total_bytes=total, utilization=0.9) == 50 * GiB
    assert device_cache_budget(free, 0.9, reserved, 8 * GiB, total_bytes=total, utilization=0.9) == 8 * GiB
    # a share below what is in use already leaves nothing (start-up then names the budget)
    assert device_cache_budget(free, 0.9, reserved, total_bytes=total, utilization=0.2) == 0


def test_the_planner_takes_gpu_memory_utilization(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's budget on a GPU (engine/assembly/assemble.py) from torch's free / total figures."""
    from hyserve.engine.assembly import assemble as assembly

    monkeypatch.setattr(assembly.torch.cuda, "mem_get_info", lambda device: (60 * GiB, 80 * GiB))
    lm = SimpleNamespace(device=SimpleNamespace(type="cuda"), config=SimpleNamespace(vocab_size=1000))
    acts = SimpleNamespace(total_bytes=GiB)
    slack = 256 * 2**20
    frac = build_engine_config({"kv_cache_config": {"free_gpu_memory_fraction": 0.5}})
    assert assembly.cache_budget_bytes(frac, lm, acts, []) == 30 * GiB - GiB - slack
    util = build_engine_config({"kv_cache_config": {"gpu_memory_utilization": 0.5}})
    assert assembly.cache_budget_bytes(util, lm, acts, []) == 40 * GiB - 20 * GiB - GiB - slack


@pytest.mark.parametrize(
    ("value", "graphs"),
    [
        ({"cudagraph_mode": "FULL_DECODE_ONLY"}, {"enabled": True, "piecewise": False}),
        ({"cudagraph_mode": "full_and_piecewise"}, {"enabled": True, "piecewise": True}),
        ({"cudagraph_mode": "PIECEWISE"}, {"enabled": True, "piecewise": True}),
        ({"cudagraph_mode": "NONE"}, {"enabled": False}),
        (
            {"cudagraph_capture_sizes": [1, 2, 4, 8], "max_cudagraph_capture_size": 8},
            {"batch_sizes": [1, 2, 4, 8], "max_batch_size": 8},
        ),
        ('{"cudagraph_mode": "FULL_DECODE_ONLY"}', {"enabled": True, "piecewise": False}),
        ("0", {"enabled": False}),
        (3, None),
    ],
)
def test_vllm_compilation_config_sets_the_cuda_graphs(value: object, graphs: dict | None) -> None:
    opts = compat.translate({"compilation-config": value}, "vllm.yml")
    assert opts.engine.get("cuda_graph_config") == graphs and not opts.ignored
    build_engine_config(compat.finish(opts))


def test_compilation_config_torch_compile_keys_are_accepted_without_effect() -> None:
    opts = compat.translate(
        {"compilation_config": {"level": 3, "use_inductor": False, "cudagraph_mode": "NONE"}}, "vllm.yml"
    )
    assert opts.engine == {"cuda_graph_config": {"enabled": False}}
    assert opts.ignored == ["compilation_config.level", "compilation_config.use_inductor"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"cudagraph_mode": "SOMETIMES"}, "cudagraph_mode: 'SOMETIMES' is not one of NONE, FULL_DECODE_ONLY"),
        (7, "optimisation level 7 is not one of 0, 1, 2, 3"),
        ("fast", "'fast' is neither a JSON object nor an optimisation level 0-3"),
        ([1], "expected a mapping or a level 0-3"),
    ],
)
def test_bad_compilation_config_is_refused_naming_it(value: object, message: str) -> None:
    with pytest.raises(ValueError, match="^vllm.yml: compilation_config") as e:
        compat.translate({"compilation_config": value}, "vllm.yml")
    assert message in str(e.value)


def test_compilation_config_on_the_command_line() -> None:
    """vLLM's -O level and --compilation-config JSON; a torch.compile key lands in the ignored names, and the
    same option given through cudagraph_mode and --enforce-eager must agree."""
    from hyserve.cli import ConfigError, build_parser, engine_options_from_args

    def options(*argv: str) -> tuple[dict, list[str]]:
        engine, _, ignored = engine_options_from_args(build_parser().parse_args(["serve", "m", *argv]))
        return engine, ignored

    assert options("-O0")[0]["cuda_graph_config"] == {"enabled": False}
    engine, ignored = options("--compilation-config", '{"cudagraph_mode": "FULL_DECODE_ONLY", "level": 3}')
    assert engine["cuda_graph_config"] == {"enabled": True, "piecewise": False}
    assert ignored == ["compilation_config.level"]
    with pytest.raises(ConfigError, match="set the same option"):
        options("--enforce-eager", "--compilation-config", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}')
