"""Parameter lists split between the quick run (`pytest -m "not slow"`) and the full one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest


def quick_first(values: Sequence[Any], n: int = 1) -> list[Any]:
    """`values` for parametrize with the first n in the quick run and the rest marked slow (test ids do not
    change: the marked ones keep their positional ids)."""
    return [*values[:n], *(pytest.param(v, marks=pytest.mark.slow) for v in values[n:])]
