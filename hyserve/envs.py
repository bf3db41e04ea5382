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
