"""Shared test set-up: one CPU thread (2-core CI machines run fast and steadily that way), GPU marker."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
