"""The structured-outputs token mask kernel (`kernels/triton_token_bitmask.py`) against its reference and the
bit rule in float64. Without CUDA it runs under the Triton interpreter; it also compiles for sm_90 offline."""

from __future__ import annotations

import pytest
import torch

from tests.sm90 import compile_for_sm90
from tests.triton_interpreter import interpret_without_cuda

interpret_without_cuda()

from hyserve.kernels.token_bitmask import apply_token_bitmask_ref, bitmask_width  # noqa: E402
from hyserve.kernels.triton_token_bitmask import apply_token_bitmask_triton  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("n, vocab", [(1, 320), (5, 1000), (3, 32 * 7), (2, 131)])
# the sampler's logits are float32; the interpreter has no bfloat16 constants, so bf16 runs on a GPU only
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
)
def test_mask_matches_the_reference_and_the_bit_rule(n, vocab, dtype):
    g = torch.Generator().manual_seed(n * vocab)
    logits = torch.randn(n, vocab, generator=g).to(dtype).to(DEV)
    mask = torch.randint(-(2**31), 2**31 - 1, (n, bitmask_width(vocab)), generator=g, dtype=torch.int64)
    mask = mask.to(torch.int32)
    mask[0] = -1  # a row allowing everything comes back unchanged
    if n > 1:
        mask[1] = 0  # one allowing nothing is all -inf
    mask = mask.to(DEV)
    before = logits.clone()
    got = apply_token_bitmask_triton(logits, mask)
    assert torch.equal(logits, before), "the input was written"
    assert torch.equal(got, apply_token_bitmask_ref(logits, mask))
    m = mask.cpu()
    allowed = torch.tensor(
        [[(int(m[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)] for r in range(n)]
    ).bool()
    want = torch.where(allowed, logits.cpu().double(), float("-inf"))
    assert torch.equal(got.cpu().double(), want)
    assert torch.equal(got[0], logits[0])


@pytest.mark.parametrize(
    "bad, what",
    [
        ("width", "bitmask must be"),
        ("dtype", "bitmask must be"),
        ("logits", "logits must be"),
        ("rows", "bitmask must be"),
    ],
)
def test_bad_masks_are_refused_with_the_expected_shape(bad, what):
    logits, mask = torch.zeros(2, 100, device=DEV), torch.full((2, 4), -1, dtype=torch.int32, device=DEV)
    if bad == "width":
        mask = mask[:, :3]
    elif bad == "dtype":
        mask = mask.long()
    elif bad == "logits":
        logits = logits[None]
    elif bad == "rows":
        mask = mask[:1]
    for fn in (apply_token_bitmask_triton, apply_token_bitmask_ref):
        with pytest.raises(ValueError, match=what):
            fn(logits, mask)


@pytest.mark.slow
def test_the_mask_kernel_compiles_for_sm90():
    assert "_apply_bitmask_kernel" in compile_for_sm90("float32", "sampling", timeout=300)["kernels"]
