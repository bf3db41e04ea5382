"""Config pieces every model family shares: layer kinds, dtype names, typed reads of a HF `config.json`
(each error naming its field) and reading the file itself. A family's own config class (e.g.
`model/nemotron_h/config.py`) parses its keys with these."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

LAYER_MAMBA = "mamba"
LAYER_ATTENTION = "attention"
LAYER_MLP = "mlp"
LAYER_MOE = "moe"
LAYER_HYBRID = "hybrid"  # attention and Mamba2 side by side (Falcon-H1): a KV cache and a state slot

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
}


def parse_dtype(
    name: str | torch.dtype, *, field: str, allowed: tuple[str, ...] | None = None
) -> torch.dtype:
    """Map a dtype name to torch; `field` names the config knob in the error."""
    if isinstance(name, torch.dtype):
        name = dtype_name(name)
    key = str(name).lower().removeprefix("torch.")
    if key not in DTYPES or (allowed is not None and key not in allowed):
        options = allowed if allowed is not None else tuple(sorted(set(DTYPES)))
        raise ValueError(f"{field}: unsupported dtype {name!r}; allowed: {', '.join(options)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def limit_float(v: Any) -> float:
    """One bound of `time_step_limit`: a number, or transformers 5.x's JSON spelling of a non-finite one,
    `{"__float__": "Infinity"}` (JSON has no inf), or the string itself."""
    if isinstance(v, dict) and set(v) == {"__float__"}:
        v = v["__float__"]
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise ValueError(f"time_step_limit: expected a number, got {v!r}")
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"time_step_limit: expected a number, got {v!r}") from None


def number(key: str, v: Any, kind: type) -> Any:
    """Field `key`'s value `v` as `kind` (int or float); a bool, a list or a non-numeric string fails."""
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise ValueError(f"{key}: expected a number, got {v!r}")
    try:
        return kind(v)
    except (TypeError, ValueError):
        raise ValueError(
            f"{key}: expected {'an integer' if kind is int else 'a number'}, got {v!r}"
        ) from None


class Fields:
    """Typed reads of a config.json dict, each error naming its field (a null field counts as missing)."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.d = d

    def req(self, key: str, kind: type = int) -> Any:
        """A required number."""
        if key not in self.d or self.d[key] is None:
            raise ValueError(f"config.json: required field {key!r} is missing")
        return number(key, self.d[key], kind)

    def get(self, key: str, default: Any, kind: type | None = None) -> Any:
        """An optional field: `default` when absent, else the value (a number of `kind` when given)."""
        v = self.d.get(key)
        if v is None:
            return default
        return number(key, v, kind) if kind is not None else v


def eos_token_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    """config.json's `eos_token_id` (one id, a list, or absent) as a tuple."""
    eos = raw.get("eos_token_id")
    if isinstance(eos, list):
        return tuple(int(x) for x in eos)
    return () if eos is None else (int(eos),)


def time_step_limit(fields: Fields, key: str = "time_step_limit") -> tuple[float, float]:
    """The Mamba dt clamp [min, max] (absent: no clamp)."""
    limit = fields.get(key, (0.0, float("inf")))
    if not (isinstance(limit, list | tuple) and len(limit) == 2):
        raise ValueError(f"{key}: expected [min, max], got {limit!r}")
    return (limit_float(limit[0]), limit_float(limit[1]))


def checkpoint_dtype(raw: dict[str, Any]) -> torch.dtype:
    """The checkpoint's dtype ("torch_dtype" or "dtype"), bfloat16 when absent."""
    name = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    return parse_dtype(name, field="torch_dtype", allowed=("float32", "bfloat16", "float16"))


def read_config_json(path: str | Path) -> tuple[dict[str, Any], str]:
    """(the config.json object, the checkpoint's name) of a checkpoint directory or a config.json path."""
    p = Path(path)
    cfg_path = p / "config.json" if p.is_dir() else p
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no config.json found at {cfg_path}")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_path}: expected a JSON object, got {type(raw).__name__}")
    return raw, p.name if p.is_dir() else p.parent.name
