"""Model families: architecture name -> (config parser, model class, weight loader).

The engine asks the registry for a checkpoint directory's family and builds through it, so a new hybrid
family is its own folder under `model/` plus one entry in the list here (docs/architecture.md, "Adding a
model family").

A family can also come from another installed package, as vLLM's model plugins do: each entry point of the
`hyserve.model_families` group names a family entry (a `Family`, or a callable returning one), registered at
the registry's first lookup in every process (the server's and the engine's). A plugin that fails to load is
logged and named in the "not supported" error; it never stops the built-in families from serving.
"""

from __future__ import annotations

import logging
from importlib import metadata
from pathlib import Path

from hyserve.model.bamba.family import BAMBA
from hyserve.model.config import read_config_json
from hyserve.model.falcon_h1.family import FALCON_H1
from hyserve.model.family import ModelFamily
from hyserve.model.granitemoehybrid.family import GRANITE_MOE_HYBRID
from hyserve.model.nemotron_h.family import NEMOTRON_H
from hyserve.model.protocol import ModelSpec

_FAMILIES: list[ModelFamily] = [NEMOTRON_H, BAMBA, GRANITE_MOE_HYBRID, FALCON_H1]
PLUGIN_GROUP = "hyserve.model_families"
_plugins: dict[str, str] | None = None  # entry point -> "" when registered, else why it failed

logger = logging.getLogger(__name__)


def register(family: ModelFamily) -> None:
    """Add a family (its model types and architecture names must be new)."""
    for f in _FAMILIES:
        clash = set(f.model_types) & set(family.model_types) or set(f.architectures) & set(
            family.architectures
        )
        if clash:
            raise ValueError(f"model family {family.name!r}: {sorted(clash)} already belong to {f.name!r}")
    _FAMILIES.append(family)


def load_plugins() -> dict[str, str]:
    """Register the families of the `hyserve.model_families` entry points (once per process). Returns each
    entry point's outcome: "" when registered, else what went wrong."""
    global _plugins
    if _plugins is not None:
        return _plugins
    _plugins = {}
    for ep in metadata.entry_points(group=PLUGIN_GROUP):
        what = f"{ep.name} = {ep.value}"
        try:
            entry = ep.load()
            family = entry() if callable(entry) else entry  # a family entry is a frozen dataclass
            if not all(hasattr(family, a) for a in ("name", "model_types", "architectures", "parse_config")):
                raise TypeError(f"{type(family).__name__} is not a model family entry (model/family.py)")
            register(family)
            _plugins[what] = ""
        except Exception as e:  # a broken plugin must not stop the built-in families
            _plugins[what] = f"{type(e).__name__}: {e}"
            logger.warning("hyserve: model family plugin %s did not load: %s", what, _plugins[what])
    return _plugins


def supported() -> str:
    failed = "; ".join(f"{k} ({v})" for k, v in load_plugins().items() if v)
    listed = ", ".join(f"{f.name} ({'/'.join(f.architectures)})" for f in _FAMILIES)
    return listed + (f"; plugins that failed to load: {failed}" if failed else "")


def family_for(raw: dict[str, object]) -> ModelFamily:
    """The family of a config.json dict: by model_type, else by architectures; a config that names
    neither is taken as the first family (older NemotronH exports omit both)."""
    load_plugins()
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
