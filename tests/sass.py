"""SASS opcode counts of a compiled kernel, for the ahead-of-time compile checks (no GPU needed)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path


def sass_counts(cubin: bytes, names: tuple[str, ...]) -> dict[str, int]:
    """How many of each SASS opcode prefix (e.g. QGMMA: Hopper's e4m3 warp-group MMA) the cubin holds
    (cuobjdump, shipped beside triton's ptxas): what the tensor cores run, which PTX alone does not say (an
    e4m3 `mma.sync` compiles for sm_90 but is emulated with f16 MMAs)."""
    from triton.backends.nvidia.compiler import get_ptxas

    cuobjdump = str(Path(get_ptxas(90).path).with_name("cuobjdump"))
    with tempfile.TemporaryDirectory() as d:
        Path(f"{d}/k.cubin").write_bytes(cubin)
        sass = subprocess.run(
            [cuobjdump, "-sass", f"{d}/k.cubin"], capture_output=True, text=True, check=True
        ).stdout
    return {n: len(re.findall(rf"\b{n}\b", sass)) for n in names}
