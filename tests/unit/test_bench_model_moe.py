"""The MoE roofline arithmetic of benchmarks/roofline.py and the model plans of benchmarks/bench_model.py
(docs/architecture.md, MoE), against numbers counted by hand from the shipped Nemotron 3 configs; the
device-drawn dummy init (hyserve/model/weights.py) leaves CPU tensors bit-identical to the host draw."""

from __future__ import annotations

import dataclasses
import gc
import json
from pathlib import Path

import pytest
import torch

from benchmarks import bench_model as bm
from benchmarks.roofline import (
    GIB,
    Ceilings,
    active_decode_step_bytes,
    active_decode_step_ms,
    active_decode_tokens_per_s,
    active_matmul_params,
    active_prefill_tokens_per_s,
    active_weight_bytes,
    batch_experts,
    decode_step_bytes,
    expected_distinct_experts,
    matmul_params,
    prefill_tokens_per_s,
    weight_bytes,
)
from hyserve.model.nemotron_h.checkpoint import random_state_dict
from hyserve.model.nemotron_h.config import HybridModelConfig
from hyserve.model.random_init import init_random_tensors

ROOT = Path(__file__).resolve().parents[2]

CONFIGS = ROOT / "benchmarks" / "configs"
NANO = CONFIGS / "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"
SUPER = CONFIGS / "NVIDIA-Nemotron-3-Super-120B-A12B-BF16"

# ---- Nano 30B-A3B by hand: h 2688, 23 Mamba + 23 MoE + 6 attention layers, vocab 131072 ------------------
# Mamba: 64 heads x 64 = 4096 inner; conv_dim 4096 + 2 x 8 groups x 128 = 6144; in_proj 4096 + 6144 + 64
MAMBA = (
    2688 * 10304 + 6144 * 4 + 6144 + 3 * 64 + 4096 + 4096 * 2688 + 2688
)  # in, conv w+b, dt/A/D, norm, out, prenorm
ATTN = 2688 * 4096 * 2 + 2688 * 256 * 2 + 2688  # q + o (32 x 128), k + v (2 x 128), prenorm
EXPERT = 2 * 2688 * 1856  # up [1856, 2688] + down [2688, 1856]
ROUTER = 128 * 2688 + 128  # weight + score-correction bias (float32)
MOE_UNROUTED = ROUTER + 2 * 2688 * 3712 + 2688  # router, shared expert (3712), prenorm
LM_HEAD = 131072 * 2688 + 2688  # lm_head + norm_f (the embedding is a gather, not read whole)
NANO_ALL = 23 * MAMBA + 6 * ATTN + 23 * (MOE_UNROUTED + 128 * EXPERT) + LM_HEAD
NANO_ACTIVE = 23 * MAMBA + 6 * ATTN + 23 * (MOE_UNROUTED + 6 * EXPERT) + LM_HEAD
STATE = 23 * (6144 * 3 * 2 + 64 * 64 * 128 * 4)  # bf16 conv window (kernel - 1 = 3) + float32 SSM state
KV = 6 * 2 * 2 * 128 * 2  # 6 layers x (K, V) x 2 heads x 128 x bf16


def cfg_of(d: Path) -> HybridModelConfig:
    return HybridModelConfig.from_hf(d)


def test_expected_distinct_experts() -> None:
    assert expected_distinct_experts(128, 6, 0) == 0.0
    assert expected_distinct_experts(128, 6, 1) == pytest.approx(6.0)
    assert expected_distinct_experts(128, 6, 64) == pytest.approx(128 * (1 - (122 / 128) ** 64))
    assert expected_distinct_experts(128, 6, 64) == pytest.approx(122.07, abs=0.01)  # "the ~121 experts"
    assert expected_distinct_experts(128, 6, 256) == pytest.approx(128 - 128 * (122 / 128) ** 256)
    assert 127.99 < expected_distinct_experts(128, 6, 256) < 128
    assert expected_distinct_experts(512, 22, 64) == pytest.approx(512 * (1 - (490 / 512) ** 64))
    assert expected_distinct_experts(8, 8, 3) == 8.0  # every token reads every expert
    with pytest.raises(ValueError, match=r"top_k must be in \[1, n_experts=8\], got 9"):
        expected_distinct_experts(8, 9, 1)
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        expected_distinct_experts(8, 2, -1)


