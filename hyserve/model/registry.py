"""Model families: architecture name -> (config parser, model class, weight loader).

The engine asks the registry for a checkpoint directory's family and builds through it, so a new hybrid
family is its own folder under `model/` plus one entry in the list here (docs/architecture.md, "Adding a
model family").
"""

from __future__ import annotations

from pathlib import Path

from hyserve.model.bamba.family import BAMBA
from hyserve.model.config import read_config_json
from hyserve.model.falcon_h1.family import FALCON_H1
from hyserve.model.family import ModelFamily
from hyserve.model.granitemoehybrid.family import GRANITE_MOE_HYBRID
from hyserve.model.nemotron_h.family import NEMOTRON_H
from hyserve.model.protocol import ModelSpec

_FAMILIES: list[ModelFamily] = [NEMOTRON_H, BAMBA, GRANITE_MOE_HYBRID, FALCON_H1]


def register(family: ModelFamily) -> None:
    """Add a family (its model types and architecture names must be new)."""
    for f in _FAMILIES:
        clash = set(f.model_types) & set(family.model_types) or set(f.architectures) & set(
            family.architectures
        )
        if clash:
            raise ValueError(f"model family {family.name!r}: {sorted(clash)} already belong to {f.name!r}")
    _FAMILIES.append(family)


def supported() -> str:
    return ", ".join(f"{f.name} ({'/'.join(f.architectures)})" for f in _FAMILIES)


def family_for(raw: dict[str, object]) -> ModelFamily:
    """The family of a config.json dict: by model_type, else by architectures; a config that names
    neither is taken as the first family (older NemotronH exports omit both)."""
    model_type = raw.get("model_type")
    listed = raw.get("architectures")
    archs = listed if isinstance(listed, list) else []
    for f in _FAMILIES:
        if model_type in f.model_types:
            return f
    if model_type is None:
        for f in _FAMILIES:
            if any(a in f.architectures for a in archs if isinstance(a, str)):
                return f
        if not archs:
            return _FAMILIES[0]
    what = f"model_type {model_type!r}" if model_type is not None else f"architectures {archs!r}"
    raise ValueError(f"{what} is not supported; hyserve serves: {supported()}")


def read_config(path: str | Path) -> tuple[ModelFamily, ModelSpec]:
    """Read a checkpoint directory's (or a config.json path's) family and parsed config."""
    raw, name = read_config_json(path)
    fam = family_for(raw)
    return fam, fam.parse_config(raw, name)
