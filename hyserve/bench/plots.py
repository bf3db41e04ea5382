"""PNG plots from a saved result JSON (matplotlib is optional: the GPU machines do not have it, so
`hyserve bench plot RESULT.json` renders the same plots later on any machine that does).

serve:   TTFT and E2EL latency CDFs (one line per concurrency point and run), and throughput vs
         concurrency (output tok/s and per-user tok/s) for sweeps.
offline: output and total throughput per run.
needle:  latency vs prompt tokens, marking requests that did not return 200.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

INSTALL_HINT = "PNG plots need matplotlib: pip install matplotlib (or pip install 'hyserve[bench]')"


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def _run_label(point: dict[str, Any], m: dict[str, Any], n_points: int, n_reps: int) -> str:
    parts = []
    if n_points > 1 or point.get("max_concurrency") is not None:
        c = point.get("max_concurrency")
        parts.append(f"conc {c}" if c is not None else "conc unlimited")
    if n_reps > 1:
        parts.append(f"run {m['rep']}")
    return ", ".join(parts) or "run 1"


def _serve_plots(result: dict[str, Any], prefix: Path) -> list[Path]:
    plt = _pyplot()
    points = result["points"]
    out = []
    for key, title in (("ttft_s", "TTFT"), ("e2el_s", "E2EL")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        drawn = False
        for p in points:
            for m in p["reps"]:
                vals = [
                    r[key] * 1000 for r in m.get("requests", []) if r.get("ok") and r.get(key) is not None
                ]
                if not vals:
                    continue
                xs, ys = _cdf(vals)
                ax.step(xs, ys, where="post", label=_run_label(p, m, len(points), len(p["reps"])))
                drawn = True
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{title} CDF - {result.get('model')}")
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        path = prefix.with_name(f"{prefix.name}_{title.lower()}_cdf.png")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        out.append(path)
    swept = [p for p in points if p.get("max_concurrency") is not None]
    if len(swept) > 1:
        conc = [p["max_concurrency"] for p in swept]
        last = [p["reps"][-1] for p in swept]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.plot(conc, [m["output_throughput"] for m in last], "o-", label="output tok/s (all users)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.minorticks_off()
        ax.set_xlabel("max concurrency")
        ax.set_ylabel("output tok/s")
        ax2 = ax.twinx()
        ax2.plot(
            conc,
            [m.get("mean_per_user_output_tps") or 0.0 for m in last],
            "s--",
            color="tab:orange",
            label="per-user output tok/s",
        )
        ax2.set_ylabel("per-user output tok/s")
        lines = ax.get_lines() + ax2.get_lines()
        ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="best")
        ax.set_title(f"throughput vs concurrency - {result.get('model')}")
        ax.grid(True, alpha=0.3)
        path = prefix.with_name(f"{prefix.name}_throughput_vs_concurrency.png")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        out.append(path)
    return out


def _offline_plots(result: dict[str, Any], prefix: Path) -> list[Path]:
    plt = _pyplot()
    reps = result["reps"]
    x = list(range(1, len(reps) + 1))
    fig, ax = plt.subplots(figsize=(6, 4))
    w = 0.38
    ax.bar([i - w / 2 for i in x], [m["output_throughput"] for m in reps], w, label="output tok/s")
    ax.bar([i + w / 2 for i in x], [m["total_token_throughput"] for m in reps], w, label="total tok/s")
    ax.set_xticks(x)
    ax.set_xlabel("run")
    ax.set_ylabel("tok/s")
    ax.set_title(f"offline throughput - {result.get('model')}")
    ax.legend(fontsize=8)
    path = prefix.with_name(f"{prefix.name}_throughput.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def _needle_plots(result: dict[str, Any], prefix: Path) -> list[Path]:
    plt = _pyplot()
    rows = result["results"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ok = [r for r in rows if r.get("status") == 200]
    bad = [r for r in rows if r.get("status") != 200]
    ax.plot(
        [r.get("prompt_tokens") or r["target_tokens"] for r in ok],
        [r["latency_s"] for r in ok],
        "o-",
        label="HTTP 200",
    )
    if bad:
        ax.plot(
            [r["target_tokens"] for r in bad],
            [r["latency_s"] for r in bad],
            "x",
            color="tab:red",
            label="not served (status or error)",
        )
    ax.set_xscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("latency (s)")
    ax.set_title(f"needle latency - {result.get('model')}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    path = prefix.with_name(f"{prefix.name}_latency.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def render(result: dict[str, Any], prefix: str | Path) -> list[Path]:
    """Write the result's PNGs as `<prefix>_<plot>.png`; returns their paths. Needs matplotlib."""
    prefix = Path(prefix)
    kind = result.get("kind")
    if kind == "serve":
        return _serve_plots(result, prefix)
    if kind == "offline":
        return _offline_plots(result, prefix)
    if kind == "needle":
        return _needle_plots(result, prefix)
    raise ValueError(f"no plots for a result of kind {kind!r}")
