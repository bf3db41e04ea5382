"""The ops the model calls. Each name dispatches to the best implementation for the tensors' device:
the plain-torch references here; Triton kernels register themselves in `_CUDA_IMPLS` (see `use_cuda_impl`)
once they exist and pass their tests. One place decides, so the model never special-cases devices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyserve.kernels.activation import relu2_ref
from hyserve.kernels.attention import paged_attention_ref, write_kv_ref
from hyserve.kernels.conv1d import causal_conv1d_update_ref, causal_conv1d_varlen_ref
from hyserve.kernels.fp8_linear import fp8_linear_ref, fp8_relu2_linear_ref
from hyserve.kernels.fused_linear import gated_norm_linear_ref, linear_ref, relu2_linear_ref
from hyserve.kernels.moe import moe_experts_ref, moe_route_ref, router_logits_ref
from hyserve.kernels.rmsnorm import add_rms_norm_ref, rms_norm_ref, rmsnorm_gated_ref
from hyserve.kernels.ssd import ssd_chunked_ref
from hyserve.kernels.ssm_update import selective_state_update_ref
from hyserve.kernels.stochastic_rounding import store_ssm_state_ref
from hyserve.kernels.token_bitmask import apply_token_bitmask_ref

_REF: dict[str, Callable[..., Any]] = {
    "rms_norm": rms_norm_ref,
    "add_rms_norm": add_rms_norm_ref,
    "relu2": relu2_ref,
    "rmsnorm_gated": rmsnorm_gated_ref,
    "linear": linear_ref,
    "gated_norm_linear": gated_norm_linear_ref,
    "relu2_linear": relu2_linear_ref,
    "fp8_linear": fp8_linear_ref,
    "fp8_relu2_linear": fp8_relu2_linear_ref,
    "ssd": ssd_chunked_ref,
    "conv1d_varlen": causal_conv1d_varlen_ref,
    "conv1d_update": causal_conv1d_update_ref,
    "ssm_update": selective_state_update_ref,
    "store_ssm_state": store_ssm_state_ref,
    "write_kv": write_kv_ref,
    "paged_attention": paged_attention_ref,
    "router_logits": router_logits_ref,
    "moe_route": moe_route_ref,
    "moe_experts": moe_experts_ref,
    "apply_token_bitmask": apply_token_bitmask_ref,
}
_CUDA_IMPLS: dict[str, Callable[..., Any]] = {}


def use_cuda_impl(name: str, fn: Callable[..., Any]) -> None:
    """Register a GPU implementation of op `name` (same signature as its reference)."""
    if name not in _REF:
        raise KeyError(f"unknown op {name!r}")
    _CUDA_IMPLS[name] = fn


def get(name: str, on_cuda: bool) -> Callable[..., Any]:
    if on_cuda and name in _CUDA_IMPLS:
        return _CUDA_IMPLS[name]
    return _REF[name]
