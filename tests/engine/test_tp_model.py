"""The NemotronH model under tensor parallelism: the start-up checks of tp_size / ep_size against a model
(hyserve/model/sharding.py), the per-rank cache sizes, and tp 2 over two gloo ranks against tp 1
(docs/architecture.md, "Parallelism")."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hyserve.distributed import parallel_info
from hyserve.model.kv_scales import load_checkpoint_with_kv_scales
from hyserve.model.nemotron_h.checkpoint import NAMES
from hyserve.model.nemotron_h.config import HybridModelConfig
from hyserve.model.nemotron_h.model import NemotronHForCausalLM
from hyserve.model.nemotron_h.sharding import sharding_problems
from hyserve.model.random_init import init_random_weights
from hyserve.model.sharding import check_parallel
from hyserve.model.tiny import tiny_config
from hyserve.model.weights import save_checkpoint
from tests.dist_pool import RankPool
from tests.model_harness import Harness, strong_random_weights
from tests.shipped_configs import config_dir

TINY_DENSE = {
    "layers_block_type": ["linear_attention", "full_attention", "linear_attention", "mlp"],
    "vocab_size": 256,
    "hidden_size": 64,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "n_groups": 2,
    "conv_kernel": 4,
    "chunk_size": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "dtype": "float32",
    "eos_token_id": 2,
}


def _cfg(**changes) -> HybridModelConfig:
    return HybridModelConfig.from_dict({**TINY_DENSE, **changes}, name="tiny")


def _super() -> HybridModelConfig:
    """Nemotron 3 Super's shape (32 query / 2 KV heads, 128 Mamba heads in 8 groups, 512 experts)."""
    return _cfg(
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=2,
        head_dim=128,
        mamba_num_heads=128,
        mamba_head_dim=64,
        ssm_state_size=128,
        n_groups=8,
        layers_block_type=["mamba", "moe", "attention", "mamba"],
        n_routed_experts=512,
        num_experts_per_tok=22,
        moe_intermediate_size=2688,
        moe_shared_expert_intermediate_size=5376,
        moe_latent_size=1024,
    )


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (4, 4), (8, 8), (8, 2), (16, 16)])
def test_super_splits_where_it_should(tp: int, ep: int) -> None:
    assert sharding_problems(_super(), tp_size=tp, ep_size=ep) == []
    check_parallel(_super(), tp_size=tp, ep_size=ep, world_size=tp, device="cpu")


@pytest.mark.parametrize(
    ("cfg", "tp", "ep", "needles"),
    [
        (
            _cfg(),
            16,
            1,
            [
                "num_attention_heads (4) is not divisible by tp_size (16)",
                "mamba_num_heads (8) is not divisible by tp_size (16)",
            ],
        ),
        (
            _cfg(num_attention_heads=9, num_key_value_heads=3),
            2,
            1,
            [
                "num_attention_heads (9) is not divisible by tp_size (2)",
                "num_key_value_heads (3) and tp_size (2) do not fit",
            ],
        ),
        (_cfg(mamba_num_heads=12, n_groups=3), 2, 1, ["n_groups (3) and tp_size (2) do not fit"]),
        (_cfg(intermediate_size=130), 4, 1, ["intermediate_size (130) is not divisible by tp_size (4)"]),
        (
            dataclasses.replace(_super(), n_routed_experts=100),
            8,
            8,
            ["n_routed_experts (100) is not divisible by ep_size (8)"],
        ),
        (
            dataclasses.replace(_super(), moe_intermediate_size=2690),
            8,
            2,
            ["moe_intermediate_size (2690) is not divisible by tp_size / ep_size (4)"],
        ),
        (
            dataclasses.replace(_super(), n_routed_experts=64),
            8,
            8,
            ["n_routed_experts / ep_size (64 / 8) is fewer than num_experts_per_tok (22)"],
        ),
        (
            dataclasses.replace(_super(), moe_shared_expert_intermediate_size=5378),
            4,
            4,
            ["moe_shared_expert_intermediate_size (5378) is not divisible by tp_size (4)"],
        ),
    ],
)
def test_sharding_problems_name_the_numbers(
    cfg: HybridModelConfig, tp: int, ep: int, needles: list[str]
) -> None:
    with pytest.raises(ValueError) as e:
        check_parallel(cfg, tp_size=tp, ep_size=ep, world_size=tp, device="cpu")
    msg = str(e.value)
    assert f"does not split over tp_size {tp} / ep_size {ep}" in msg
    for n in needles:
        assert n in msg, msg


