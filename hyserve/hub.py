"""A model named by a Hugging Face Hub id (`nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16`), resolved to a local
snapshot directory before it loads.

    MODEL ──► an existing directory? ──yes──► load it as it is (a local directory always wins)
                     │ no
                     ▼
              a valid Hub id? ──no──► ValueError: neither a directory nor a Hub id
                     │ yes
                     ▼
              huggingface_hub.snapshot_download(the files serving needs, revision, cache)
                  HF_HUB_OFFLINE: from the cache only; HF_TOKEN: private and gated repos

Only the files serving reads are fetched (weights, their index, the configs, the tokenizer and chat
template), into the Hub cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`) or `download_dir`; an interrupted
download resumes where it stopped, with a progress bar per file. Failures are `ValueError`s that name the id
and what to do.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hyserve import envs
from hyserve.config import EngineConfig

logger = logging.getLogger("hyserve.hub")

# What serving reads from a checkpoint; everything else in a repository (PyTorch .bin copies, GGUF files,
# images, ONNX exports) stays on the Hub.
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
CONFIG_PATTERNS = (
    "config.json",
    "generation_config.json",
    "hf_quant_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*.jinja",
)
# The Hub's rule for a repository id: `name` or `namespace/name`, each of letters, digits, '-', '_', '.',
# not starting or ending with '-' or '.', without '--' or '..', 96 characters at most.
HUB_ID_MAX_CHARS = 96
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"^(?:{_PART}/)?{_PART}$")


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are (`path`) and the name it is served under by default: a directory's own
    name, or the Hub id it came from (`hub_id`)."""

    path: Path
    name: str
    hub_id: str | None = None


def is_hub_id(model: str) -> bool:
    """Whether `model` is written as a Hub repository id (it may still not exist there)."""
    return (
        len(model) <= HUB_ID_MAX_CHARS
        and "--" not in model
        and ".." not in model
        and _HUB_ID.match(model) is not None
    )


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~", "\\")) or model in (".", "..")


def hub_cache_dir(download_dir: str | None) -> Path:
    """Where Hub snapshots are kept: `download_dir` (vLLM's --download-dir), else the Hub's own cache."""
    return Path(download_dir).expanduser() if download_dir else envs.HF_HUB_CACHE


def resolve_model(
    model: str,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    weights: bool = True,
    log: Callable[[str], None] | None = None,
) -> ModelSource:
    """The local directory of `model`: itself when it exists, else its Hub snapshot, downloaded (only the
    files serving needs; without `weights`, no weights: random ones will be used) or found in the cache.

    Raises ValueError naming the model and what to do when it is neither a directory nor a Hub id, or the
    Hub cannot give it."""
    local = Path(model).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ValueError(f"model: {model!r} is a file; give the checkpoint's directory")
        return ModelSource(path=local, name=local.name)
    if _looks_like_path(model) or not is_hub_id(model):
        raise ValueError(
            f"model: {model!r} is not a local directory, nor a Hugging Face Hub id (`org/name`: letters, "
            f"digits, '-', '_', '.', at most {HUB_ID_MAX_CHARS} characters); give a checkpoint directory or "
            "a Hub id, or omit MODEL for the built-in tiny model"
        )
    path = _snapshot(model, revision, download_dir, weights, log or logger.info)
    return ModelSource(path=path, name=model, hub_id=model)


def _snapshot(
    repo_id: str, revision: str | None, download_dir: str | None, weights: bool, log: Callable[[str], None]
) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a declared dependency
        raise ValueError(
            f"model: {repo_id!r} is a Hugging Face Hub id, and loading one needs huggingface_hub: "
            "pip install huggingface_hub"
        ) from None
    cache = hub_cache_dir(download_dir)
    offline = envs.HF_HUB_OFFLINE
    where = "the Hub cache" if offline else "the Hugging Face Hub"
    log(f"hyserve: model {repo_id!r} (revision {revision or 'main'}): from {where} into {cache}")
    patterns = [*CONFIG_PATTERNS, *(WEIGHT_PATTERNS if weights else ())]
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(cache),
            allow_patterns=patterns,
            local_files_only=offline,
            token=envs.HF_TOKEN,
        )
    except Exception as e:  # noqa: BLE001 - every failure of the Hub becomes one actionable message
        raise ValueError(_hub_error(e, repo_id, revision, cache, offline)) from None
    snapshot = Path(str(path))
    if not (snapshot / "config.json").is_file():
        raise ValueError(
            f"model: the Hub repository {repo_id!r} (revision {revision or 'main'}) has no config.json: it "
            "is not a Hugging Face model checkpoint hyserve can load"
        )
    return snapshot


def _hub_error(e: Exception, repo_id: str, revision: str | None, cache: Path, offline: bool) -> str:
    """One line naming the id and what to do, for a failure of `snapshot_download`."""
    from huggingface_hub import errors

    rev = revision or "main"
    name = type(e).__name__
    if isinstance(e, errors.GatedRepoError):
        return (
            f"model: {repo_id!r} is a gated repository: accept its terms on https://huggingface.co/{repo_id} "
            "and set HF_TOKEN to a token of that account"
        )
    if isinstance(e, errors.RepositoryNotFoundError):
        return (
            f"model: no repository {repo_id!r} on the Hugging Face Hub (or it is private: set HF_TOKEN); "
            "check the id, or give a local checkpoint directory"
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return f"model: {repo_id!r} has no revision {rev!r} on the Hugging Face Hub; check --revision"
    incomplete = getattr(errors, "IncompleteSnapshotError", None)
    if incomplete is not None and isinstance(e, incomplete):
        return (
            f"model: the cached snapshot of {repo_id!r} (revision {rev}) in {cache} misses files (an "
            "interrupted download): run again where the Hub is reachable, without HF_HUB_OFFLINE, and the "
            "download resumes"
        )
    if isinstance(e, errors.LocalEntryNotFoundError | errors.OfflineModeIsEnabled):
        why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face Hub could not be reached"
        return (
            f"model: {repo_id!r} (revision {rev}) is not in the Hub cache at {cache} and {why}: download it "
            f"where the Hub is reachable (`hf download {repo_id}`, with the same HF_HOME or --download-dir), "
            "unset HF_HUB_OFFLINE, or give a local checkpoint directory"
        )
    detail = " ".join(str(e).split())[:300]
    return (
        f"model: downloading {repo_id!r} (revision {rev}) from the Hugging Face Hub failed ({name}: {detail})"
    )


def hub_options(config: EngineConfig) -> dict[str, Any]:
    """The keywords of `resolve_model` an EngineConfig gives."""
    return {
        "revision": config.revision,
        "download_dir": config.download_dir,
        "weights": config.load_format != "dummy",
    }
