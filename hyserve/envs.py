"""Every environment variable hyserve reads, in one typed place, read once at import.

No other module calls `os.environ`; they import the values from here.
"""

from __future__ import annotations

import os
from pathlib import Path


def _path(name: str, default: Path) -> Path:
    v = os.environ.get(name)
    return Path(v).expanduser() if v else default


def _default_cache_root() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "hyserve"


# Root for hyserve's persistent files (today: the built-in tiny model).
HYSERVE_CACHE_DIR: Path = _path("HYSERVE_CACHE_DIR", _default_cache_root())


def _int_or_none(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r}: expected an integer") from None


def _positive_float(name: str, default: float) -> float:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        f = float(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r}: expected a number of seconds") from None
    if not 0.0 < f < float("inf"):
        raise ValueError(f"environment variable {name}={v!r}: must be positive and finite")
    return f


# The rank layout torchrun gives each process (None when not launched by torchrun); read by
# hyserve.distributed, which then joins the process group through torchrun's store ("env://").
RANK: int | None = _int_or_none("RANK")
WORLD_SIZE: int | None = _int_or_none("WORLD_SIZE")
LOCAL_RANK: int | None = _int_or_none("LOCAL_RANK")
LOCAL_WORLD_SIZE: int | None = _int_or_none("LOCAL_WORLD_SIZE")
# Seconds a collective may wait for the other ranks before it raises (a lost rank is an error, not a hang).
HYSERVE_DIST_TIMEOUT_S: float = _positive_float("HYSERVE_DIST_TIMEOUT_S", 60.0)
# Deterministic fault injection (tests, soak runs; off when unset): comma-separated "site:substring[@n]",
# site one of forward, sample, host, engine; the named requests fail there (hyserve/engine/faults.py).
HYSERVE_FAULT_INJECT: str = os.environ.get("HYSERVE_FAULT_INJECT", "").strip()


def _flag(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    word = (v or "").strip().lower()
    if not word:
        return default
    if word in ("1", "true", "on", "yes"):
        return True
    if word in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"environment variable {name}={v!r}: expected 1 or 0 (on / off)")


# Programmatic dependent launch of the decode-path Triton kernels on Hopper and newer GPUs (on by default;
# HYSERVE_PDL=0 launches them the ordinary way, e.g. to rule it out when chasing a wrong result).
HYSERVE_PDL: bool = _flag("HYSERVE_PDL", True)


def _secret(*names: str) -> str | None:
    """The first of `names` that is set and not empty (an empty variable reads as unset)."""
    for name in names:
        v = os.environ.get(name)
        if v:
            return v
    return None


# The API key `hyserve serve` requires when neither --api_key nor the YAML's api_key gives one (vLLM's
# VLLM_API_KEY is read too, after HYSERVE_API_KEY); --no_auth serves without one all the same.
HYSERVE_API_KEY: str | None = _secret("HYSERVE_API_KEY", "VLLM_API_KEY")
# Seconds between the server's stats lines (vLLM's VLLM_LOG_STATS_INTERVAL is read too).
HYSERVE_LOG_STATS_INTERVAL: float = _positive_float(
    "HYSERVE_LOG_STATS_INTERVAL", _positive_float("VLLM_LOG_STATS_INTERVAL", 10.0)
)


def _hf_home() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return _path("HF_HOME", (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface")


# The Hugging Face Hub, as huggingface_hub reads it: models given as Hub ids (`org/name`) are kept in
# HF_HUB_CACHE (default $HF_HOME/hub) unless --download-dir names another place; HF_HUB_OFFLINE=1 takes them
# from that cache only; HF_TOKEN opens private and gated repositories.
HF_HOME: Path = _hf_home()
HF_HUB_CACHE: Path = _path("HF_HUB_CACHE", HF_HOME / "hub")
HF_HUB_OFFLINE: bool = _flag("HF_HUB_OFFLINE", False)
HF_TOKEN: str | None = _secret("HF_TOKEN")