def test_nano_30b_active_parameters_and_rooflines() -> None:
    cfg = cfg_of(NANO)
    assert matmul_params(cfg) == NANO_ALL == 31_225_618_752
    assert active_matmul_params(cfg) == NANO_ACTIVE == 3_227_754_816  # "3.23 B active"
    assert active_matmul_params(cfg, 128) == NANO_ALL
    # the float32 router at 4 bytes, the rest in bf16
    assert active_weight_bytes(cfg) == 2 * NANO_ACTIVE + 2 * 23 * ROUTER == 6_471_342_464
    assert cfg.state_bytes_per_sequence == STATE and cfg.kv_bytes_per_token == KV
    bw, flops = 4.27e12, 794e12
    assert active_decode_tokens_per_s(cfg, bw) == pytest.approx(bw / 6_471_342_464)
    assert active_decode_tokens_per_s(cfg, bw) == pytest.approx(659.8, abs=0.1)  # "~661 tok/s"
    assert active_prefill_tokens_per_s(cfg, flops) == pytest.approx(flops / (2 * NANO_ACTIVE))  # ~123k tok/s
    assert batch_experts(cfg, 1) == pytest.approx(6.0)
    for batch, context in ((1, 544), (64, 136), (256, 46)):
        experts = 128 * (1 - (122 / 128) ** batch)
        weights = 2 * (NANO_ACTIVE + 23 * (experts - 6) * EXPERT) + 2 * 23 * ROUTER
        want = weights + batch * (2 * STATE + context * KV)
        assert active_decode_step_bytes(cfg, batch, context) == pytest.approx(want, rel=1e-12)
        assert active_decode_step_ms(cfg, batch, context, bw) == pytest.approx(want / bw * 1e3, rel=1e-12)
    assert active_decode_step_ms(cfg, 64, 136, bw) == pytest.approx(15.48, abs=0.01)  # "~15 ms"
    assert active_decode_step_ms(cfg, 256, 46, bw) == pytest.approx(20.53, abs=0.01)  # "~20 ms"
    with pytest.raises(ValueError, match=r"experts_per_layer must be in \[0, 128\], got 129"):
        active_matmul_params(cfg, 129)


def test_super_latent_experts_and_cut() -> None:
    raw = json.loads((SUPER / "config.json").read_text())
    cfg = HybridModelConfig.from_dict(raw)
    latent_expert = 2 * 1024 * 2688  # routed experts work in the 1024 latent, not h 4096
    assert active_matmul_params(cfg) == matmul_params(cfg) - 40 * (512 - 22) * latent_expert
    assert batch_experts(cfg, 64) == pytest.approx(512 * (1 - (490 / 512) ** 64))
    # whole repetitions of MEMEMEM*E | MEMEMEM*E | MEMEMEM*E | MEMEMEMEM*E | ...
    assert bm.repetition_cuts(raw["hybrid_override_pattern"]) == [9, 18, 27, 38, 49, 60, 71, 80]
    # per repetition of 4 MoE + 4 Mamba + 1 attention layer ~22.3 GiB; embedding + lm_head 2 GiB
    assert bm.model_weight_bytes(bm.cut_config(raw, 38)) / GIB == pytest.approx(96.71, abs=0.01)
    assert bm.fit_layers(raw, 104 * GIB) == 38  # 0.75 of an H200's 139 GiB
    assert bm.fit_layers(raw, 96 * GIB) == 27
    assert bm.fit_layers(raw, 1e15) == 88
    with pytest.raises(ValueError, match="not even one repetition"):
        bm.fit_layers(raw, 10 * GIB)
    cut = HybridModelConfig.from_dict(bm.cut_config(raw, 38))
    assert cut.num_layers == 38 and cut.layer_types == cfg.layer_types[:38] and cut.moe_latent_size == 1024
    with pytest.raises(ValueError, match=r"--num-layers must be in \[1, 88\]"):
        bm.cut_config(raw, 89)


