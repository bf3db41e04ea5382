"""Registers the Triton kernels as the CUDA implementations of the ops in `ops.py`.

Triton is imported here, lazily, only when CUDA is available: importing `hyserve.kernels` never
imports it, and a CPU-only install never needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hyserve.kernels import ops


def register_triton_kernels() -> list[str]:
    """Make `ops.get(name, on_cuda=True)` return the Triton kernels. Returns the op names registered
    (empty without CUDA). Raises ImportError with an install hint when CUDA is there but triton is not."""
    if not torch.cuda.is_available():
        return []
    try:
        import triton  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "CUDA is available but triton is not installed: pip install triton (it ships with the "
            "CUDA builds of torch)"
        ) from e
    from hyserve.kernels.cuda_attention import paged_attention_cuda
    from hyserve.kernels.triton_activation import relu2_triton
    from hyserve.kernels.triton_attention import write_kv_triton
    from hyserve.kernels.triton_conv1d import causal_conv1d_update_triton, causal_conv1d_varlen_triton
    from hyserve.kernels.triton_fp8_linear import fp8_linear_triton, fp8_relu2_linear_triton
    from hyserve.kernels.triton_fused_linear import (
        gated_norm_linear_triton,
        linear_triton,
        relu2_linear_triton,
    )
    from hyserve.kernels.triton_moe import moe_experts_triton, moe_route_triton, router_logits_triton
    from hyserve.kernels.triton_rmsnorm import add_rms_norm_triton, rms_norm_triton, rmsnorm_gated_triton
    from hyserve.kernels.triton_ssd import ssd_triton
    from hyserve.kernels.triton_ssm_update import selective_state_update_triton
    from hyserve.kernels.triton_stochastic_rounding import store_ssm_state_triton
    from hyserve.kernels.triton_token_bitmask import apply_token_bitmask_triton

    impls: dict[str, Callable[..., Any]] = {
        "rms_norm": rms_norm_triton,
        "add_rms_norm": add_rms_norm_triton,
        "relu2": relu2_triton,
        "rmsnorm_gated": rmsnorm_gated_triton,
        "linear": linear_triton,
        "gated_norm_linear": gated_norm_linear_triton,
        "relu2_linear": relu2_linear_triton,
        "fp8_linear": fp8_linear_triton,
        "fp8_relu2_linear": fp8_relu2_linear_triton,
        "conv1d_update": causal_conv1d_update_triton,
        "conv1d_varlen": causal_conv1d_varlen_triton,
        "ssm_update": selective_state_update_triton,
        "ssd": ssd_triton,
        "store_ssm_state": store_ssm_state_triton,
        "router_logits": router_logits_triton,
        "moe_route": moe_route_triton,
        "moe_experts": moe_experts_triton,
        "apply_token_bitmask": apply_token_bitmask_triton,
        "write_kv": write_kv_triton,
        "paged_attention": paged_attention_cuda,  # Triton, or on Hopper Gluon for prefill (cuda_attention.py)
    }
    for name, fn in impls.items():
        ops.use_cuda_impl(name, fn)
    return list(impls)
