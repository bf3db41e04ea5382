"""Shared test set-up: one CPU thread (2-core CI machines run fast and steadily that way), GPU marker,
a per-module torch seed (`TORCH_SEED = n` in a test module seeds torch before each of its tests), and the
`poison` fixture of the kernel tests."""

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


@pytest.fixture(autouse=True)
def _torch_seed(request: pytest.FixtureRequest) -> None:
    seed = getattr(request.module, "TORCH_SEED", None)
    if seed is not None:
        torch.manual_seed(seed)


@pytest.fixture
def poison(monkeypatch: pytest.MonkeyPatch):
    """While active, every floating torch.empty / empty_like comes back filled with NaN, so a kernel that
    leaves part of its output unwritten fails the comparison."""
    real_empty, real_like = torch.empty, torch.empty_like

    def nan_empty(*a, **k):
        t = real_empty(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def nan_like(*a, **k):
        t = real_like(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    class _Ctx:
        def __enter__(self):
            monkeypatch.setattr(torch, "empty", nan_empty)
            monkeypatch.setattr(torch, "empty_like", nan_like)

        def __exit__(self, *exc):
            monkeypatch.setattr(torch, "empty", real_empty)
            monkeypatch.setattr(torch, "empty_like", real_like)

    return _Ctx()