def test_dense_model_keeps_its_rooflines() -> None:
    """The 9B has no MoE layer: the active-parameter functions give the dense ones exactly."""
    cfg = cfg_of(CONFIGS / "NVIDIA-Nemotron-Nano-9B-v2")
    assert active_matmul_params(cfg) == matmul_params(cfg) and active_weight_bytes(cfg) == weight_bytes(cfg)
    assert active_decode_step_bytes(cfg, 64, 136) == decode_step_bytes(cfg, 64, 136)
    assert active_prefill_tokens_per_s(cfg, 1e15) == prefill_tokens_per_s(cfg, 1e15)
    assert batch_experts(cfg, 64) == 0.0


def test_plans(tmp_path: Path) -> None:
    nine = bm.make_plan(
        bm.CFG_DIR, num_layers=None, weight_budget=104 * GIB, work=tmp_path, skip_transformers=False
    )
    assert (nine.slug, nine.batches, nine.prefill_8k, nine.prefix_cache, nine.transformers) == (
        "",
        (64,),
        True,
        True,
        True,
    )
    assert nine.label == "NVIDIA-Nemotron-Nano-9B-v2 architecture, random weights, bf16"
    nano = bm.make_plan(
        NANO, num_layers=None, weight_budget=104 * GIB, work=tmp_path, skip_transformers=False
    )
    assert (nano.batches, nano.prefill_8k, nano.transformers, nano.model_dir) == (
        (64, 256),
        True,
        False,
        NANO,
    )
    sup = bm.make_plan(SUPER, num_layers=None, weight_budget=104 * GIB, work=tmp_path, skip_transformers=True)
    assert (
        sup.slug == "NVIDIA-Nemotron-3-Super-120B-A12B-BF16-38L"
        and sup.batches == (64,)
        and not sup.prefill_8k
    )
    assert HybridModelConfig.from_hf(sup.model_dir).num_layers == 38 and "first 38 of 88 layers" in sup.label
    few = bm.make_plan(SUPER, num_layers=5, weight_budget=None, work=tmp_path, skip_transformers=True)
    assert few.raw["hybrid_override_pattern"] == "MEMEM" and few.raw["num_hidden_layers"] == 5
    for batch, prompt in bm.STEP_SHAPES.items():  # one prefill step fills every row
        assert batch * prompt <= nano.max_num_tokens


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["latent-moe", "dense"])
def test_bench_hyserve_runs_a_plan_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str
) -> None:
    """The benchmark's engine loop end to end on a tiny model (CPU, no graphs): a MoE plan gives the 9B's
    record names plus batch 256, start-up and init timings, each MoE figure against its active roofline."""
    from hyserve.model.tiny import tiny_config

    (tmp_path / "config.json").write_text(json.dumps(tiny_config(variant)))
    monkeypatch.setattr(bm, "sync", lambda: None)
    plan = bm.make_plan(tmp_path, num_layers=None, weight_budget=None, work=tmp_path, skip_transformers=True)
    plan = dataclasses.replace(plan, device="cpu")
    cfg = HybridModelConfig.from_dict(plan.raw)
    c = Ceilings(
        device="gpu",
        stream_read_bw=4.0e12,
        copy_bw=4.2e12,
        gemv_bw=4.1e12,
        gemv_best="g",
        matmul_flops=800e12,
        matmul_best="m",
    )
    records: list = []
    notes: list = []
    try:
        bm.bench_hyserve(plan, cfg, c, records, notes, time_init=variant != "dense")
    finally:
        # the benchmark freezes the start-up heap as `hyserve serve` does; not the test process's
        gc.unfreeze()
    names = [r["name"] for r in records]
    # the start-up heap left the collector's reach before anything was timed, as in `hyserve serve`
    assert any(n.endswith("as `hyserve serve` does") and int(n.split()[0]) > 0 for n in notes), notes
    # how the step() calls' times spread, per batch (a slow first or last step shows up here)
    spread = [n for n in notes if n.startswith("decode steps at batch ")]
    assert [n.split(":")[0] for n in spread] == [f"decode steps at batch {b}" for b in plan.batches], notes
    assert all("median" in n and "slowest #" in n and "first" in n for n in spread)
    nine = [
        "hyserve decode batch 1 (tok/s)",
        "hyserve prefill 8k tokens (tok/s)",
        "hyserve decode step batch 64 (ms)",
    ]
    by = {r["name"]: r for r in records}
    if variant == "dense":  # a dense model: the 9B's figures and rooflines
        assert names == nine
        assert by[nine[0]]["reference_value"] == pytest.approx(c.read_bw / weight_bytes(cfg))
        return
    assert names == [
        "hyserve start-up with dummy weights, to ready (s)",
        *nine,
        "hyserve decode step batch 256 (ms)",
        "dummy-weight init, drawn on the host (dummy_init: host) (s)",
        "dummy-weight init, drawn on the device (s)",
    ]
    assert by[nine[0]]["reference_value"] == pytest.approx(active_decode_tokens_per_s(cfg, c.read_bw))
    assert by[nine[1]]["reference_value"] == pytest.approx(active_prefill_tokens_per_s(cfg, c.matmul_flops))
    for b in (64, 256):
        r = by[f"hyserve decode step batch {b} (ms)"]
        assert r["reference_value"] == pytest.approx(
            active_decode_step_ms(cfg, b, bm.STEP_SHAPES[b] + 16, c.read_bw)
        )
        assert r["ratio"] == pytest.approx(r["reference_value"] / r["value"]) and "steps of" in r["note"]


