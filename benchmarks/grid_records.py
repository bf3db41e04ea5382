"""The records of `scripts/gpu_serve_check.sh grid`: output throughput at 1,024 streams (random 1k/1k) with
default flags against the best of the explicit `max_batch_size` x `max_num_tokens` settings, each a server of
its own. The bar: default flags within 5% of the best setting.

    python3 -m benchmarks.grid_records RESULT_DIR GIT_SHA

Reads RESULT_DIR/serve_grid_<setting>.json (`hyserve bench serve`; setting `default` or `<B>x<N>`), from one
or more runs of the part; writes RESULT_DIR/serve_grid.json and prints a table.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from benchmarks.scale_records import first_rep
from hyserve.bench.report import record, records_markdown, stamp

NAME = re.compile(r"serve_grid_(default|\d+x\d+)\.json$")
BAR = 0.95  # default flags' throughput over the best setting's


def grid_records(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """`results`: setting -> its bench result. Every setting's tok/s (against the default's), then the
    default against the best explicit setting."""
    tps = {k: first_rep(v)["output_throughput"] for k, v in results.items()}
    default = tps.get("default")
    recs = [
        record(
            f"grid 30B-A3B fp8 1k/1k c1024, {k}",
            v,
            "tok/s",
            "default flags" if default is not None else "none",
            default,
        )
        for k, v in sorted(tps.items(), key=lambda kv: (kv[0] != "default", kv[0]))
    ]
    explicit = {k: v for k, v in tps.items() if k != "default"}
    if default is not None and explicit:
        best = max(explicit, key=lambda k: explicit[k])
        recs.append(
            record(
                "grid: default flags vs the best setting",
                default,
                "tok/s",
                f"best setting ({best}); bar {BAR}",
                explicit[best],
            )
        )
    return recs


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    r, sha = Path(args[0]), args[1]
    results = {}
    for f in sorted(r.glob("serve_grid_*.json")):
        m = NAME.search(f.name)
        if m:
            results[m.group(1)] = json.loads(f.read_text())
    if not results:
        raise SystemExit(f"no serve_grid_<setting>.json under {r}")
    out = {**stamp("serve_grid", ["scripts/gpu_serve_check.sh", "grid"], sha)}
    out["records"] = grid_records(results)
    (r / "serve_grid.json").write_text(json.dumps(out, indent=2))
    print(records_markdown(out["records"], "setting"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
