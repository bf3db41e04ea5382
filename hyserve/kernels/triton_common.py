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
def exp2_fma(x):
    """2**x for x <= 0 (a softmax's shifted scores) on the fused-multiply-add pipes instead of the special
    function unit: 2**floor(x) from the exponent bits, 2**frac(x) from a degree-3 polynomial (fitted to
    relative error 8.6e-5 over [0, 1), far below a bfloat16 probability's rounding). Below -126 (float32's
    normal range; -inf included) it gives 0."""
    x = tl.maximum(x, -127.0)
    xi = tl.floor(x)
    f = x - xi
    p = 1.0 + f * (0.69511681 + f * (0.22764491 + f * 0.07706711))
    return p * ((xi.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def softplus(v):
    # F.softplus(v) with torch's threshold of 20; the small-exp branch keeps relative precision
    # where log(1 + e) would round to 0.
    e = tl.exp(-tl.abs(v))
    l1p = tl.where(e < 1e-4, e * (1.0 - 0.5 * e), tl.log(1.0 + e))
    return tl.where(v > 20.0, v, tl.maximum(v, 0.0) + l1p)
