"""Run tests/sm90_compile_check.py in a fresh process without TRITON_INTERPRET (the interpreter never
compiles) and return its JSON line: {"dtype": ..., "kernels": {name: shared bytes}, "ptx": {name: [markers]}}.
No GPU is needed: the kernels compile for sm_90 through a stand-in driver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HOPPER_SHARED_BYTES = 232448  # the most shared memory a block may ask for on an H100 / H200


def compile_for_sm90(dtype: str, *args: str, timeout: int = 600) -> dict[str, Any]:
    """`args`: the check's ops and options (`--only k1,k2`, `--no-pdl`)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "sm90_compile_check.py"), dtype, *args],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(ROOT)},
        timeout=timeout,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
