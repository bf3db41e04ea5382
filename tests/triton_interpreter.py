"""Triton kernel tests run compiled on CUDA and under the Triton interpreter without it: a test module calls
`interpret_without_cuda()` before anything imports triton (the interpreter is chosen at triton's first import,
so a module collected after triton was imported compiled is skipped instead)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

# the interpreter converts 1-element arrays to loop bounds, which numpy >= 1.25 warns about
IGNORE_INTERPRETER_WARNING = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)


def interpret_without_cuda() -> None:
    if not torch.cuda.is_available():
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("triton was imported before TRITON_INTERPRET could be set", allow_module_level=True)
        os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
