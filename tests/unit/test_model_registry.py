"""The model registry: families are found by model_type or architectures, unknown ones are refused with
the supported list, and nothing outside hyserve/model/ names a family's classes (docs/architecture.md)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from hyserve.model import registry
from hyserve.model.config import HybridModelConfig
from hyserve.model.tiny import builtin_model_dir

PKG = Path(__file__).resolve().parents[2] / "hyserve"


def _raw() -> dict:
    return json.loads((builtin_model_dir() / "config.json").read_text())


def test_family_by_model_type_and_by_architectures():
    raw = _raw()
    assert registry.family_for(raw).name == "nemotron_h"
    raw.pop("model_type", None)
    raw["architectures"] = ["NemotronHForCausalLM"]
    assert registry.family_for(raw).name == "nemotron_h"
    raw.pop("architectures")
    assert registry.family_for(raw).name == "nemotron_h"  # older exports name neither


@pytest.mark.parametrize("change", [{"model_type": "llama"}, {"architectures": ["LlamaForCausalLM"]}])
def test_unknown_family_is_refused_with_the_supported_list(change):
    raw = {k: v for k, v in _raw().items() if k not in ("model_type", "architectures")}
    raw.update(change)
    with pytest.raises(
        ValueError, match=r"not supported; hyserve serves: nemotron_h \(NemotronHForCausalLM\)"
    ):
        registry.family_for(raw)


def test_read_config_parses_through_the_family(tmp_path):
    fam, cfg = registry.read_config(builtin_model_dir())
    assert fam.name == "nemotron_h"
    assert cfg == HybridModelConfig.from_hf(builtin_model_dir())
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        registry.read_config(tmp_path)
    with pytest.raises(FileNotFoundError):
        registry.read_config(tmp_path / "missing")


def test_register_refuses_a_clashing_family():
    nem = registry.family_for(_raw())
    clash = registry.ModelFamily(
        name="other",
        model_types=("nemotron_h",),
        architectures=("X",),
        parse_config=nem.parse_config,
        build=nem.build,
        init_random=nem.init_random,
        load_weights=nem.load_weights,
        set_kv_scales=nem.set_kv_scales,
        update_kv_scales=nem.update_kv_scales,
        record_kv_amax=nem.record_kv_amax,
        with_cache_dtypes=nem.with_cache_dtypes,
        with_quant=nem.with_quant,
        weight_bytes=nem.weight_bytes,
        kernel_ops=nem.kernel_ops,
    )
    with pytest.raises(ValueError, match="already belong to 'nemotron_h'"):
        registry.register(clash)


def _names(tree: ast.AST) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            out.update(a.name for a in node.names)
            out.add(node.module or "")
    return out


def test_only_the_model_package_names_the_nemotron_h_family():
    family_names = {"NemotronHForCausalLM", "HybridModelConfig", "hyserve.model.nemotron_h", "Mamba2Mixer"}
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.is_relative_to(PKG / "model"):
            continue
        hit = family_names & _names(ast.parse(path.read_text()))
        if hit:
            offenders.append(f"{path.relative_to(PKG.parent)}: {sorted(hit)}")
    assert not offenders, "outside hyserve/model/: " + "; ".join(offenders)
