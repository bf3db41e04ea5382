"""Every environment variable hyserve reads, in one typed place, read once at import.

No other module calls `os.environ`; they import the values from here.
"""

from __future__ import annotations

import os
from pathlib import Path


def _path(name: str, default: Path) -> Path:
    v = os.environ.get(name)
    return Path(v).expanduser() if v else default


def _bool(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    return v.strip().lower() in ("1", "true", "yes", "on")


def _default_cache_root() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "hyserve"


# Root for hyserve's persistent files: the built-in tiny model, Triton cache, autotune results.
HYSERVE_CACHE_DIR: Path = _path("HYSERVE_CACHE_DIR", _default_cache_root())
# Log level for the `hyserve` logger (DEBUG, INFO, WARNING, ...).
HYSERVE_LOG_LEVEL: str = os.environ.get("HYSERVE_LOG_LEVEL", "INFO").upper()
# Set by users who want Triton kernels run by Triton's interpreter (CPU testing of GPU kernels).
TRITON_INTERPRET: bool = _bool("TRITON_INTERPRET", False)
