"""The model registry: families are found by model_type or architectures, unknown ones are refused with
the supported list, and nothing outside hyserve/model/ names a family's classes (docs/architecture.md)."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from hyserve.model import registry
from hyserve.model.nemotron_h.config import HybridModelConfig
from hyserve.model.nemotron_h.family import NEMOTRON_H
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
    nem = NEMOTRON_H
    clash = dataclasses.replace(nem, name="other", architectures=("X",))
    with pytest.raises(ValueError, match="already belong to 'nemotron_h'"):
        registry.register(clash)


def test_family_entries_name_no_any():
    """The registry's types say what each family gives: no `Any` in the family modules' annotations."""
    for path in [PKG / "model" / "registry.py", PKG / "model" / "family.py"]:
        tree = ast.parse(path.read_text())
        hits = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "Any"]
        assert not hits, f"{path.name}: Any at lines {hits}"


def test_family_checks_its_config_and_model():
    fam, cfg = registry.read_config(builtin_model_dir())

    class Other:
        pass

    with pytest.raises(TypeError, match="is not its config"):
        fam.build(Other(), torch.float32)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="is not its model"):
        fam.finish_load(Other())  # type: ignore[arg-type]
    assert fam.weight_bytes(cfg, torch.float32) > 0


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


def test_plugins_that_fail_to_load_are_named_and_the_built_in_families_still_serve(tmp_path, monkeypatch):
    """Entry points of the `hyserve.model_families` group: one naming a missing module, one naming
    something that is not a family entry. Both are reported (also in the "not supported" error); NemotronH
    still reads."""
    dist = tmp_path / "broken_plugins-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugins\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{registry.PLUGIN_GROUP}]\nmissing = no_such_module_here:FAMILY\nnot_a_family = json:JSONDecoder\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_plugins", None)
    monkeypatch.setattr(registry, "_FAMILIES", list(registry._FAMILIES))
    got = registry.load_plugins()
    assert got["missing = no_such_module_here:FAMILY"].startswith("ModuleNotFoundError")
    assert got["not_a_family = json:JSONDecoder"].startswith("TypeError: JSONDecoder is not a model family")
    assert registry.load_plugins() is got  # once per process
    assert registry.family_for(_raw()).name == "nemotron_h"
    with pytest.raises(
        ValueError, match=r"plugins that failed to load: missing = no_such_module_here:FAMILY"
    ):
        registry.family_for({"model_type": "llama"})
