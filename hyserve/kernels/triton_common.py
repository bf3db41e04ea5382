"""Triton device functions shared by several kernel files (imported into their `@triton.jit` code)."""

from __future__ import annotations

import triton
import triton.language as tl


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
