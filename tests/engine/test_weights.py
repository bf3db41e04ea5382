"""Checkpoint loading/saving and random init (hyserve.model.weights)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hyserve.model import random_init
from hyserve.model.nemotron_h.checkpoint import (
    NAMES,
    canonical_name,
    canonical_shapes,
    keeps_fp32,
    random_state_dict,
)
from hyserve.model.nemotron_h.config import HybridModelConfig
from hyserve.model.random_init import init_random_tensors, init_random_weights
from hyserve.model.tiny import tiny_config
from hyserve.model.weights import StateDictModule, load_checkpoint, save_checkpoint
from tests.shipped_configs import ALL, TINY, config_dir

torch.set_num_threads(1)


def cfg_of(name: str) -> HybridModelConfig:
    return HybridModelConfig.from_hf(config_dir(name))


def tiny_cfg(variant: str) -> HybridModelConfig:
    """The make-tiny configs (embedded in the package, so these tests need no shared/ directory)."""
    return HybridModelConfig.from_dict(tiny_config(variant))


def empty_module(
    cfg: HybridModelConfig, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> StateDictModule:
    """Stand-in with canonical names, filled with a sentinel so unloaded tensors are visible."""
    tensors = {
        n: torch.full(s, -7.0, dtype=torch.float32 if keeps_fp32(n) else dtype, device=device)
        for n, s in canonical_shapes(cfg).items()
    }
    return StateDictModule(tensors)


def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in module.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """transformers' own NemotronH saved with save_pretrained (what it writes is what the Hub has)."""
    transformers = pytest.importorskip("transformers")
    out = {}
    for name in TINY:
        hf_cfg = transformers.NemotronHConfig.from_pretrained(config_dir(name))
        torch.manual_seed(0)
        model = transformers.NemotronHForCausalLM(hf_cfg).eval()
        with torch.no_grad():  # transformers inits the router bias to zeros; make it visible in comparisons
            for n, p in model.named_buffers():
                if n.endswith("e_score_correction_bias"):
                    p.normal_()
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d)
        ref = {("backbone." + k[len("model.") :] if k.startswith("model.") else k): v.detach().clone()
               for k, v in model.state_dict().items()}  # fmt: skip
        out[name] = (d, ref)
    return out


# ---- names and shapes --------------------------------------------------------------------------------------
def test_canonical_name_mapping():
    assert canonical_name("model.layers.3.mixer.in_proj.weight") == (
        "backbone.layers.3.mixer.in_proj.weight",
        None,
    )
    assert canonical_name("backbone.norm_f.weight") == ("backbone.norm_f.weight", None)
    assert canonical_name("lm_head.weight") == ("lm_head.weight", None)
    assert canonical_name("backbone.layers.1.mixer.experts.17.down_proj.weight") == (
        "backbone.layers.1.mixer.experts.down_proj",
        17,
    )
    assert canonical_name("model.layers.1.mixer.experts.up_proj") == (
        "backbone.layers.1.mixer.experts.up_proj",
        None,
    )
    assert canonical_name("mtp.layers.0.mixer.q_proj.weight") is None
    assert canonical_name("model.mtp.layers.0.norm.weight") is None


@pytest.mark.parametrize("name", ALL)
def test_canonical_shapes_match_transformers(name):
    """Our name/shape table equals transformers' module tree for every shipped architecture (meta device)."""
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.NemotronHConfig.from_pretrained(config_dir(name))
    with torch.device("meta"):
        model = transformers.NemotronHForCausalLM(hf_cfg)
    hf = {
        ("backbone." + k[len("model.") :] if k.startswith("model.") else k): tuple(v.shape)
        for k, v in model.state_dict().items()
    }
    ours = canonical_shapes(cfg_of(name))
    assert ours == hf
    assert sum(math.prod(s) for s in ours.values()) == cfg_of(name).num_parameters()


def test_shapes_match_hyserve_model_if_present():
    nemotron_h = pytest.importorskip("hyserve.model.nemotron_h.model")
    for variant in ("dense", "moe", "latent-moe"):
        cfg = tiny_cfg(variant)
        with torch.device("meta"):
            model = nemotron_h.NemotronHForCausalLM(cfg)
        got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        assert got == canonical_shapes(cfg), variant


# ---- loading transformers checkpoints ----------------------------------------------------------------------
@pytest.mark.parametrize("name", TINY)
def test_load_transformers_checkpoint(hf_checkpoints, name):
    ckpt, ref = hf_checkpoints[name]
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert all(k.startswith(("backbone.", "lm_head.")) for k in keys)  # what transformers 5 writes
    if "moe" in name:
        assert any(".experts.0.up_proj.weight" in k for k in keys)  # per-expert on disk
    module = empty_module(cfg_of(name))
    load_checkpoint(module, ckpt, names=NAMES)
    assert_same(state(module), ref)


