"""Where the tests find model configs inside the repository: the tiny test configs in `tests/configs/`, the
real architectures' config.json files in `benchmarks/configs/`. Nothing outside the checkout is read."""

from __future__ import annotations

import json
from pathlib import Path

TINY_DIR = Path(__file__).resolve().parent / "configs"
REAL_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "configs"
TINY = ("tiny-nemotron-h-dense", "tiny-nemotron-3-moe", "tiny-nemotron-3-latent-moe")


def _names(d: Path, nemotron_h: bool = True) -> list[str]:
    """The config dirs under d of NemotronH models (nemotron_h=True) or of the other families."""
    return sorted(
        p.name
        for p in d.iterdir()
        if (p / "config.json").is_file()
        and (json.loads((p / "config.json").read_text()).get("model_type") == "nemotron_h") == nemotron_h
    )


ALL = sorted(_names(TINY_DIR) + _names(REAL_DIR))  # the NemotronH configs
OTHER_FAMILIES = _names(REAL_DIR, nemotron_h=False)  # published configs of the other hybrid families


def config_dir(name: str) -> Path:
    """The directory holding `name`'s config.json (tiny ones in tests/configs, real ones in
    benchmarks/configs)."""
    for d in (TINY_DIR, REAL_DIR):
        if (d / name / "config.json").is_file():
            return d / name
    raise FileNotFoundError(f"no config.json for {name!r} in {TINY_DIR} or {REAL_DIR}")