def test_on_device_init_leaves_cpu_tensors_bit_identical() -> None:
    cfg = HybridModelConfig.from_dict(json.loads(json.dumps(_tiny_latent())))
    want = random_state_dict(cfg, seed=4, dtype=torch.float32)
    got = {n: torch.empty_like(t) for n, t in want.items()}
    init_random_tensors(got, cfg, seed=4, on_device=True)
    for n in want:
        assert torch.equal(got[n], want[n]), n


@pytest.mark.gpu
def test_on_device_init_on_cuda_is_deterministic_and_dtype_independent() -> None:
    cfg = HybridModelConfig.from_dict(_tiny_latent())
    host = random_state_dict(cfg, seed=0, dtype=torch.float32)
    a = {n: torch.empty_like(t, device="cuda") for n, t in host.items()}
    b = {
        n: torch.empty_like(t, device="cuda", dtype=torch.bfloat16 if t.dtype == torch.float32 else t.dtype)
        for n, t in host.items()
    }
    init_random_tensors(a, cfg, seed=0, on_device=True)
    init_random_tensors(b, cfg, seed=0, on_device=True)
    again = {n: torch.empty_like(t) for n, t in a.items()}
    init_random_tensors(again, cfg, seed=0, on_device=True)
    w = "backbone.embeddings.weight"
    assert not torch.equal(a[w].cpu(), host[w])  # the device's generator: other values
    assert abs(a[w].std().item() - 0.02) < 0.002
    for n in a:
        assert torch.equal(a[n], again[n]), n
        assert torch.equal(b[n], a[n].to(b[n].dtype)), n
        if not n.endswith(("weight", "proj", "bias")) or n.endswith("norm.weight"):
            assert torch.equal(a[n].cpu(), host[n]), n  # ones, A_log, dt_bias: computed on the host


def _tiny_latent() -> dict:
    from hyserve.model.tiny import tiny_config

    return tiny_config("latent-moe")


