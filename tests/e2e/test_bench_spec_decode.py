"""benchmarks/bench_spec_decode.py runs end to end on the CPU (--dry-run: the built-in tiny model) and writes
its records: verify-step cost per k against the plain step, batch on/off, and the needle checkpoint's
acceptance with the same answers as plain decoding."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import bench_spec_decode

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_writes_the_records(tmp_path: Path) -> None:
    argv = [
        "--dry-run",
        "--ks",
        "1,3",
        "--batches",
        "1,2",
        "--steps",
        "3",
        "--wide",
        "4",
        "--wide-tokens",
        "8",
    ]
    argv += ["--needle", str(ROOT / "models" / "hyserve-needle-tiny"), "--needle-lengths", "200"]
    assert bench_spec_decode.main([*argv, "--result-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("spec_decode_*.json")
    doc = json.loads(path.read_text())
    names = [r["name"] for r in doc["records"]]
    assert (
        "verify step k=3, batch 2 (ms)" in names
        and "batch 4 generate, speculation allowed vs off (tok/s)" in names
    )
    assert all(r["value"] > 0 for r in doc["records"])
    assert [s["batch"] for s in doc["steps"]] == [1, 2] and set(doc["steps"][0]["verify_ms"]) == {"1", "3"}
    assert doc["needle"]["same_answers"] and doc["needle"]["acceptance_length"] > 1.5
    assert doc["git_sha"] and doc["command"]
