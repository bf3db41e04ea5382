"""Throughput sweep against the decode-step roofline: reads the `hyserve bench serve` results of
scripts/gpu_serve_check.sh sweep (serve_sweep_in<I>_out<O>_c<C>.json), and for each point quotes

  * the median inter-token latency (a typical decode step; TPOT means also carry the steps where other
    requests' prefill chunks ran) against the roofline step time of a batch of min(C, prompts) sequences
    at the mean decode context (I + O/2 tokens): weights + Mamba states + K/V read (benchmarks/roofline.py);
  * output throughput against that batch's roofline decode throughput (this one also pays for prefill).

The rooflines are drawn at the bytes-read ceiling measured on the GPU that served (`--ceilings`: a JSON
from `benchmarks/roofline.py --out` or a benchmark JSON of a run on that GPU; without it, measured here
when a GPU is present), and every record also carries the ratio at the H200's published 4.8 TB/s.
Writes benchmarks/results/serve_sweep_roofline.json (+ .md, and a PNG when matplotlib is present).
`--quantization fp8` counts FP8 weight bytes (a server run with `--quantization fp8`); each `--published
C:TOK_S:LABEL` adds another engine's published throughput at concurrency C to the plot and the JSON.

    python3 -m benchmarks.sweep_roofline [--results benchmarks/results] [--git-sha SHA] [--ceilings FILE]
        [--model-dir DIR] [--quantization fp8] [--published "1024:15828:vLLM, H200"]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from benchmarks import invocation  # noqa: E402
from benchmarks.roofline import (  # noqa: E402
    Ceilings,
    active_decode_step_ms,
    ceiling_fields,
    decode_step_ms,
    load_ceilings,
    measure_ceilings,
    num_moe_layers,
)
from hyserve.bench.report import record, records_markdown  # noqa: E402
from hyserve.model.nemotron_h.config import HybridModelConfig  # noqa: E402
from hyserve.model.quant_config import QuantConfig  # noqa: E402

CFG_DIR = ROOT / "benchmarks" / "configs" / "NVIDIA-Nemotron-Nano-9B-v2"
NAME = re.compile(r"serve_sweep_in(\d+)_out(\d+)_c(\d+)\.json$")


def point_records(cfg: HybridModelConfig, path: Path, ceilings: Ceilings | None = None) -> list[dict] | None:
    m = NAME.search(path.name)
    if m is None:
        return None
    i, o, c = (int(v) for v in m.groups())
    res = json.loads(path.read_text())
    run = res["points"][0]["reps"][0]
    if run["completed"] == 0 or run.get("median_itl_ms") is None:
        return []
    batch = min(c, res["config"]["dataset"]["num_prompts"])
    context = i + o / 2
    itl, tps = run["median_itl_ms"], run["output_throughput"]
    tag = f"in {i} out {o} concurrency {c}"
    # MoE: the experts a batch of this size touches under uniform routing, not every expert
    step_ms = active_decode_step_ms if num_moe_layers(cfg) else decode_step_ms
    # the ITL is a time: its ratios are roofline / measured, so 1.0 is at the roofline
    step = {
        **record(f"{tag}: median ITL (ms)", itl, "ms", f"roofline decode step, batch {batch}"),
        **ceiling_fields(
            "read", ceilings, itl, lambda p: step_ms(cfg, batch, context, p.read_bw), time_like=True
        ),
    }
    out = {
        **record(
            f"{tag}: output throughput (tok/s)", tps, "tok/s", f"roofline decode throughput, batch {batch}"
        ),
        **ceiling_fields(
            "read", ceilings, tps, lambda p: batch / step_ms(cfg, batch, context, p.read_bw) * 1e3
        ),
    }
    return [
        step,
        {**record(f"{tag}: mean TPOT (ms)", run["mean_tpot_ms"], "ms", "none"), "ceiling": None},
        out,
        {**record(f"{tag}: mean TTFT (ms)", run["mean_ttft_ms"], "ms", "none"), "ceiling": None},
    ]


def published_point(text: str) -> dict:
    """ "C:TOK_S:LABEL" (an argparse type) -> {"concurrency", "output_tok_s", "label"}."""
    parts = text.split(":", 2)
    try:
        c, tps = int(parts[0]), float(parts[1])
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"--published: {text!r} is not CONCURRENCY:TOK_S[:LABEL]") from None
    if c < 1 or tps <= 0:
        raise argparse.ArgumentTypeError(f"--published: {text!r} needs a concurrency >= 1 and tok/s > 0")
    return {"concurrency": c, "output_tok_s": tps, "label": parts[2] if len(parts) > 2 else "published"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--git-sha", default="unknown")
    ap.add_argument("--model-dir", type=Path, default=CFG_DIR, help="the served architecture's config dir")
    ap.add_argument(
        "--ceilings",
        type=Path,
        default=None,
        help="the serving GPU's measured ceilings (benchmarks/roofline.py --out, or a benchmark JSON)",
    )
    ap.add_argument("--quantization", choices=("fp8",), default=None, help="the rooflines count FP8 weights")
    ap.add_argument(
        "--published",
        type=published_point,
        action="append",
        default=[],
        metavar="C:TOK_S:LABEL",
        help="another engine's published output throughput at concurrency C, plotted beside the sweep",
    )
    args = ap.parse_args()
    cfg = HybridModelConfig.from_dict(json.loads((args.model_dir / "config.json").read_text()))
    if args.quantization == "fp8":  # per-channel FP8, as `--quantization fp8` loads it
        cfg = cfg.with_quant(QuantConfig(method="online", scheme="channel"))
    files = sorted(
        args.results.glob("serve_sweep_in*_out*_c*.json"),
        key=lambda p: tuple(int(v) for v in NAME.search(p.name).groups()),
    )  # type: ignore[union-attr]
    if not files:
        raise SystemExit(f"no serve_sweep_in*_out*_c*.json under {args.results}")
    if args.ceilings is not None:
        ceilings: Ceilings | None = load_ceilings(args.ceilings)
    elif torch.cuda.is_available():
        ceilings = measure_ceilings("cuda")
    else:
        ceilings = None
        print(
            "sweep_roofline: no --ceilings and no GPU to measure them: ratios at the published peak only",
            file=sys.stderr,
        )
    records: list[dict] = []
    gpu = "unknown"
    for f in files:
        records += point_records(cfg, f, ceilings) or []
        gpu = json.loads(f.read_text()).get("gpu", gpu)
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "git_sha": args.git_sha,
        "gpu": gpu,
        "command": " ".join(invocation(sys.executable)),
        "model": f"{args.model_dir.name} architecture, random weights",
        "weights": args.quantization or "bf16",
        "ceilings": ceilings.to_dict() if ceilings is not None else None,
        "records": records,
        "published": args.published,
    }
    (args.results / "serve_sweep_roofline.json").write_text(json.dumps(result, indent=2))
    table = records_markdown(records, "point")
    (args.results / "serve_sweep_roofline.md").write_text(
        f"# throughput sweep vs roofline ({gpu}, {args.git_sha})\n\n{table}\n"
    )
    print(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(11, 4))

    def series(shape: str, what: str) -> tuple[list[int], list[dict]]:
        rows = [r for r in records if r["name"].startswith(shape + " ") and what in r["name"]]
        return [int(r["name"].split("concurrency ")[1].split(":")[0]) for r in rows], rows

    for shape in sorted({r["name"].split(" concurrency")[0] for r in records}):
        c, rows = series(shape, "output throughput")
        line = ax_t.plot(c, [r["value"] for r in rows], marker="o", label=f"{shape}: measured")[0]
        measured = all(r["reference_value"] is not None for r in rows)
        ax_t.plot(
            c,
            [r["reference_value" if measured else "published_reference_value"] for r in rows],
            ls="--",
            color=line.get_color(),
            label=f"{shape}: decode roofline{'' if measured else ' (published peak)'}",
        )
        c, rows = series(shape, "median ITL")
        ax_r.plot(
            c,
            [r["ratio"] if r["ratio"] is not None else r["ratio_to_published"] for r in rows],
            marker="o",
            label=shape,
        )
    for p in args.published:
        ax_t.plot([p["concurrency"]], [p["output_tok_s"]], marker="*", ms=12, ls="none", label=p["label"])
    for ax in (ax_t, ax_r):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.set_ylabel("output tokens/s")
    ax_t.set_title("output throughput")
    ax_r.set_ylabel("roofline step / median ITL")
    ax_r.set_ylim(0, 1.05)
    ax_r.set_title("decode step vs its roofline")
    weights = "FP8 weights" if args.quantization else "bf16"
    fig.suptitle(f"{args.model_dir.name} arch, {weights}, {gpu} ({args.git_sha})", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.results / "serve_sweep_roofline.png", dpi=120)


if __name__ == "__main__":
    main()
