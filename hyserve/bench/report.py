"""Result files and tables: the environment stamp (date, git sha, GPU, command), `records` in the format of
benchmarks/bench_model.py ({name, value, unit, reference, reference_value, ratio}), plain-text tables and
the JSON file."""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hyserve.bench.metrics import LATENCY_METRICS, pct_label

_REPO = Path(__file__).resolve().parents[2]
_LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


# ---- environment -----------------------------------------------------------------------------------------


def git_sha(override: str | None = None) -> str:
    """The short commit of this checkout; `override` (--git-sha) wins, "unknown" when not in git."""
    if override:
        return override
    if shutil.which("git") is None:
        return "unknown"
    try:
        r = subprocess.run(
            ["git", "-C", str(_REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else "unknown"


def gpu_name() -> str:
    """'NVIDIA H200' (or '2 x NVIDIA H200') from nvidia-smi; "cpu" when there is none."""
    if shutil.which("nvidia-smi") is None:
        return "cpu"
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return "cpu"
    names = [n.strip() for n in r.stdout.splitlines() if n.strip()] if r.returncode == 0 else []
    if not names:
        return "cpu"
    if len(set(names)) == 1:
        return names[0] if len(names) == 1 else f"{len(names)} x {names[0]}"
    return ", ".join(names)


def stamp(kind: str, command: Sequence[str], sha_override: str | None = None) -> dict[str, Any]:
    return {
        "kind": kind,
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "git_sha": git_sha(sha_override),
        "gpu": gpu_name(),
        "command": list(command),
    }


# ---- records ---------------------------------------------------------------------------------------------


def record(
    name: str,
    value: float | None,
    unit: str,
    reference: str | None = None,
    reference_value: float | None = None,
) -> dict[str, Any]:
    ratio = value / reference_value if (value is not None and reference_value) else None
    return {
        "name": name,
        "value": value,
        "unit": unit,
        "reference": reference,
        "reference_value": reference_value,
        "ratio": ratio,
    }


def records_markdown(records: Sequence[dict[str, Any]], first_column: str = "name") -> str:
    """A markdown table of `records` (value and reference to 2 decimals, ratio to 3)."""
    lines = [
        f"| {first_column} | value | unit | reference | reference value | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        ref = "" if r["reference_value"] is None else f"{r['reference_value']:.2f}"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"| {r['name']} | {r['value']:.2f} | {r['unit']} | {r['reference']} | {ref} | {ratio} |")
    return "\n".join(lines)


# (metric key, short name, unit) reported per run as records
_RUN_RECORDS = (
    ("output_throughput", "output throughput", "tok/s"),
    ("request_throughput", "request throughput", "req/s"),
    ("total_token_throughput", "total token throughput", "tok/s"),
    ("mean_ttft_ms", "mean TTFT", "ms"),
    ("p99_ttft_ms", "P99 TTFT", "ms"),
    ("mean_tpot_ms", "mean TPOT", "ms"),
    ("p99_tpot_ms", "P99 TPOT", "ms"),
    ("mean_e2el_ms", "mean E2EL", "ms"),
    ("p99_e2el_ms", "P99 E2EL", "ms"),
    ("mean_per_user_output_tps", "mean per-user output", "tok/s"),
)


def _run_records(m: dict[str, Any]) -> tuple[tuple[str, str, str], ...]:
    """_RUN_RECORDS, with the goodput when the run had objectives."""
    if m.get("request_goodput") is None:
        return _RUN_RECORDS
    return (*_RUN_RECORDS[:2], ("request_goodput", "request goodput", "req/s"), *_RUN_RECORDS[2:])


def concurrency_label(c: int | None) -> str:
    return "unlimited concurrency" if c is None else f"concurrency {c}"


def serve_records(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every run's headline numbers; repetitions 2.. are quoted against repetition 1 of the same point, and
    the first repetition of each sweep point against the first point (throughput scaling)."""
    out = []
    first = points[0]["reps"][0] if points and points[0]["reps"] else None
    for i, p in enumerate(points):
        label = concurrency_label(p["max_concurrency"])
        rep1 = p["reps"][0]
        for m in p["reps"]:
            for key, short, unit in _run_records(m):
                name = f"{label}, rep {m['rep']}: {short}"
                if m["rep"] > 1:
                    out.append(record(name, m.get(key), unit, f"{label}, rep 1", rep1.get(key)))
                elif i > 0 and first is not None and key in ("output_throughput", "request_throughput"):
                    out.append(
                        record(
                            name,
                            m.get(key),
                            unit,
                            f"{concurrency_label(points[0]['max_concurrency'])}, rep 1",
                            first.get(key),
                        )
                    )
                else:
                    out.append(record(name, m.get(key), unit))
    return out


# ---- tables ----------------------------------------------------------------------------------------------


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != v:  # nan
            return "-"
        return f"{v:,.2f}"
    return str(v)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to width; the first column left-aligned, the rest right-aligned."""
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def serve_metric_rows(
    percentiles: Sequence[float], metrics: Sequence[str] = LATENCY_METRICS, goodput: bool = False
) -> list[tuple[str, str]]:
    """(row label, metric key) in table order: the latency percentiles of `metrics` only (vLLM's
    --percentile-metrics), and the goodput rows when the run had objectives."""
    rows = [
        ("Successful requests", "completed"),
        ("Failed requests", "failed"),
        ("Duration (s)", "duration_s"),
        ("Request throughput (req/s)", "request_throughput"),
    ]
    if goodput:
        rows += [
            ("Requests within the SLOs", "good_requests"),
            ("Request goodput (req/s)", "request_goodput"),
        ]
    rows += [
        ("Input token throughput (tok/s)", "input_throughput"),
        ("Output token throughput (tok/s)", "output_throughput"),
        ("Total token throughput (tok/s)", "total_token_throughput"),
        ("Prompt tokens sent", "prompt_tokens_sent"),
        ("Prompt tokens seen (usage)", "prompt_tokens_usage"),
        ("Cached prompt tokens (usage)", "cached_tokens"),
        ("Output tokens", "total_output_tokens"),
        ("Output tokens counted from", "output_tokens_source"),
    ]
    ps = sorted({99.0, *map(float, percentiles)})
    # P50 is the median row (the JSON keeps both keys)
    stats = [("Mean", "mean"), ("Median", "median")] + [
        (pct_label(p).upper(), pct_label(p)) for p in ps if p != 50
    ]
    for m in LATENCY_METRICS:
        if m in metrics:
            rows += [(f"{label} {_LATENCY_NAMES[m]} (ms)", f"{stat}_{m}_ms") for label, stat in stats]
    rows += [(f"{label} per-user output (tok/s)", f"{stat}_per_user_output_tps") for label, stat in stats]
    return rows


def serve_point_table(
    point: dict[str, Any], percentiles: Sequence[float], metrics: Sequence[str] = LATENCY_METRICS
) -> str:
    reps = point["reps"]
    headers = ["metric"] + ([f"run {m['rep']}" for m in reps] if len(reps) > 1 else ["value"])
    spread = point.get("spread") or {}
    if len(reps) > 1:
        headers.append("spread %")
    rows = []
    with_goodput = reps[0].get("request_goodput") is not None
    for label, key in serve_metric_rows(percentiles, metrics, goodput=with_goodput):
        row: list[Any] = [label] + [m.get(key) for m in reps]
        if len(reps) > 1:
            row.append(spread[key]["spread_pct"] if key in spread else None)
        rows.append(row)
    title = f"=== {concurrency_label(point['max_concurrency'])} ==="
    out = [title, format_table(headers, rows)]
    ratio = point.get("run2_run1_output_throughput_ratio")
    if ratio is not None:
        out.append(f"run2/run1 output throughput: {ratio:.3f}")
    errors = [e for m in reps for e in m.get("errors", [])]
    for e in errors[:5]:
        out.append(f"error ({e['count']}x): {e['error']}")
    return "\n".join(out)


def sweep_table(points: Sequence[dict[str, Any]]) -> str:
    headers = [
        "concurrency",
        "req/s",
        "output tok/s",
        "per-user tok/s",
        "mean TTFT ms",
        "P99 TTFT ms",
        "mean TPOT ms",
        "mean E2EL ms",
        "failed",
    ]
    rows = []
    for p in points:
        m = p["reps"][-1]  # the last repetition: the warmest server
        rows.append(
            [
                p["max_concurrency"] if p["max_concurrency"] is not None else "unlimited",
                m["request_throughput"],
                m["output_throughput"],
                m["mean_per_user_output_tps"],
                m["mean_ttft_ms"],
                m["p99_ttft_ms"],
                m["mean_tpot_ms"],
                m["mean_e2el_ms"],
                m["failed"],
            ]
        )
    return format_table(headers, rows)


def _dataset_text(ds: dict[str, Any]) -> str:
    if ds.get("name") == "sharegpt":
        out = ds.get("sharegpt_output_len")
        lengths = f"output {out}" if out is not None else "outputs as long as the replies"
        return f"dataset sharegpt ({ds.get('path')}), {ds.get('num_prompts')} prompts, {lengths}"
    return (
        f"dataset {ds.get('name')}, {ds.get('num_prompts')} prompts, input {ds.get('input_len')}, "
        f"output {ds.get('output_len')}"
    )


def _traffic_text(cfg: dict[str, Any]) -> str:
    ramp = cfg.get("ramp_up")
    if ramp:
        text = f"ramp-up {ramp['strategy']} {ramp['start_rps']:g} -> {ramp['end_rps']:g} req/s"
    else:
        text = f"request rate {cfg.get('request_rate')}"
    if ramp or cfg.get("request_rate") not in (None, "inf"):
        text += f", burstiness {cfg.get('burstiness', 1.0)}"
    if cfg.get("num_warmups"):
        text += f", {cfg['num_warmups']} warm-up requests"
    return text


def serve_report_text(result: dict[str, Any]) -> str:
    cfg = result.get("config", {})
    pcts = cfg.get("percentiles") or (50.0, 99.0)
    head = (
        f"hyserve bench serve: {result.get('model')} at {result.get('api_url')} | "
        f"{_dataset_text(cfg.get('dataset', {}))}, {_traffic_text(cfg)}, "
        f"ignore_eos {fmt(cfg.get('ignore_eos'))}"
    )
    metrics = cfg.get("percentile_metrics") or LATENCY_METRICS
    if cfg.get("goodput"):
        head += " | SLOs " + " ".join(f"{k}:{v:g} ms" for k, v in cfg["goodput"].items())
    parts = [head] + [serve_point_table(p, pcts, metrics) for p in result["points"]]
    if len(result["points"]) > 1:
        parts.append(
            "=== throughput vs concurrency (last run of each point) ===\n" + sweep_table(result["points"])
        )
    return "\n\n".join(parts)


def offline_records(reps: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in reps:
        for key, short, unit in (
            ("request_throughput", "requests", "req/s"),
            ("input_throughput", "input throughput", "tok/s"),
            ("output_throughput", "output throughput", "tok/s"),
            ("total_token_throughput", "total token throughput", "tok/s"),
        ):
            name = f"offline rep {m['rep']}: {short}"
            if m["rep"] > 1:
                out.append(record(name, m[key], unit, "offline rep 1", reps[0][key]))
            else:
                out.append(record(name, m[key], unit))
    return out


def offline_report_text(result: dict[str, Any]) -> str:
    cfg = result["config"]
    reps = result["reps"]
    head = (
        f"hyserve bench offline: {result['model']} (load_format {cfg['load_format']}) | {cfg['num_prompts']} "
        f"prompts, input {cfg['input_len']}, output {cfg['output_len']}, engine options "
        f"{cfg['resolved_engine_options']}, load {result['load_s']:.1f} s"
    )
    rows_spec = [
        ("Requests", "num_requests"),
        ("Elapsed (s)", "elapsed_s"),
        ("Input tokens", "total_input_tokens"),
        ("Output tokens", "total_output_tokens"),
        ("Requests/s", "request_throughput"),
        ("Input tok/s", "input_throughput"),
        ("Output tok/s", "output_throughput"),
        ("Total tok/s", "total_token_throughput"),
        ("Mean TTFT (ms)", "mean_ttft_ms"),
        ("P99 TTFT (ms)", "p99_ttft_ms"),
        ("Mean E2EL (ms)", "mean_e2el_ms"),
        ("P99 E2EL (ms)", "p99_e2el_ms"),
    ]
    headers = ["metric"] + ([f"run {m['rep']}" for m in reps] if len(reps) > 1 else ["value"])
    spread = result.get("spread") or {}
    if len(reps) > 1:
        headers.append("spread %")
    rows = []
    for label, key in rows_spec:
        row: list[Any] = [label] + [m.get(key) for m in reps]
        if len(reps) > 1:
            row.append(spread[key]["spread_pct"] if key in spread else None)
        rows.append(row)
    parts = [head, format_table(headers, rows)]
    ratio = result.get("run2_run1_output_throughput_ratio")
    if ratio is not None:
        parts.append(f"run2/run1 output throughput: {ratio:.3f}")
    return "\n".join(parts)


def _needle_label(r: dict[str, Any], several_depths: bool) -> str:
    label = f"needle {r['target_tokens']:,} tokens"
    return f"{label} at depth {r['depth']:g}" if several_depths and r.get("depth") is not None else label


def _several_depths(rows: Sequence[dict[str, Any]]) -> bool:
    return len({r.get("depth") for r in rows}) > 1


def needle_records(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    several = _several_depths(rows)
    for r in rows:
        label = _needle_label(r, several)
        out.append(record(f"{label}: HTTP status", r["status"], "status"))
        out.append(
            record(
                f"{label}: prompt tokens (usage)", r["prompt_tokens"], "tokens", "target", r["target_tokens"]
            )
        )
        out.append(record(f"{label}: latency", r["latency_s"], "s"))
        out.append(record(f"{label}: needle found", int(bool(r["needle_found"])), "bool"))
    return out


def needle_grid_text(rows: Sequence[dict[str, Any]]) -> str:
    """HIT / MISS (or the HTTP outcome) by target size (rows) and needle depth (columns)."""
    depths = sorted({r.get("depth", 0.5) for r in rows})
    sizes = list(dict.fromkeys(r["target_tokens"] for r in rows))
    cell = {
        (r["target_tokens"], r.get("depth", 0.5)): r.get("outcome")
        or ("HIT" if r.get("needle_found") else "MISS")
        for r in rows
    }
    table = [[f"{t:,}", *(cell.get((t, d), "-") for d in depths)] for t in sizes]
    hits = sum(v == "HIT" for v in cell.values())
    return f"HIT / MISS by size and depth ({hits} of {len(cell)} HIT)\n" + format_table(
        ["target tokens", *(f"depth {d:g}" for d in depths)], table
    )


def needle_report_text(result: dict[str, Any]) -> str:
    head = (
        f"hyserve bench needle: {result['model']} at {result['api_url']} | answer {result['answer']!r}, "
        f"filler sized by {result['token_count_method']} ({result['tokens_per_filler_word']:.2f} tokens/word)"
    )
    headers = [
        "target tokens",
        "depth",
        "prompt tokens",
        "status",
        "latency s",
        "needle found",
        "healthy after",
        "error",
    ]
    rows = [
        [
            r["target_tokens"],
            r.get("depth", "-"),
            r["prompt_tokens"] if r["prompt_tokens"] is not None else f"~{r['estimated_prompt_tokens']:,}",
            r["status"] if r["status"] is not None else "no response",
            r["latency_s"],
            r["needle_found"],
            r["healthy_after"],
            (r["error"] or "")[:160],
        ]
        for r in result["results"]
    ]
    return head + "\n" + format_table(headers, rows) + "\n\n" + needle_grid_text(result["results"])


# ---- files -----------------------------------------------------------------------------------------------


def default_filename(kind: str, model: str | None) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", (model or "model").rstrip("/").rsplit("/", 1)[-1]).strip("-.")
    return f"{kind}-{name or 'model'}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"


def write_json(result: dict[str, Any], result_dir: str | Path, filename: str | None, kind: str) -> Path:
    d = Path(result_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / (filename or default_filename(kind, result.get("model")))
    path.write_text(json.dumps(result, indent=2, allow_nan=False, default=_json_default) + "\n")
    return path


def _json_default(o: Any) -> Any:
    if isinstance(o, tuple | set):
        return list(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def sanitize(obj: Any) -> Any:
    """NaN and infinities become None (JSON has no NaN); tuples become lists."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: sanitize(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [sanitize(v) for v in obj]
    return obj