def test_world_problems_come_first() -> None:
    with pytest.raises(ValueError, match=r"tp_size \(2\) must equal the number of ranks \(4"):
        check_parallel(_cfg(), tp_size=2, ep_size=1, world_size=4, device="cpu")
    with pytest.raises(ValueError, match="2 ranks on this host need 2 visible GPUs, but 1 are visible"):
        check_parallel(_cfg(), tp_size=2, ep_size=1, world_size=2, device="cuda", visible_gpus=1)


def test_shipped_configs_at_their_reported_settings() -> None:
    ultra_like = HybridModelConfig.from_hf(config_dir("NVIDIA-Nemotron-3-Super-120B-A12B-BF16"))
    check_parallel(
        ultra_like, tp_size=4, ep_size=4, world_size=4, device="cpu"
    )  # the warm-up report's layout
    nano = HybridModelConfig.from_hf(config_dir("NVIDIA-Nemotron-Nano-9B-v2"))  # 40 heads, 8 KV heads
    check_parallel(nano, tp_size=8, ep_size=1, world_size=8, device="cpu")
    with pytest.raises(ValueError, match=r"num_attention_heads \(40\) is not divisible by tp_size \(16\)"):
        check_parallel(nano, tp_size=16, ep_size=1, world_size=16, device="cpu")


def test_rank_cache_layout_holds_one_ranks_heads() -> None:
    cfg = _super()
    full = cfg.cache_layout()
    for tp in (2, 4, 8, 16):
        r = full.for_rank(tp)
        a, m = r.attention[cfg.attention_layer_ids[0]], r.recurrent[cfg.mamba_layer_ids[0]]
        assert a.num_kv_heads == max(1, 2 // tp)  # 2 KV heads: split at tp 2, replicated beyond
        assert m.num_heads == 128 // tp
        groups = 8 // tp if tp <= 8 else 1
        assert m.conv_dim == (128 // tp) * 64 + 2 * groups * 128
        assert r.state_bytes_per_sequence * tp >= cfg.state_bytes_per_sequence  # replication only adds
    assert full.for_rank(1) is full
    assert full.kv_bytes_per_token == cfg.kv_bytes_per_token
    assert full.state_bytes_per_sequence == cfg.state_bytes_per_sequence
    assert full.for_rank(2).kv_bytes_per_token * 2 == cfg.kv_bytes_per_token


# ---- tp 2 over two gloo ranks against tp 1 ---------------------------------------------------------------
# packed prefill (one prompt split at a chunk boundary), then a step mixing decodes with the prompt's second
# chunk and a new prompt, then decodes: every token's logits are compared
def _steps() -> list[list[tuple[int, list[int]]]]:
    g = torch.Generator().manual_seed(11)

    def toks(n: int) -> list[int]:
        return torch.randint(0, 250, (n,), generator=g).tolist()

    steps = [
        [(0, toks(11)), (1, toks(5)), (2, toks(8))],
        [(0, toks(1)), (1, toks(1)), (2, toks(9)), (3, toks(3))],
    ]
    steps += [[(s, toks(1)) for s in range(4)] for _ in range(3)]
    return steps


def _run(model: NemotronHForCausalLM) -> list[torch.Tensor]:
    h = Harness(model, max_seqs=4, max_len=64, bs=4)
    # this rank's pools (the harness sizes full ones from the config)
    h.cache = model.allocate_cache(num_blocks=4 * h.bps, tokens_per_block=4, num_slots=4 + 8, device="cpu")
    return [h.step(items, all_logits=True) for items in _steps()]


def _case_tp(cfg: HybridModelConfig, ckpt: str | None, seed: int) -> dict:
    torch.manual_seed(0)
    model = NemotronHForCausalLM(cfg)
    if ckpt is None:
        init_random_weights(model, cfg, seed=seed)
        scales = {}
    else:
        scales = load_checkpoint_with_kv_scales(model, Path(ckpt))  # the engine's loader
    info = parallel_info()
    moe = [m.mixer.experts for m in model.backbone.layers if hasattr(m.mixer, "experts")]
    cache = model.allocate_cache(num_blocks=1, tokens_per_block=4, num_slots=1, device="cpu")
    shapes = {
        "k": tuple(next(iter(cache.k.values())).shape),
        "conv": tuple(next(iter(cache.conv.values())).shape),
        "ssm": tuple(next(iter(cache.ssm.values())).shape),
    }
    experts = (moe[0].shard.first_expert, moe[0].shard.num_local) if moe else None
    return {
        "tp": info.tp_size,
        "ep": info.ep_size,
        "logits": _run(model),
        "cache": shapes,
        "experts": experts,
        "kv_scales": scales if ckpt is not None else None,
    }


def _variant(name: str) -> HybridModelConfig:
    if name in ("moe", "latent-moe"):  # 4 experts / 8 experts with a 32-wide latent, top-2, a shared expert
        return HybridModelConfig.from_dict({**tiny_config(name), "dtype": "float32"}, name=name)
    if name == "dense":  # the tiny dense config: 2 KV heads and 2 Mamba groups split over the ranks
        return _cfg()
    # one Mamba group and one KV head (both replicated: the gated norm's group spans the ranks), an odd
    # vocabulary (the lm_head's last block is padded) and every bias on
    return _cfg(
        n_groups=1, num_key_value_heads=1, vocab_size=251, use_bias=True, attention_bias=True, mlp_bias=True
    )


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2, timeout_s=20.0)
    yield p
    p.close()


@pytest.fixture(scope="module")
def ep_pool():
    p = RankPool(2, ep_size=2, timeout_s=20.0)
    yield p
    p.close()


def _check_tp2(cfg: HybridModelConfig, got: list[dict], want: list[torch.Tensor], ep: int) -> None:
    heads_kv, groups = 1, 1  # per rank: 2 KV heads / 2 groups split, or 1 replicated
    for rank, res in enumerate(got):
        assert (res["tp"], res["ep"]) == (2, ep)
        assert res["cache"] == {
            "k": (1, 4, heads_kv, 16),
            "conv": (1, 4 * 16 + 2 * groups * 16, 3),
            "ssm": (1, 4, 16, 16),
        }, res["cache"]
        for step, (a, b) in enumerate(zip(res["logits"], want)):
            assert a.shape == b.shape == (b.shape[0], cfg.vocab_size)
            err = (a - b).abs().max().item()
            assert err <= 1e-4, f"rank {rank} step {step}: max |tp2 - tp1| = {err:.2e}"
            assert torch.equal(a.argmax(-1), b.argmax(-1)), f"rank {rank} step {step}: greedy tokens differ"
            assert b.abs().max() > 1.0  # logits O(1): a 1e-4 tolerance means something
    for a, b in zip(got[0]["logits"], got[1]["logits"]):
        assert torch.equal(a, b)  # both ranks sample from the same logits


KV_SCALES = {"backbone.layers.1.mixer.k_scale": 0.5, "backbone.layers.1.mixer.v_scale": 0.25}


def _reference(cfg: HybridModelConfig, ckpt: Path, *, kv_scales: bool = False) -> list[torch.Tensor]:
    ref_model = NemotronHForCausalLM(cfg)
    strong_random_weights(ref_model, cfg, seed=5)
    save_checkpoint(ref_model, ckpt, names=NAMES)
    if (
        kv_scales
    ):  # an fp8-KV export's per-layer scales beside the weights (loaded through the shards' loaders)
        f = ckpt / "model.safetensors"
        tensors = load_file(str(f)) | {k: torch.tensor(v) for k, v in KV_SCALES.items()}
        save_file(tensors, str(f), metadata={"format": "pt"})
    return _run(ref_model)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["dense", "replicated", "moe", "latent-moe"])
