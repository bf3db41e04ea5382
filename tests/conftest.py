"""Shared test set-up: the tiers (the hook below), one CPU thread (2-core CI machines run fast and steadily
that way), the GPU marker, a per-module torch seed (`TORCH_SEED = n` in a test module seeds torch before each
of its tests), and the `poison` fixture of the kernel tests.

Tiers, one folder each under tests/: unit/ (bookkeeping, config, parsers, reference and interpreted kernels,
lint and layering), engine/ (tests that build a model or an engine), server/ (the HTTP app and short server
processes), e2e/ (long end-to-end runs, all `slow`), gpu/ (CUDA only). `pytest -m "not slow"` is the quick
run; plain `pytest` runs everything."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


TESTS_DIR = Path(__file__).resolve().parent
TIERS = ("unit", "engine", "server", "e2e", "gpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test gets its tier's marker (the folder under tests/ it lives in); everything under tests/e2e/
    is also `slow` and everything under tests/gpu/ `gpu`. Without CUDA the `gpu` tests are skipped."""
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        parts = Path(str(item.path)).resolve().relative_to(TESTS_DIR).parts
        tier = parts[0] if len(parts) > 1 and parts[0] in TIERS else None
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "e2e":
            item.add_marker(pytest.mark.slow)
        if tier == "gpu":
            item.add_marker(pytest.mark.gpu)
        if skip is not None and "gpu" in item.keywords:
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
