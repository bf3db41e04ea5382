"""Engine options: YAML/kwargs validation with key paths and allowed values."""

from __future__ import annotations

import pytest

from hyserve.config import build_engine_config, load_yaml_options

SEED_YAML = """
backend: pytorch
enable_chunked_prefill: true
disable_overlap_scheduler: true
enable_attention_dp: false
max_batch_size: 8
max_num_tokens: 16384
trust_remote_code: true
cuda_graph_config:
  enable_padding: true
  max_batch_size: 8
kv_cache_config:
  dtype: fp8
  free_gpu_memory_fraction: 0.8
  enable_block_reuse: true
  tokens_per_block: 64
  mamba_ssm_cache_dtype: float16
  mamba_ssm_stochastic_rounding: true
  mamba_ssm_philox_rounds: 5
  mamba_state_config:
    periodic_snapshot_interval: 256
    additional_snapshot_offsets_from_end:
      - 0
moe_config:
  backend: TRTLLM
  use_low_precision_moe_combine: true
"""


def test_the_user_report_yaml_parses(tmp_path) -> None:
    p = tmp_path / "extra.yml"
    p.write_text(SEED_YAML)
    cfg = build_engine_config(load_yaml_options(p))
    assert cfg.scheduler.max_batch_size == 8 and cfg.scheduler.max_num_tokens == 16384
    assert cfg.cache.dtype == "fp8" and cfg.cache.mamba_ssm_cache_dtype == "float16"
    assert cfg.cache.mamba_state_config.periodic_snapshot_interval == 256
    assert cfg.cuda_graph.max_batch_size == 8
    assert set(cfg.ignored_keys) >= {"backend", "moe_config", "trust_remote_code"}


