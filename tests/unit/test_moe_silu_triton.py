"""The SiLU-gated experts' Triton kernels (`triton_moe.moe_experts_silu_triton`, Granite-4.0-H's MoE on
CUDA) against a per-token float64 loop and the reference (`kernels/moe_silu.py`), in both tile forms; the
Triton interpreter without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import IGNORE_INTERPRETER_WARNING, interpret_without_cuda

interpret_without_cuda()
pytestmark = IGNORE_INTERPRETER_WARNING

import hyserve.kernels.triton_moe as tm  # noqa: E402
from hyserve.kernels.moe import dequantize_experts, quantize_experts_ref  # noqa: E402
from hyserve.kernels.moe_silu import moe_experts_silu_ref  # noqa: E402
from tests.unit.test_moe_silu import _inputs, _per_token  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SILU_CASES = {  # T, E, d, I, k
    "one-token": (1, 6, 32, 16, 3),
    "ragged": (37, 8, 48, 24, 2),
    "all-experts": (9, 4, 32, 16, 4),
}


def _silu_config(swap: int) -> dict:
    cfg = tm._INTERPRETER_GEMM if not torch.cuda.is_available() else tm.heuristic_config(8, 16, 48, 64, 2)
    return dict(cfg, up=dict(cfg["up"], SWAP=swap), down=dict(cfg["down"], SWAP=swap))


@pytest.mark.parametrize("swap", [0, 1])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.float16, 4e-3)])
@pytest.mark.parametrize("case", SILU_CASES)
def test_triton_experts_match_a_per_token_float64_loop(
    poison, case: str, dtype: torch.dtype, tol: float, swap: int
):
    """The grouped GEMMs' gated form (Triton; the interpreter without CUDA), both tile forms, against
    float64, and against the reference in the same dtype. The output is poisoned first: a row the kernels
    never write stays NaN."""
    T, E, d, inter, k = SILU_CASES[case]
    x, gate_up, down, w, ids = (t.to(DEV) for t in _inputs(T, E, d, inter, k, dtype))
    with poison:
        out = tm.moe_experts_silu_triton(x, gate_up, down, w, ids, config=_silu_config(swap))
    assert out.dtype == dtype and out.shape == (T, d) and torch.isfinite(out).all()
    want = _per_token(x.cpu(), gate_up.cpu(), down.cpu(), w.cpu(), ids.cpu())
    err = ((out.cpu().double() - want).norm() / want.norm()).item()
    assert err < tol, f"{case} swap={swap}: relative error {err:.2e}"
    same = moe_experts_silu_ref(x, gate_up, down, w, ids).cpu().double()
    assert ((out.cpu().double() - same).norm() / same.norm()).item() < 3 * tol


def test_triton_experts_default_settings_and_zero_tokens():
    """Without a config: a decode-sized bucket (whose tuned settings are GEMVs) takes GEMM settings; no
    tokens gives an empty output."""
    x, gate_up, down, w, ids = (t.to(DEV) for t in _inputs(1, 6, 32, 16, 3, torch.float32))
    out = tm.moe_experts_silu_triton(x, gate_up, down, w, ids)
    want = _per_token(x.cpu(), gate_up.cpu(), down.cpu(), w.cpu(), ids.cpu())
    assert ((out.cpu().double() - want).norm() / want.norm()).item() < 2e-5
    assert tm.moe_experts_silu_triton(x[:0], gate_up, down, w[:0], ids[:0]).shape == (0, 32)


@pytest.mark.parametrize(
    "bad, what",
    [
        ("odd", "up_proj must be"),
        ("gemv", "grouped GEMMs"),
        ("scales", "must be float8_e4m3fn"),
        ("int", "float32"),
    ],
)
def test_triton_experts_reject_bad_inputs(bad: str, what: str) -> None:
    x, gate_up, down, w, ids = _inputs(3, 4, 32, 16, 2, torch.float32)
    with pytest.raises(ValueError, match=what):
        if bad == "odd":
            tm.moe_experts_silu_triton(x, gate_up[:, :-1], down, w, ids)
        elif bad == "gemv":
            tm.moe_experts_silu_triton(x, gate_up, down, w, ids, config=tm._INTERPRETER_GEMV)
        elif bad == "scales":  # scales beside 32-bit weights
            tm.moe_experts_silu_triton(x, gate_up, down, w, ids, torch.ones(4, 32), torch.ones(4, 32))
        else:
            tm.moe_experts_silu_triton(x.int(), gate_up, down, w, ids)


@pytest.mark.parametrize("swap", [0, 1])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.float16, 4e-3)])
@pytest.mark.parametrize("case", ["one-token", "ragged"])
def test_triton_fp8_experts_match_float64_of_the_dequantised_experts(
    poison, case: str, dtype: torch.dtype, tol: float, swap: int
):
    """e4m3 experts with [E, 2I] / [E, d] channel scales in both tile forms, against float64 of the
    dequantised experts and against the reference in the same dtype."""
    T, E, d, inter, k = SILU_CASES[case]
    x, gate_up, down, w, ids = _inputs(T, E, d, inter, k, torch.float32)
    (qgu, sgu), (qd, sd) = quantize_experts_ref(gate_up), quantize_experts_ref(down)
    dev = [t.to(DEV) for t in (x.to(dtype), qgu, qd, w, ids, sgu, sd)]
    with poison:
        out = tm.moe_experts_silu_triton(*dev[:5], dev[5], dev[6], config=_silu_config(swap))
    assert out.dtype == dtype and torch.isfinite(out).all()
    f64 = torch.float64
    want = _per_token(x.to(dtype), dequantize_experts(qgu, sgu, f64), dequantize_experts(qd, sd, f64), w, ids)
    err = ((out.cpu().double() - want).norm() / want.norm()).item()
    assert err < tol, f"{case} swap={swap}: relative error {err:.2e}"
    same = moe_experts_silu_ref(x.to(dtype), qgu, qd, w, ids, sgu, sd).double()
    assert ((out.cpu().double() - same).norm() / same.norm()).item() < 3 * tol
