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
        ({"kv_cache_config": {"tokens_per_block": 64, "mamba_state_config": {"periodic_snapshot_interval": 100}}},
         "multiple of"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_batch_size": 64, "max_num_tokens": 8}, "max_num_tokens"),
        ({"cuda_graph_config": {"batch_sizes": []}}, "cuda_graph_config.batch_sizes"),
        ({"tp_size": 4}, "tp_size"),
        ({"dtype": "int8"}, "dtype"),
        ({"kv_cache_config": {"mamba_ssm_stochastic_rounding": True}}, "float16"),
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
    cfg = build_engine_config({"cuda_graph_config": {"max_batch_size": 8},
                               "kv_cache_config": {"mamba_ssm_philox_rounds": 5}})
    assert not [k for k in cfg.ignored_keys if k.startswith("cuda_graph_config")]
    assert "kv_cache_config.mamba_ssm_philox_rounds" not in cfg.ignored_keys
    assert build_engine_config({}).ignored_keys == ()
