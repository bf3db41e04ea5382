"""scripts/train_mtp.py end to end on the CPU, a few steps: it writes a copy of the needle checkpoint with an
MTP block in NVIDIA's layout, which hyserve loads and drafts with, giving plain decoding's answers."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from scripts import train_mtp


def test_a_few_steps_write_a_checkpoint_that_drafts(tmp_path: Path) -> None:
    out = tmp_path / "needle-mtp"
    argv = ["--out", str(out), "--steps", "3", "--batch", "2", "--result-dir", str(tmp_path)]
    assert train_mtp.main(argv) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["mtp_hybrid_override_pattern"] == "*-"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"mtp.layers.0.eh_proj.weight", "mtp.layers.1.final_layernorm.weight"} <= names
    res = json.loads((tmp_path / "mtp_train_needle-mtp.json").read_text())
    assert res["same_answers"] == res["prompts"] == 16 and res["acceptance_length"] >= 1.0
