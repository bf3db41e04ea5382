"""The SiLU-gated experts op's reference (`kernels/moe_silu.py`) against a per-token float64 loop and against
transformers' Granite MoE block, and its input checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hyserve.kernels.moe_silu import moe_experts_silu_ref
from hyserve.model.softmax_moe import SoftmaxTopkMoE


def _inputs(T: int, E: int, d: int, inter: int, k: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, d, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * inter, d, generator=g) * d**-0.5).to(dtype)
    down = (torch.randn(E, d, inter, generator=g) * inter**-0.5).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, generator=g), -1)
    return x, gate_up, down, w, ids


def _per_token(x, gate_up, down, w, ids) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            gate, up = (gate_up[e].double() @ x[t].double()).chunk(2)
            out[t] += float(w[t, s]) * (down[e].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_experts_match_a_per_token_float64_loop(dtype: torch.dtype, tol: float) -> None:
    x, gate_up, down, w, ids = _inputs(9, 6, 32, 16, 3, dtype)
    out = moe_experts_silu_ref(x, gate_up, down, w, ids)
    assert out.dtype == dtype and out.shape == x.shape
    want = _per_token(x, gate_up, down, w, ids)
    assert (out.double() - want).abs().max() <= tol * want.abs().max()


def test_the_moe_layer_matches_transformers_block() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GraniteMoeHybridConfig(
        hidden_size=32,
        intermediate_size=16,
        num_local_experts=6,
        num_experts_per_tok=3,
        num_attention_heads=4,
        mamba_n_heads=8,
    )
    torch.manual_seed(3)
    hf = transformers.models.granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridMoE(cfg).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    ours = SoftmaxTopkMoE(32, 6, 3, 16, dtype=torch.float32)
    with torch.no_grad():
        ours.router.layer.weight.copy_(hf.router.weight)
        ours.input_linear.weight.copy_(hf.experts.gate_up_proj)
        ours.output_linear.weight.copy_(hf.experts.down_proj)
    x = torch.randn(11, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x[None])[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "bad, what",
    [("odd", "up_proj must be"), ("down", "down_proj"), ("ids", "topk ids"), ("dtype", "dtypes differ")],
)
def test_experts_reject_bad_inputs(bad: str, what: str) -> None:
    x, gate_up, down, w, ids = _inputs(3, 4, 32, 16, 2, torch.float32)
    if bad == "odd":
        gate_up = gate_up[:, :-1]
    elif bad == "down":
        down = down[:, :, :-1]
    elif bad == "ids":
        ids = ids[:2]
    elif bad == "dtype":
        down = down.half()
    with pytest.raises(ValueError, match=what):
        moe_experts_silu_ref(x, gate_up, down, w, ids)
