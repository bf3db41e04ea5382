"""Triton device functions shared by several kernel files (imported into their `@triton.jit` code)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """The wait of a kernel launched through `launch_util.pdl`, its first statement but for loads of weights
    (and, in the MoE decode GEMVs' EARLY form, of tensors written two kernels back): with PDL, wait until the
    previous kernel on the stream has finished and its writes are visible (nothing before this call may read
    what it wrote or write what it reads), then let the next kernel's blocks be scheduled as this one's last
    blocks start. Every kernel of the chain waits here, so a kernel's completion implies its predecessors'."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """With PDL, let the next kernel's blocks be scheduled, for a program that waits later (`pdl_wait`) or
    not at all. The next kernel is scheduled only once every program of this one has released or exited,
    so a grid whose other programs release after their wait keeps the chain's ordering."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """With PDL, the wait of `pdl_enter` alone, for a program that has released already (`pdl_release`)."""
    if PDL:
        gdc_wait()


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """tl.dot, in IEEE float32 when IEEE (float32 inputs) and the default (tf32/bf16) otherwise."""
    if IEEE:
        r = tl.dot(a, b, input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


@triton.jit
def dot_acc(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b accumulated inside the matrix product (dot's precision rule)."""
    if IEEE:
        r = tl.dot(a, b, acc, input_precision="ieee")
    else:
        r = tl.dot(a, b, acc)
    return r


@triton.jit
def softplus(v):
    # F.softplus(v) with torch's threshold of 20; the small-exp branch keeps relative precision
    # where log(1 + e) would round to 0.
    e = tl.exp(-tl.abs(v))
    l1p = tl.where(e < 1e-4, e * (1.0 - 0.5 * e), tl.log(1.0 + e))
    return tl.where(v > 20.0, v, tl.maximum(v, 0.0) + l1p)
