"""The step token counts whose kernel variants differ, for the warm-up to run a step of each (so nothing
compiles after ready): the routed experts' tile configs per token bucket and the FP8 linears' launch
forms. The kernels' modules are imported only when a model has such layers (they import Triton)."""

from __future__ import annotations


def kernel_token_buckets(max_num_tokens: int, *, moe: bool, fp8: bool) -> list[int]:
    buckets: set[int] = set()
    if moe:
        from hyserve.kernels.triton_moe import moe_token_buckets

        buckets.update(moe_token_buckets(max_num_tokens))
    if fp8:
        from hyserve.kernels.triton_fp8_linear import fp8_token_buckets

        buckets.update(fp8_token_buckets(max_num_tokens))
    return sorted(buckets)
