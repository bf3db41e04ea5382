"""The kernel registry (`hyserve/kernels/ops.py`): one typed `Op` per op, no silent fallback to the torch
reference on CUDA, and a start-up check that names an op the model uses without a CUDA implementation."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from hyserve.config import build_engine_config
from hyserve.engine.runner import model_loader
from hyserve.kernels import ops
from hyserve.model import registry
from hyserve.model.tiny import builtin_model_dir, make_tiny
from tests.model_harness import Harness


def _double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


def test_every_op_is_in_the_registry_once_under_its_own_name() -> None:
    found = {k: v for k, v in vars(ops).items() if isinstance(v, ops.Op)}
    assert all(op.name == attr for attr, op in found.items())
    assert sorted(found) == sorted(op.name for op in ops.ALL_OPS)
    assert len(set(ops.ALL_OPS)) == len(ops.ALL_OPS)


def test_an_op_without_a_cuda_implementation_raises_on_cuda_naming_it() -> None:
    fake = ops.Op("fake_op", _double)
    assert fake.get(on_cuda=False) is _double  # the reference is the CPU path
    with pytest.raises(ops.MissingCudaKernelError, match="'fake_op' has no CUDA implementation"):
        fake.get(on_cuda=True)
    bound = ops.Op("bound_op", _double)
    bound.bind_cuda(torch.neg)
    assert bound.get(on_cuda=True) is torch.neg
    with pytest.raises(ops.MissingCudaKernelError, match=r"op\(s\) fake_op:"):
        ops.require_cuda([bound, fake])
    ops.require_cuda([bound])


def _bind_references(monkeypatch: pytest.MonkeyPatch) -> None:
    """`load_cuda_kernels` as on a CUDA machine, with each op's reference standing in for its kernel."""

    def load() -> list[str]:
        for op in ops.ALL_OPS:
            monkeypatch.setattr(op, "cuda", op.ref)
        return [op.name for op in ops.ALL_OPS]

    monkeypatch.setattr(ops, "load_cuda_kernels", load)


def test_cuda_start_up_fails_naming_an_op_the_model_uses_without_a_cuda_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _bind_references(monkeypatch)
    family, _ = registry.read_config(builtin_model_dir())
    names = model_loader.check_cuda_kernels(family)
    assert set(names) == {op.name for op in (*family.kernel_ops, *model_loader.ENGINE_OPS)}
    fake = ops.Op("fake_scan", _double)  # a model that calls an op no kernel file implements for CUDA
    with_fake = dataclasses.replace(family, kernel_ops=(*family.kernel_ops, fake))
    with pytest.raises(ops.MissingCudaKernelError, match="fake_scan") as err:
        model_loader.check_cuda_kernels(with_fake)
    assert "rms_norm" not in str(err.value)


def test_reference_on_cuda_restores_the_kernels() -> None:
    before = [(op, op.cuda) for op in ops.ALL_OPS]
    with ops.reference_on_cuda(ops.ssd):
        assert ops.ssd.get(on_cuda=True) is ops.ssd.ref
    assert [(op, op.cuda) for op in ops.ALL_OPS] == before


def test_the_family_declares_every_op_its_forwards_look_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny dense and MoE models, 16-bit and FP8, prefill and decode on the CPU: every op looked up is in
    the family's `kernel_ops` (so the start-up check covers it), and every declared op is looked up."""
    looked_up: set[str] = set()
    real_get = ops.Op.get

    def recording_get(self: ops.Op[..., Any], on_cuda: bool) -> Any:
        looked_up.add(self.name)
        return real_get(self, on_cuda)

    monkeypatch.setattr(ops.Op, "get", recording_get)
    for variant in ("dense", "moe"):
        d = make_tiny(tmp_path / variant, variant=variant, seed=3)
        for quant in (None, "fp8"):
            opts = {"model": str(d), "device": "cpu", "dtype": "bfloat16", "quantization": quant}
            lm = model_loader.load_model(build_engine_config({k: v for k, v in opts.items() if v}))
            h = Harness(lm.model, max_seqs=2, max_len=64)
            h.step([(0, list(range(4, 24)))])
            h.step([(0, [7])])
    declared = {op.name for op in registry.read_config(builtin_model_dir())[0].kernel_ops}
    assert looked_up <= declared, looked_up - declared
    assert declared <= looked_up, declared - looked_up