def test_fp8_run_ratios_and_greedy_agreement_on_cpu(tmp_path: Path) -> None:
    """bench_model --quantization fp8's pieces: each FP8 record beside its ratio to the bf16 twin (rates
    fp8/bf16, times bf16/fp8), and the greedy comparison of the two engines, here on the tiny model."""
    from hyserve.model.quant_config import QuantConfig
    from hyserve.model.tiny import make_tiny

    bf16 = [bm.rec("decode (tok/s)", 100.0, "tok/s", "r", 1.0), bm.rec("step (ms)", 10.0, "ms", "r", 1.0)]
    fp8 = [bm.rec("decode (tok/s)", 150.0, "tok/s", "r", 1.0), bm.rec("step (ms)", 8.0, "ms", "r", 1.0)]
    out = bm.fp8_ratios(bf16, fp8)
    assert [r["name"] for r in out] == [
        "[fp8] decode (tok/s)",
        "[fp8] decode (tok/s): FP8 vs bf16, same run (x)",
        "[fp8] step (ms)",
        "[fp8] step (ms): FP8 vs bf16, same run (x)",
    ]
    assert out[1]["value"] == pytest.approx(1.5) and out[3]["value"] == pytest.approx(1.25)
    d = make_tiny(tmp_path / "tiny")
    plan = bm.ModelPlan(
        model_dir=d,
        raw={},
        label="tiny",
        slug="tiny",
        prefill_8k=False,
        batches=(64,),
        prefix_cache=False,
        transformers=False,
        device="cpu",
    )
    cfg = HybridModelConfig.from_hf(d)
    records: list = []
    bm.greedy_agreement(plan, cfg, records)
    assert records[0]["unit"] == "fraction" and 0.0 < records[0]["value"] <= 1.0
    assert records[1]["value"] >= 0.0
    # the FP8 rooflines count 1 byte a projection weight: a little over half the bf16 bytes here
    assert (
        0.5
        < weight_bytes(cfg.with_quant(QuantConfig(method="online", scheme="channel"))) / weight_bytes(cfg)
        < 0.8
    )


def test_fp8_active_bytes_are_the_fp8_model_less_the_idle_experts() -> None:
    from hyserve.model.quant_config import QuantConfig

    cfg = HybridModelConfig.from_hf(ROOT / "benchmarks/configs/NVIDIA-Nemotron-3-Super-120B-A12B-BF16")
    fp8 = cfg.with_quant(QuantConfig(method="online", scheme="channel"))
    # every expert active: all of the FP8 model's matmul weights
    assert active_weight_bytes(fp8, cfg.n_routed_experts) == weight_bytes(fp8)
    assert 0.45 < active_weight_bytes(fp8) / active_weight_bytes(cfg) < 0.6
    # the whole FP8 Super (embedding included: 113.9 GiB) fits one H200 (133.9 GiB) with ~20 GiB for its cache
    # and activations; bf16 (224.9 GiB) does not
    from hyserve.model.nemotron_h.checkpoint import weight_bytes as model_bytes

    h200 = 143_771_533_312
    assert model_bytes(cfg) > h200 and h200 - model_bytes(fp8) > 19 * 2**30


def test_the_old_gemv_settings_stand_in_takes_what_gpu_settings_takes():
    """`gemv_settings_ab` swaps `gpu_settings` for the pre-fdb35a5 rules; the GEMV launcher calls it with the
    device name too (a stand-in of three arguments crashed the 30B-A3B run at 4d73ebc)."""
    import inspect

    import hyserve.kernels.triton_fused_linear as tfl

    now = inspect.signature(tfl.gpu_settings).parameters
    old = inspect.signature(bm._gemv_settings_before_fdb35a5).parameters
    assert list(old) == list(now)
    assert bm._gemv_settings_before_fdb35a5(0, 2688, 4608, "NVIDIA H200") == tfl._GPU_SHORT_K[0]