@pytest.mark.parametrize(
    "opts, needle",
    [
        ({"max_batch_sizee": 3}, "max_batch_sizee"),
        ({"kv_cache_config": {"tokens_per_blok": 3}}, "kv_cache_config.tokens_per_blok"),
        ({"kv_cache_config": {"dtype": "int4"}}, "kv_cache_config.dtype"),
        ({"kv_cache_config": {"free_gpu_memory_fraction": 1.5}}, "free_gpu_memory_fraction"),
        ({"kv_cache_config": {"mamba_ssm_cache_dtype": "fp8"}}, "mamba_ssm_cache_dtype"),
        (
            {
                "kv_cache_config": {
                    "tokens_per_block": 64,
                    "mamba_state_config": {"periodic_snapshot_interval": 100},
                }
            },
            "multiple of",
        ),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_batch_size": 64, "max_num_tokens": 8}, "max_num_tokens"),
        ({"cuda_graph_config": {"batch_sizes": []}}, "cuda_graph_config.batch_sizes"),
        (
            {"cuda_graph_config": {"piecewise_token_sizes": [0, 64]}},
            "cuda_graph_config.piecewise_token_sizes",
        ),
        ({"cuda_graph_config": {"piecewise": "yes"}}, "cuda_graph_config.piecewise"),
        ({"tp_size": 4, "ep_size": 3}, r"ep_size \(3\) must divide tp_size \(4\)"),
        ({"dtype": "int8"}, "dtype"),
        ({"kv_cache_config": {"mamba_ssm_stochastic_rounding": True}}, "float16"),
        (
            {"kv_cache_config": {"dtype": "fp8", "kv_scales": "dynamic"}},
            r"kv_cache_config\.kv_scales: 'dynamic' is not one of \['auto', 'checkpoint', 'calibrate', "
            r"'unit'\]",
        ),
        (
            {"kv_cache_config": {"kv_scales": "calibrate"}},
            r"kv_cache_config\.kv_scales: 'calibrate' chooses the k_scale / v_scale of an fp8 KV cache, but "
            r"kv_cache_config\.dtype is 'auto'.*set kv_cache_config\.dtype: fp8, or leave kv_scales at "
            r"'auto'",
        ),
        (
            {"kv_cache_config": {"dtype": "bfloat16", "kv_scales": "unit"}},
            "kv_cache_config.dtype is 'bfloat16'",
        ),
        ({"enable_chunked_prefill": "yes"}, "enable_chunked_prefill"),
    ],
)
def test_bad_options_name_the_key(opts: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        build_engine_config(opts)


def test_bad_yaml_file(tmp_path) -> None:
    with pytest.raises(ValueError, match="not found"):
        load_yaml_options(tmp_path / "missing.yml")
    p = tmp_path / "bad.yml"
    p.write_text("a: [1, 2\n")
    with pytest.raises(ValueError, match="YAML"):
        load_yaml_options(p)
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        load_yaml_options(p)


def test_options_without_effect_yet_are_reported() -> None:
    cfg = build_engine_config(
        {"cuda_graph_config": {"max_batch_size": 8}, "kv_cache_config": {"mamba_ssm_philox_rounds": 5}}
    )
    assert not [k for k in cfg.ignored_keys if k.startswith("cuda_graph_config")]
    assert "kv_cache_config.mamba_ssm_philox_rounds" not in cfg.ignored_keys
    assert build_engine_config({}).ignored_keys == ()


# ---- the dataclass fields are the one source of truth ----------------------------------------------------


def test_accepted_keys_come_from_the_fields() -> None:
    from hyserve.config import CacheConfig, CudaGraphConfig, EngineConfig, MambaStateConfig, accepted_keys

    assert accepted_keys(EngineConfig) == {
        "model", "dtype", "device", "load_format", "dummy_init", "quantization", "served_model_name", "seed",
        "max_batch_size", "max_num_tokens", "max_seq_len", "enable_chunked_prefill",
        "max_num_partial_prefills", "long_prefill_token_threshold", "max_step_ms", "scheduling_policy",
        "batch_wait_timeout_iters", "batch_wait_max_tokens_ratio",
        "kv_cache_config", "cuda_graph_config", "tp_size", "ep_size",
        "tensor_parallel_size", "moe_expert_parallel_size", "warmup", "strict_warmup", "cache_dir",
        "async_scheduling", "engine_failure_limit", "engine_failure_window_s",
        "max_num_seqs", "max_num_batched_tokens", "revision", "download_dir", "speculative_config",
    }  # fmt: skip
    assert accepted_keys(CacheConfig) == {
        "tokens_per_block", "enable_block_reuse", "avg_seq_len", "free_gpu_memory_fraction", "max_tokens",
        "max_gpu_total_bytes", "dtype", "mamba_ssm_cache_dtype", "mamba_ssm_stochastic_rounding",
        "mamba_ssm_philox_rounds", "mamba_state_config", "allow_oversized_max_seq_len", "kv_scales",
        "gpu_memory_utilization",
    }  # fmt: skip
    assert accepted_keys(MambaStateConfig) == {
        "periodic_snapshot_interval",
        "additional_snapshot_offsets_from_end",
    }
    assert accepted_keys(CudaGraphConfig) == {
        "enable_padding", "max_batch_size", "batch_sizes", "enabled", "piecewise", "piecewise_token_sizes"
    }  # fmt: skip


def test_defaults_are_the_dataclass_defaults() -> None:
    from hyserve.config import EngineConfig

    assert build_engine_config({}) == EngineConfig()
    assert build_engine_config({"kv_cache_config": None, "cuda_graph_config": None}) == EngineConfig()


def _option_paths(cls, prefix: str = "") -> list[str]:
    """Every leaf option's key path, walking the fields as build_engine_config does."""
    import dataclasses

    out = []
    for f in dataclasses.fields(cls):
        m = f.metadata.get("hyserve")
        if m is None:
            continue
        if hasattr(m, "check"):
            out.append(prefix + f.name)
        elif m.key is None:
            out += _option_paths(m.cls, prefix)
        else:
            out += _option_paths(m.cls, f"{prefix}{m.key}.")
    return out


def _nested(path: str, value) -> dict:
    d: dict = {}
    node = d
    *parents, leaf = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return d


def test_every_option_is_checked_and_named_by_its_path() -> None:
    from hyserve.config import EngineConfig

    paths = _option_paths(EngineConfig)
    assert len(paths) == 54 and "kv_cache_config.mamba_state_config.periodic_snapshot_interval" in paths
    for path in paths:
        with pytest.raises(ValueError, match=path.replace(".", r"\.")):
            build_engine_config(_nested(path, object()))


@pytest.mark.parametrize(
    "opts, needle",
    [
        ({"tp_size": 0}, "tp_size: must be >= 1, got 0"),
        ({"ep_size": -1}, "ep_size: must be >= 1, got -1"),
        # the aliases reach the same fields and check
        (
            {"tensor_parallel_size": 2, "moe_expert_parallel_size": 4},
            r"ep_size \(4\) must divide tp_size \(2\)",
        ),
        ({"cuda_graph_config": 5}, "cuda_graph_config: expected a mapping, got 5"),
        (
            {"kv_cache_config": {"mamba_state_config": []}},
            "kv_cache_config.mamba_state_config: expected a mapping",
        ),
        (
            {"kv_cache_config": {"mamba_state_config": {"interval": 64}}},
            "unknown option 'kv_cache_config.mamba_state_config.interval'",
        ),
        (
            {"kv_cache_config": {"mamba_state_config": {"additional_snapshot_offsets_from_end": [0, -1]}}},
            r"additional_snapshot_offsets_from_end\[\]: must be >= 0",
        ),
        (
            {"kv_cache_config": {"mamba_ssm_philox_rounds": 33}},
            r"must be <= 32, got 33 \(10 is Philox's usual count\)",
        ),
        ({"served_model_name": 3}, "served_model_name: expected a string"),
        ({"ignored_keys": ["x"]}, "unknown option 'ignored_keys'"),  # a field, but not an option
    ],
)
def test_checks_from_field_metadata(opts: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        build_engine_config(opts)


def test_values_are_normalised_as_before(tmp_path) -> None:
    cfg = build_engine_config({
        "model": tmp_path, "dtype": "BFloat16", "cache_dir": tmp_path / "kc",
        "tp_size": 1, "tensor_parallel_size": 7,  # the field's own name wins over its alias
        "kv_cache_config": {"free_gpu_memory_fraction": 1, "enable_partial_reuse": True,
                            "mamba_state_config": {"additional_snapshot_offsets_from_end": [0, 128]}},
        "cuda_graph_config": {"batch_sizes": [8, 1, 8, 2]},
    })  # fmt: skip
    assert cfg.model == str(tmp_path) and cfg.cache_dir == str(tmp_path / "kc") and cfg.dtype == "bfloat16"
    assert cfg.parallel.tp_size == 1
    assert cfg.cache.free_gpu_memory_fraction == 1.0 and isinstance(cfg.cache.free_gpu_memory_fraction, float)
    assert cfg.cache.mamba_state_config.additional_snapshot_offsets_from_end == (0, 128)
    assert cfg.cuda_graph.batch_sizes == (1, 2, 8)
    assert cfg.ignored_keys == ("kv_cache_config.enable_partial_reuse",)


def test_cross_field_checks_live_in_one_place() -> None:
    """The config and the capacity planner raise the same error from the same check."""
    import dataclasses

    from hyserve.cache.capacity import CapacityInputs, plan_capacity

    inp = CapacityInputs(
        budget_bytes=2**30,
        kv_bytes_per_token=8,
        state_bytes_per_slot=100,
        max_batch_size=4,
        max_seq_len=256,
        max_num_tokens=64,
        tokens_per_block=64,
        enable_block_reuse=True,
        periodic_snapshot_interval=256,
        num_snapshot_offsets=1,
        avg_seq_len=None,
        num_pad_slots=0,
    )
    plan_capacity(inp)
    for opts, change in (
        ({"kv_cache_config": {"mamba_state_config": {"periodic_snapshot_interval": 100}}},
         {"periodic_snapshot_interval": 100}),
        ({"max_batch_size": 4, "max_num_tokens": 3}, {"max_num_tokens": 3}),
    ):  # fmt: skip
        with pytest.raises(ValueError) as from_config:
            build_engine_config(opts)
        with pytest.raises(ValueError) as from_planner:
            plan_capacity(dataclasses.replace(inp, **change))
        assert str(from_config.value) == str(from_planner.value)


@pytest.mark.parametrize("source", ["auto", "checkpoint", "calibrate", "unit", "CALIBRATE"])
def test_kv_scales_sources_with_fp8(source: str) -> None:
    cfg = build_engine_config({"kv_cache_config": {"dtype": "fp8", "kv_scales": source}})
    assert cfg.cache.kv_scales == source.lower()


def test_kv_scales_default_is_auto_with_any_kv_dtype() -> None:
    for dtype in ("auto", "bfloat16", "float16", "float32", "fp8"):
        assert build_engine_config({"kv_cache_config": {"dtype": dtype}}).cache.kv_scales == "auto"
    assert (
        build_engine_config({"kv_cache_config": {"dtype": "float16", "kv_scales": "auto"}}).cache.kv_scales
        == "auto"
    )


@pytest.mark.parametrize(
    "value,want",
    [(None, True), ("", True), ("1", True), ("on", True), ("0", False), ("off", False), ("False", False)],
)
def test_env_flags_parse_on_and_off(monkeypatch: pytest.MonkeyPatch, value: str | None, want: bool) -> None:
    from hyserve import envs

    if value is None:
        monkeypatch.delenv("HYSERVE_PDL", raising=False)
    else:
        monkeypatch.setenv("HYSERVE_PDL", value)
    assert envs._flag("HYSERVE_PDL", True) is want


def test_env_flag_with_a_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from hyserve import envs

    monkeypatch.setenv("HYSERVE_PDL", "maybe")
    with pytest.raises(ValueError, match=r"HYSERVE_PDL='maybe': expected 1 or 0"):
        envs._flag("HYSERVE_PDL", True)


def test_engine_start_up_applies_hyserve_pdl(monkeypatch: pytest.MonkeyPatch) -> None:
    """HYSERVE_PDL is applied once, before any kernel runs (the warm-up compiles that form's variants)."""
    from hyserve import LLM, envs
    from hyserve.kernels import launch_util

    was = launch_util.pdl_enabled()
    try:
        monkeypatch.setattr(envs, "HYSERVE_PDL", False)
        LLM(device="cpu", max_seq_len=64, log=lambda s: None)
        assert not launch_util.pdl_enabled()
        monkeypatch.setattr(envs, "HYSERVE_PDL", True)
        LLM(device="cpu", max_seq_len=64, log=lambda s: None)
        assert launch_util.pdl_enabled()
    finally:
        launch_util.set_pdl(was)
