"""make-tiny checkpoints and the built-in default model (hyserve.model.tiny)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from hyserve import envs
from hyserve.model import tiny
from hyserve.model.nemotron_h.checkpoint import NAMES, canonical_shapes, random_state_dict
from hyserve.model.nemotron_h.config import HybridModelConfig
from hyserve.model.tokenizer import Tokenizer
from hyserve.model.weights import StateDictModule, load_checkpoint

torch.set_num_threads(1)

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


def digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    return {v: tiny.make_tiny(tmp_path_factory.mktemp(v), variant=v) for v in tiny.TINY_VARIANTS}


@pytest.mark.parametrize("variant", tiny.TINY_VARIANTS)
def test_make_tiny_layout(tiny_dirs, variant):
    d = tiny_dirs[variant]
    assert sorted(p.name for p in d.iterdir()) == FILES
    cfg = HybridModelConfig.from_hf(d)
    tok = Tokenizer.from_dir(d)
    assert cfg.vocab_size == tok.vocab_size == tiny.TINY_VOCAB_SIZE
    assert cfg.chunk_size == 8 and cfg.dtype == torch.float32
    assert tok.has_chat_template and tok.eos_token_ids == (2, tok.token_to_id("<|im_end|>"))
    assert tok.bos_token_id == 1 and tok.pad_token_id == 0
    module = StateDictModule({n: torch.zeros(s) for n, s in canonical_shapes(cfg).items()})
    load_checkpoint(module, d, names=NAMES)  # complete and consistent with the config
    expected = random_state_dict(cfg, seed=0)
    for k, v in module.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_variant_layers(tiny_dirs):
    dense = HybridModelConfig.from_hf(tiny_dirs["dense"])
    assert dense.layer_types == ("mamba", "attention", "mamba", "mlp", "mamba", "attention", "mlp")
    raw = json.loads((tiny_dirs["dense"] / "config.json").read_text())
    assert raw["layers_block_type"][:2] == ["linear_attention", "full_attention"]
    moe = HybridModelConfig.from_hf(tiny_dirs["moe"])
    assert "moe" in moe.layer_types and moe.moe_latent_size is None and moe.n_routed_experts == 4
    latent = HybridModelConfig.from_hf(tiny_dirs["latent-moe"])
    assert latent.moe_latent_size == 32 and latent.n_routed_experts == 8


def test_deterministic(tiny_dirs, tmp_path):
    again = tiny.make_tiny(tmp_path / "again", variant="moe", seed=0)
    assert digests(again) == digests(tiny_dirs["moe"])
    other = digests(tiny.make_tiny(tmp_path / "seed1", variant="moe", seed=1))
    base = digests(tiny_dirs["moe"])
    assert other["model.safetensors"] != base["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in base.items() if k != "model.safetensors"
    }


@pytest.mark.slow  # two interpreter processes
def test_deterministic_across_processes(tiny_dirs, tmp_path):
    """Another interpreter (fresh hash seeds, fresh tokenizers state) writes the same bytes."""
    code = f"from hyserve.model.tiny import make_tiny; make_tiny({str(tmp_path)!r}, variant='dense')"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
    assert digests(tmp_path) == digests(tiny_dirs["dense"])


def test_unknown_variant(tmp_path):
    with pytest.raises(ValueError, match="unknown variant 'huge'.*dense, moe, latent-moe"):
        tiny.make_tiny(tmp_path, variant="huge")


@pytest.mark.parametrize("variant", ["dense", "latent-moe"])
def test_transformers_loads_tiny(tiny_dirs, variant):
    transformers = pytest.importorskip("transformers")
    model, info = transformers.NemotronHForCausalLM.from_pretrained(
        tiny_dirs[variant], output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        logits = model(torch.tensor([[1, 40, 41, 42]])).logits
    assert logits.shape == (1, 4, tiny.TINY_VOCAB_SIZE) and torch.isfinite(logits).all()


def test_builtin_model_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(envs, "HYSERVE_CACHE_DIR", tmp_path / "cache")
    with ThreadPoolExecutor(4) as pool:  # concurrent first uses all get the one complete copy
        dirs = list(pool.map(lambda _: tiny.builtin_model_dir(), range(4)))
    d = tmp_path / "cache" / "models" / "hyserve-tiny-dense-v1"
    assert dirs == [d] * 4
    assert sorted(p.name for p in d.iterdir()) == FILES
    assert [p.name for p in d.parent.iterdir()] == [d.name]  # no temp dirs left behind
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert tiny.builtin_model_dir() == d and (d / "model.safetensors").stat().st_mtime_ns == stamp
    # a damaged copy is rebuilt
    (d / "model.safetensors").unlink()
    assert tiny.builtin_model_dir() == d and (d / "model.safetensors").is_file()
    assert tiny.BUILTIN_MODEL_NAME == "hyserve-tiny"