def test_tp2_matches_tp1_from_a_checkpoint(pool: RankPool, tmp_path: Path, variant: str) -> None:
    """tp 2, ep 1: the experts whole on both ranks, their intermediate dimension split; the shared expert
    tensor-parallel."""
    cfg = _variant(variant)
    want = _reference(cfg, tmp_path, kv_scales=variant == "dense")
    got = pool.run(_case_tp, cfg, str(tmp_path), 0)
    _check_tp2(cfg, got, want, ep=1)
    assert all(r["kv_scales"] == ({1: {"k": 0.5, "v": 0.25}} if variant == "dense" else {}) for r in got)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["moe", "latent-moe"])
def test_tp2_ep2_matches_tp1_from_a_checkpoint(ep_pool: RankPool, tmp_path: Path, variant: str) -> None:
    """tp 2, ep 2: each rank holds half the experts, whole."""
    cfg = _variant(variant)
    want = _reference(cfg, tmp_path)
    got = ep_pool.run(_case_tp, cfg, str(tmp_path), 0)
    _check_tp2(cfg, got, want, ep=2)
    assert [r["experts"] for r in got] == [(0, cfg.n_routed_experts // 2), (cfg.n_routed_experts // 2,) * 2]


@pytest.mark.slow
def test_tp2_dummy_weights_are_the_tp1_model(pool: RankPool) -> None:
    """load_format dummy: each rank keeps its rows of the tensors tp 1 draws, so the model is the same."""
    cfg = _variant("dense")
    ref_model = NemotronHForCausalLM(cfg)
    init_random_weights(ref_model, cfg, seed=3)
    want = _run(ref_model)
    for res in pool.run(_case_tp, cfg, None, 3):
        for a, b in zip(res["logits"], want):
            assert (a - b).abs().max().item() <= 1e-5