def test_load_casts_but_keeps_router_fp32(hf_checkpoints):
    ckpt, ref = hf_checkpoints["tiny-nemotron-3-moe"]
    module = empty_module(cfg_of("tiny-nemotron-3-moe"), dtype=torch.bfloat16)
    load_checkpoint(module, ckpt, names=NAMES)
    got = state(module)
    gate = "backbone.layers.1.mixer.gate.weight"
    bias = "backbone.layers.1.mixer.gate.e_score_correction_bias"
    assert got[gate].dtype == torch.float32 and torch.equal(got[gate], ref[gate])
    assert got[bias].dtype == torch.float32 and torch.equal(got[bias], ref[bias])
    emb = "backbone.embeddings.weight"
    assert got[emb].dtype == torch.bfloat16 and torch.equal(got[emb], ref[emb].to(torch.bfloat16))


def test_transformers_loads_what_we_save(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = tiny_cfg("latent-moe")
    sd = random_state_dict(cfg, seed=3, dtype=torch.float32)
    for per_expert in (True, False):
        d = tmp_path / f"pe{per_expert}"
        save_checkpoint(StateDictModule(sd), d, per_expert=per_expert, names=NAMES)
        (d / "config.json").write_text(json.dumps(tiny_config("latent-moe")))
        model, info = transformers.NemotronHForCausalLM.from_pretrained(d, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
        got = {("backbone." + k[len("model.") :] if k.startswith("model.") else k): v
               for k, v in model.state_dict().items()}  # fmt: skip
        assert_same({k: v.float() for k, v in got.items()}, sd)


# ---- save / load round trips -------------------------------------------------------------------------------
def test_round_trip_single_file_per_expert_and_stacked(tmp_path):
    cfg = tiny_cfg("moe")
    sd = random_state_dict(cfg, seed=1, dtype=torch.float32)
    for per_expert in (True, False):
        d = tmp_path / str(per_expert)
        save_checkpoint(StateDictModule(sd), d, per_expert=per_expert, names=NAMES)
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
            assert f.metadata() == {"format": "pt"}
        stacked = "backbone.layers.1.mixer.experts.up_proj"
        per = "backbone.layers.1.mixer.experts.3.up_proj.weight"
        assert (per in keys, stacked in keys) == (per_expert, not per_expert)
        module = empty_module(cfg)
        load_checkpoint(module, d, names=NAMES)
        assert_same(state(module), sd)


def test_round_trip_sharded(tmp_path):
    cfg = tiny_cfg("latent-moe")
    sd = random_state_dict(cfg, seed=2, dtype=torch.float32)
    save_checkpoint(StateDictModule(sd), tmp_path, max_shard_bytes=40_000, names=NAMES)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted({*index["weight_map"].values()})
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (tmp_path / "model.safetensors").exists()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    module = empty_module(cfg)
    load_checkpoint(module, tmp_path, names=NAMES)
    assert_same(state(module), sd)
    # re-saving as one file removes the shards so the loader cannot pick up a stale layout
    save_checkpoint(StateDictModule(sd), tmp_path, names=NAMES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_model_prefix_mtp_and_tied_lm_head(tmp_path):
    cfg = tiny_cfg("dense")
    sd = random_state_dict(cfg, seed=4, dtype=torch.float32)
    ondisk = {
        ("model." + k[len("backbone.") :] if k.startswith("backbone.") else k): v for k, v in sd.items()
    }
    ondisk["mtp.layers.0.mixer.q_proj.weight"] = torch.zeros(4, 4)
    save_file(ondisk, str(tmp_path / "model.safetensors"))
    module = empty_module(cfg)
    load_checkpoint(module, tmp_path, names=NAMES)
    assert_same(state(module), sd)
    # a tied model (no lm_head parameter) ignores the checkpoint's lm_head
    tied = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    module = StateDictModule({k: torch.zeros_like(v) for k, v in tied.items()})
    load_checkpoint(module, tmp_path, names=NAMES)
    assert_same(state(module), tied)


def test_load_into_meta_module(tmp_path):
    cfg = tiny_cfg("moe")
    sd = random_state_dict(cfg, seed=5, dtype=torch.float32)
    save_checkpoint(StateDictModule(sd), tmp_path, names=NAMES)
    module = empty_module(cfg, device="meta")
    with pytest.raises(ValueError, match="meta device"):
        load_checkpoint(module, tmp_path, names=NAMES)
    load_checkpoint(module, tmp_path, device="cpu", dtype=torch.bfloat16, names=NAMES)
    got = state(module)
    assert got["backbone.layers.1.mixer.gate.weight"].dtype == torch.float32
    assert torch.equal(got["backbone.layers.1.mixer.gate.weight"], sd["backbone.layers.1.mixer.gate.weight"])
    assert got["backbone.embeddings.weight"].dtype == torch.bfloat16
    assert torch.equal(got["lm_head.weight"], sd["lm_head.weight"].to(torch.bfloat16))


# ---- errors ------------------------------------------------------------------------------------------------
def _write(d: Path, tensors: dict[str, torch.Tensor]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.clone().contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
    return d


def _load_error(module: torch.nn.Module, d: Path) -> str:
    before = {k: v.clone() for k, v in state(module).items()}
    with pytest.raises(ValueError) as e:
        load_checkpoint(module, d, names=NAMES)
    assert_same(state(module), before)  # nothing touched on failure
    return str(e.value)


@pytest.fixture()
def moe_sd() -> tuple[HybridModelConfig, dict[str, torch.Tensor]]:
    cfg = tiny_cfg("moe")
    return cfg, random_state_dict(cfg, seed=6, dtype=torch.float32)


def test_error_missing_and_unexpected(tmp_path, moe_sd):
    cfg, sd = moe_sd
    sd = dict(sd)
    del sd["backbone.norm_f.weight"]
    sd["backbone.layers.0.mixer.bogus.weight"] = torch.zeros(2)
    msg = _load_error(empty_module(cfg), _write(tmp_path, sd))
    assert "missing tensors (1)" in msg and "backbone.norm_f.weight" in msg
    assert "unexpected tensors (1)" in msg and "backbone.layers.0.mixer.bogus.weight" in msg


def test_error_lists_at_most_ten(tmp_path, moe_sd):
    cfg, sd = moe_sd
    extra = {f"backbone.extra.{i}": torch.zeros(1) for i in range(25)}
    msg = _load_error(empty_module(cfg), _write(tmp_path, {**sd, **extra}))
    assert "unexpected tensors (25)" in msg and "... and 15 more" in msg
    assert sum(f"backbone.extra.{i}\n" in msg + "\n" for i in range(25)) == 10


def test_error_shape_mismatch(tmp_path, moe_sd):
    cfg, sd = moe_sd
    sd = {**sd, "backbone.layers.0.mixer.in_proj.weight": torch.zeros(5, 64)}
    sd["backbone.layers.1.mixer.experts.up_proj"] = torch.zeros(4, 32, 63)
    msg = _load_error(empty_module(cfg), _write(tmp_path, sd))
    assert "shape mismatches" in msg
    assert f"backbone.layers.0.mixer.in_proj.weight: expected [{cfg.in_proj_size}, 64], got [5, 64]" in msg
    assert "backbone.layers.1.mixer.experts.up_proj: expected [4, 32, 64], got [4, 32, 63]" in msg


def test_error_missing_expert_indices(tmp_path, moe_sd):
    cfg, sd = moe_sd
    d = tmp_path / "ck"
    save_checkpoint(StateDictModule(sd), d, names=NAMES)  # per-expert layout
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        kept = {
            k: f.get_tensor(k) for k in f.keys() if not k.startswith("backbone.layers.3.mixer.experts.1.")
        }
    kept = {k: v for k, v in kept.items() if k != "backbone.layers.3.mixer.experts.2.up_proj.weight"}
    kept["backbone.layers.1.mixer.experts.9.up_proj.weight"] = torch.zeros(32, 64)  # out of range
    msg = _load_error(empty_module(cfg), _write(tmp_path / "bad", kept))
    assert "missing expert indices (2)" in msg
    assert "backbone.layers.3.mixer.experts.up_proj: [1-2] of 4" in msg
    assert "backbone.layers.3.mixer.experts.down_proj: [1] of 4" in msg
    assert "backbone.layers.1.mixer.experts.9.up_proj.weight" in msg  # unexpected


def test_error_duplicates(tmp_path, moe_sd):
    cfg, sd = moe_sd
    d = tmp_path / "dup"
    both = {**sd, "model.norm_f.weight": sd["backbone.norm_f.weight"]}
    both["backbone.layers.1.mixer.experts.0.up_proj.weight"] = sd["backbone.layers.1.mixer.experts.up_proj"][
        0
    ]
    msg = _load_error(empty_module(cfg), _write(d, both))
    assert "tensors given more than once (2)" in msg


def test_error_index_points_at_missing_shard(tmp_path, moe_sd):
    cfg, sd = moe_sd
    save_checkpoint(StateDictModule(sd), tmp_path, max_shard_bytes=60_000, names=NAMES)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    shards[1].unlink()
    msg = _load_error(empty_module(cfg), tmp_path)
    assert "points at 1 shard file(s) that do not exist" in msg and shards[1].name in msg


def test_error_index_entry_absent_from_shard(tmp_path, moe_sd):
    cfg, sd = moe_sd
    save_checkpoint(StateDictModule(sd), tmp_path, max_shard_bytes=60_000, names=NAMES)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    home = index["weight_map"]["backbone.norm_f.weight"]
    other = next(s for s in sorted({*index["weight_map"].values()}) if s != home)
    index["weight_map"]["backbone.norm_f.weight"] = other
    index_path.write_text(json.dumps(index))
    msg = _load_error(empty_module(cfg), tmp_path)
    assert f"backbone.norm_f.weight (shard {other})" in msg


def test_error_no_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("dense")))
    cfg = HybridModelConfig.from_hf(tmp_path)
    with pytest.raises(ValueError) as e:
        load_checkpoint(empty_module(cfg), tmp_path, names=NAMES)
    assert "only config.json" in str(e.value) and 'load_format="dummy"' in str(e.value)
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(empty_module(cfg), tmp_path / "nope", names=NAMES)


# ---- random init -------------------------------------------------------------------------------------------
def test_init_deterministic_and_dtype_independent():
    cfg = tiny_cfg("latent-moe")
    a = random_state_dict(cfg, seed=0, dtype=torch.float32)
    b = random_state_dict(cfg, seed=0, dtype=torch.float32)
    c = random_state_dict(cfg, seed=1, dtype=torch.float32)
    h = random_state_dict(cfg, seed=0, dtype=torch.bfloat16)
    assert_same(a, b)
    assert not torch.equal(a["backbone.embeddings.weight"], c["backbone.embeddings.weight"])
    for k in a:
        assert torch.equal(h[k], a[k].to(h[k].dtype)), k
    # init through a module equals the dict path (same names -> same values)
    module = empty_module(cfg)
    init_random_weights(module, cfg, seed=0)
    assert_same(state(module), a)


def test_init_independent_of_workers_and_order(monkeypatch):
    cfg = tiny_cfg("dense")
    monkeypatch.setattr(random_init, "_CHUNK_ELEMS", 1000)  # many chunks per tensor
    shapes = canonical_shapes(cfg)
    one = {n: torch.empty(s) for n, s in shapes.items()}
    init_random_tensors(one, cfg, seed=9, max_workers=1)
    rev = {n: torch.empty(s) for n, s in reversed(shapes.items())}
    init_random_tensors(rev, cfg, seed=9, max_workers=3)
    assert_same(one, rev)


def test_init_statistics():
    cfg = tiny_cfg("moe")
    sd = random_state_dict(cfg, seed=0, dtype=torch.float32)
    L = cfg.num_layers
    assert abs(sd["backbone.embeddings.weight"].std().item() - 0.02) < 0.002
    assert abs(sd["backbone.layers.2.mixer.q_proj.weight"].std().item() - 0.02) < 0.003
    assert abs(sd["backbone.layers.0.mixer.out_proj.weight"].std().item() - 0.02 / math.sqrt(2 * L)) < 0.001
    assert abs(sd["backbone.layers.1.mixer.experts.down_proj"].std().item() - 0.02 / math.sqrt(2 * L)) < 0.001
    conv = sd["backbone.layers.0.mixer.conv1d.weight"]
    assert abs(conv.std().item() - 1 / math.sqrt(cfg.conv_kernel)) < 0.05
    assert torch.all(sd["backbone.layers.0.norm.weight"] == 1) and torch.all(
        sd["backbone.norm_f.weight"] == 1
    )
    assert torch.all(sd["backbone.layers.0.mixer.norm.weight"] == 1)
    assert torch.all(sd["backbone.layers.0.mixer.D"] == 1)
    a = sd["backbone.layers.0.mixer.A_log"].exp()
    assert torch.all((a >= 1) & (a <= 16)) and a.unique().numel() == a.numel()
    dt = torch.nn.functional.softplus(sd["backbone.layers.0.mixer.dt_bias"].double())
    assert torch.all((dt >= cfg.time_step_min * 0.999) & (dt <= 0.1 * 1.001))
    bias = sd["backbone.layers.1.mixer.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.unique().numel() == bias.numel() and bias.abs().max() < 0.1
    assert sd["backbone.layers.1.mixer.gate.weight"].dtype == torch.float32


def test_init_unknown_parameter_and_meta():
    cfg = tiny_cfg("dense")
    module = StateDictModule({"backbone.layers.0.mixer.mystery": torch.zeros(3)})
    with pytest.raises(ValueError, match="no init rule for parameter 'backbone.layers.0.mixer.mystery'"):
        init_random_weights(module, cfg)
    with pytest.raises(ValueError, match="meta device"):
        init_random_weights(empty_module(cfg, device="meta"), cfg)
