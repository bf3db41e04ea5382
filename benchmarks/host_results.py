"""The JSON + markdown a CPU host-timing benchmark writes (bench_host.py, bench_serve_host.py): date, git sha,
what ran instead of a GPU, the CPU, the exact command, the records; the table beside it."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path

from benchmarks import invocation
from hyserve.bench.report import git_sha

ROOT = Path(__file__).resolve().parents[1]


def write_host_results(
    kind: str, out: Path | None, sha_arg: str, gpu_note: str, records: list[dict], table: list[str]
) -> Path:
    """Write benchmarks/results/<kind>_<date>_<sha>.json (or `out`) and the markdown `table` beside it."""
    sha = git_sha(sha_arg)
    date = _dt.date.today().isoformat()
    out = out or ROOT / "benchmarks" / "results" / f"{kind}_{date}_{sha}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = dict(
        date=date,
        git_sha=sha,
        gpu=gpu_note,
        cpu=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        command=" ".join(invocation()),
        records=records,
    )
    out.write_text(json.dumps(doc, indent=2) + "\n")
    out.with_suffix(".md").write_text("\n".join(table) + "\n")
    print(f"wrote {out}")
    return out
