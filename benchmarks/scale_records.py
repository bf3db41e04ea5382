"""The records of `scripts/gpu_serve_check.sh scale`: the server's output throughput at 1,024 concurrency
against vLLM's published figure for the same model, precision, GPU and workload, against the engine's own
(`LLM.generate`) on the same workload, its TTFT p50 against the 1.5 s bar, the time to ready, and, when the
run had objectives (`--goodput ttft:2000 tpot:100`), the goodput against the request throughput (the share of
requests that met them).

    python3 -m benchmarks.scale_records RESULT_DIR READY_S GIT_SHA

Reads RESULT_DIR/serve_scale_c1024.json (`hyserve bench serve`) and, where the run had it,
serve_scale_engine.json (`hyserve bench offline`; without it, no server / engine record); writes
RESULT_DIR/serve_scale.json and prints its records.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hyserve.bench.report import record, stamp

# vLLM's recipe for Nemotron 3 Nano 30B-A3B, FP8, one H200, random 1k/1k at 1,024 concurrency
VLLM_PUBLISHED_TOK_S = 15828.0
TTFT_P50_BAR_MS = 1500.0
READY_BAR_S = 60.0


def first_rep(result: dict[str, Any]) -> dict[str, Any]:
    """The first repetition's metrics of a `hyserve bench serve` (first sweep point) or `offline` result."""
    if "points" in result:
        return result["points"][0]["reps"][0]
    return result["reps"][0]


def scale_records(
    serve: dict[str, Any], engine: dict[str, Any] | None, ready_s: float
) -> list[dict[str, Any]]:
    s = first_rep(serve)
    recs = [
        record(
            "serve 30B-A3B fp8 1k/1k c1024",
            s["output_throughput"],
            "tok/s",
            "vLLM published, same model, precision, GPU and workload",
            VLLM_PUBLISHED_TOK_S,
        ),
        record("serve TTFT p50, 1,024 concurrency (ms)", s["median_ttft_ms"], "ms", "bar", TTFT_P50_BAR_MS),
        record("time to ready, default sizes (s)", ready_s, "s", "bar", READY_BAR_S),
    ]
    if s.get("request_goodput") is not None:
        recs.append(
            record(
                "serve goodput, TTFT <= 2 s and TPOT <= 100 ms (req/s)",
                s["request_goodput"],
                "req/s",
                "request throughput",
                s["request_throughput"],
            )
        )
    if engine is not None:
        e = first_rep(engine)
        recs.insert(
            1,
            record(
                "serve / engine, same workload",
                s["output_throughput"],
                "tok/s",
                "LLM.generate",
                e["output_throughput"],
            ),
        )
    return recs


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    r, ready, sha = Path(args[0]), float(args[1]), args[2]
    serve = json.loads((r / "serve_scale_c1024.json").read_text())
    engine_file = r / "serve_scale_engine.json"
    engine = json.loads(engine_file.read_text()) if engine_file.exists() else None
    out = {**stamp("serve_scale", ["scripts/gpu_serve_check.sh", "scale"], sha)}
    out["records"] = scale_records(serve, engine, ready)
    (r / "serve_scale.json").write_text(json.dumps(out, indent=2))
    for rec in out["records"]:
        print(f"{rec['name']}: {rec['value']:.2f} {rec['unit']} ({rec['ratio']:.3f} of {rec['reference']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
