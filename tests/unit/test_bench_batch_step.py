"""bench_batch_step's CPU-side parts: kernel grouping, the step's byte count, a child's arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_batch_step as b
from hyserve.model.nemotron_h.config import HybridModelConfig

CFG = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"


@pytest.mark.parametrize(
    "kernel, group",
    [
        ("_up_gemm_kernel", "moe"),
        ("_down_gemm_kernel", "moe"),
        ("_align_scatter_kernel", "moe"),
        ("_ssm_update_kernel", "state update"),
        ("_conv1d_update_kernel", "conv1d"),
        ("_decode_kernel", "other"),
        ("_add_rms_norm_kernel", "norms"),
        ("nvjet_sm90_tst_96x64_64x10_2x4_h_bz_TNN", "dense GEMM / GEMV"),
    ],
)
def test_kernels_are_grouped_by_what_they_do(kernel, group):
    assert b.group_of(kernel) == group


def test_a_step_moves_every_expert_at_batch_1024_and_the_state_twice():
    cfg = HybridModelConfig.from_dict(json.loads((CFG / "config.json").read_text()))
    small, big = b.step_bytes(cfg, 1, 1000, 6144, 47 << 20), b.step_bytes(cfg, 1024, 1000, 6144, 47 << 20)
    assert big["weights"] > 5 * small["weights"]  # 6 experts a layer at batch 1, nearly all 128 at 1,024
    assert big["state"] == 2 * 1024 * (47 << 20) and big["kv"] == 1024 * 1000 * 6144


def test_a_child_gets_the_arguments_but_its_own_pair_and_result_dir():
    argv = ["--weights", "fp8,bf16", "--batches", "1024", "--states=float32", "--result-dir", "X"]
    argv += ["--top", "3"]
    assert [x for i, x in enumerate(argv) if not b._is_choice(argv, i)] == ["--batches", "1024", "--top", "3"]
