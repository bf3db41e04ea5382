"""The kernel registry: every op the model and the engine call, one typed `Op` object each.

An op's signature is its plain-torch reference's, declared once, where the reference is defined; the
reference is the CPU path and the test oracle. `load_cuda_kernels` binds each op's CUDA implementation
(Triton, or Gluon on Hopper) under that same signature, which mypy checks. Call sites pick by device:

    ops.rms_norm.get(x.is_cuda)(x, weight, eps)    # mypy checks these arguments against rms_norm_ref

There is no silent fallback: an op asked for on CUDA without a CUDA implementation raises
`MissingCudaKernelError` naming it, and on CUDA the engine start-up checks (`require_cuda`) every op the
model family declares it calls before anything runs. Importing this module never imports Triton.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, ParamSpec, Protocol, TypeVar

import torch

from hyserve.kernels.activation import relu2_ref
from hyserve.kernels.attention import paged_attention_ref, write_kv_ref
from hyserve.kernels.conv1d import causal_conv1d_update_ref, causal_conv1d_varlen_ref
from hyserve.kernels.fp8_linear import fp8_linear_ref, fp8_relu2_linear_ref
from hyserve.kernels.fused_linear import gated_norm_linear_ref, linear_ref, relu2_linear_ref
from hyserve.kernels.moe import moe_experts_ref, moe_route_ref, router_logits_ref
from hyserve.kernels.moe_silu import moe_experts_silu_ref
from hyserve.kernels.rmsnorm import add_rms_norm_ref, rms_norm_ref, rmsnorm_gated_ref
from hyserve.kernels.ssd import ssd_chunked_ref
from hyserve.kernels.ssm_update import selective_state_update_ref
from hyserve.kernels.stochastic_rounding import store_ssm_state_ref
from hyserve.kernels.token_bitmask import apply_token_bitmask_ref

P = ParamSpec("P")
R = TypeVar("R")


class MissingCudaKernelError(RuntimeError):
    """An op is needed on CUDA and has no CUDA implementation."""


class KernelOp(Protocol):
    """What start-up asks of an op a model family declares it calls: its name and whether it has a CUDA
    implementation."""

    @property
    def name(self) -> str: ...

    @property
    def has_cuda(self) -> bool: ...


class Op(Generic[P, R]):
    """One op: its name, its torch reference and, once bound, its CUDA implementation (same signature)."""

    def __init__(self, name: str, ref: Callable[P, R]) -> None:
        self.name = name
        self.ref: Callable[P, R] = ref
        self.cuda: Callable[P, R] | None = None

    def bind_cuda(self, fn: Callable[P, R]) -> None:
        self.cuda = fn

    @property
    def has_cuda(self) -> bool:
        return self.cuda is not None

    def get(self, on_cuda: bool) -> Callable[P, R]:
        """The implementation for tensors on CUDA (`on_cuda`) or on the CPU. The first CUDA lookup loads the
        CUDA kernels if start-up has not (a layer run on its own)."""
        if not on_cuda:
            return self.ref
        if self.cuda is None:
            load_cuda_kernels()
            if self.cuda is None:
                raise MissingCudaKernelError(f"op {self.name!r} has no CUDA implementation")
        return self.cuda

    def __repr__(self) -> str:
        return f"Op({self.name!r}, cuda={'yes' if self.cuda is not None else 'no'})"


rms_norm = Op("rms_norm", rms_norm_ref)
add_rms_norm = Op("add_rms_norm", add_rms_norm_ref)
relu2 = Op("relu2", relu2_ref)
rmsnorm_gated = Op("rmsnorm_gated", rmsnorm_gated_ref)
linear = Op("linear", linear_ref)
gated_norm_linear = Op("gated_norm_linear", gated_norm_linear_ref)
relu2_linear = Op("relu2_linear", relu2_linear_ref)
fp8_linear = Op("fp8_linear", fp8_linear_ref)
fp8_relu2_linear = Op("fp8_relu2_linear", fp8_relu2_linear_ref)
ssd = Op("ssd", ssd_chunked_ref)
conv1d_varlen = Op("conv1d_varlen", causal_conv1d_varlen_ref)
conv1d_update = Op("conv1d_update", causal_conv1d_update_ref)
ssm_update = Op("ssm_update", selective_state_update_ref)
store_ssm_state = Op("store_ssm_state", store_ssm_state_ref)
write_kv = Op("write_kv", write_kv_ref)
paged_attention = Op("paged_attention", paged_attention_ref)
router_logits = Op("router_logits", router_logits_ref)
moe_route = Op("moe_route", moe_route_ref)
moe_experts = Op("moe_experts", moe_experts_ref)
moe_experts_silu = Op("moe_experts_silu", moe_experts_silu_ref)
apply_token_bitmask = Op("apply_token_bitmask", apply_token_bitmask_ref)

ALL_OPS: tuple[Op[..., Any], ...] = (
    rms_norm,
    add_rms_norm,
    relu2,
    rmsnorm_gated,
    linear,
    gated_norm_linear,
    relu2_linear,
    fp8_linear,
    fp8_relu2_linear,
    ssd,
    conv1d_varlen,
    conv1d_update,
    ssm_update,
    store_ssm_state,
    write_kv,
    paged_attention,
    router_logits,
    moe_route,
    moe_experts,
    moe_experts_silu,
    apply_token_bitmask,
)


def load_cuda_kernels() -> list[str]:
    """Bind the CUDA implementations (importing Triton here, lazily). Returns the op names bound (empty
    without CUDA). Raises ImportError with an install hint when CUDA is there but triton is not."""
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
    from hyserve.kernels.triton_moe import (
        moe_experts_silu_triton,
        moe_experts_triton,
        moe_route_triton,
        router_logits_triton,
    )
    from hyserve.kernels.triton_rmsnorm import add_rms_norm_triton, rms_norm_triton, rmsnorm_gated_triton
    from hyserve.kernels.triton_ssd import ssd_triton
    from hyserve.kernels.triton_ssm_update import selective_state_update_triton
    from hyserve.kernels.triton_stochastic_rounding import store_ssm_state_triton
    from hyserve.kernels.triton_token_bitmask import apply_token_bitmask_triton

    rms_norm.bind_cuda(rms_norm_triton)
    add_rms_norm.bind_cuda(add_rms_norm_triton)
    relu2.bind_cuda(relu2_triton)
    rmsnorm_gated.bind_cuda(rmsnorm_gated_triton)
    linear.bind_cuda(linear_triton)
    gated_norm_linear.bind_cuda(gated_norm_linear_triton)
    relu2_linear.bind_cuda(relu2_linear_triton)
    fp8_linear.bind_cuda(fp8_linear_triton)
    fp8_relu2_linear.bind_cuda(fp8_relu2_linear_triton)
    conv1d_update.bind_cuda(causal_conv1d_update_triton)
    conv1d_varlen.bind_cuda(causal_conv1d_varlen_triton)
    ssm_update.bind_cuda(selective_state_update_triton)
    ssd.bind_cuda(ssd_triton)
    store_ssm_state.bind_cuda(store_ssm_state_triton)
    router_logits.bind_cuda(router_logits_triton)
    moe_route.bind_cuda(moe_route_triton)
    moe_experts.bind_cuda(moe_experts_triton)
    moe_experts_silu.bind_cuda(moe_experts_silu_triton)
    apply_token_bitmask.bind_cuda(apply_token_bitmask_triton)
    write_kv.bind_cuda(write_kv_triton)
    paged_attention.bind_cuda(paged_attention_cuda)  # Triton, or on Hopper Gluon (cuda_attention.py)
    return [op.name for op in ALL_OPS if op.cuda is not None]


def require_cuda(used: Iterable[KernelOp]) -> None:
    """Start-up on CUDA: every op in `used` must have a CUDA implementation, else an error naming those
    that have none (rather than a slow reference kernel found mid-traffic, or a failure there)."""
    missing = sorted({op.name for op in used if not op.has_cuda})
    if missing:
        raise MissingCudaKernelError(
            f"no CUDA implementation of op(s) {', '.join(missing)}: the model runs them on CUDA; bind one in "
            "hyserve/kernels/ops.py (load_cuda_kernels) or run on the CPU (--device cpu)"
        )


@contextmanager
def reference_on_cuda(*chosen: Op[..., Any]) -> Iterator[None]:
    """Within: the chosen ops (all when none is named) run their torch reference on CUDA tensors too, for
    comparisons on the device (tests, benchmarks)."""
    targets = chosen or ALL_OPS
    saved = [(op, op.cuda) for op in targets]
    for op in targets:
        op.cuda = op.ref
    try:
        yield
    finally:
        for op, fn in saved:
            op.cuda = fn
