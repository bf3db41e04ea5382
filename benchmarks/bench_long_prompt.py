"""Long prompts through `hyserve.LLM`, per KV-cache dtype in one run (is an fp8 KV cache as fast as it is
small?), and the 1M-token prompt alone.

For each `--kv-dtypes` entry (default `auto,fp8`: the model's 16-bit dtype, then e4m3; `fp8+qk8`: e4m3 with
the prefill attention's QK8 form, not yet the default), a fresh process builds the engine with the long-prompt
report's sizing (`max_seq_len 1048576`, `max_num_tokens 16384`, `max_batch_size 8`, 64-token blocks, a float16
Mamba state with stochastic rounding; block reuse off unless `--block-reuse`) on random weights of
`--model-dir` (default the Nano 9B v2 architecture) and runs, one at a time: a `--mid-len` (131,072) token
prompt, then a `--long-len` (1,040,000) token prompt, each with `--decode-tokens` greedy output tokens. Per
prompt: the time to its first token (the prefill, end to end) and the decode rate after it, against the bytes
roofline of one decode step at that context (weights + the KV of the context + the Mamba state read and
written) at the streaming-read ceiling measured in the same run. Records compare each dtype's prefill with the
first dtype's (fp8 no slower than bf16 is the bar) and report each later dtype's greedy agreement with the
first's output (same prompt, same seeded dummy weights).

    python -m benchmarks.bench_long_prompt --git-sha SHA                          # H200: ~3 min per dtype
    python -m benchmarks.bench_long_prompt --model-dir '' --mid-len 300 --long-len 900 --max-seq-len 1024 \
        --max-num-tokens 128 --decode-tokens 4                                   # CPU smoke (the tiny model)

Writes benchmarks/results/long_prompt_<date>_<sha>.json (date, git sha, GPU, exact command, every run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

from benchmarks import invocation  # noqa: E402
from hyserve.bench.report import format_table, record, sanitize, stamp  # noqa: E402

CFG_DIR = ROOT / "benchmarks" / "configs" / "NVIDIA-Nemotron-Nano-9B-v2"


def engine_options(a: argparse.Namespace, kv_dtype: str) -> dict[str, Any]:
    """The long-prompt YAML's sizing (block reuse off unless --block-reuse: random prompts never hit)."""
    return dict(
        max_seq_len=a.max_seq_len,
        max_num_tokens=a.max_num_tokens,
        max_batch_size=a.max_batch_size,
        enable_chunked_prefill=True,
        cuda_graph_config={"enable_padding": True, "max_batch_size": a.max_batch_size},
        kv_cache_config={
            "dtype": kv_dtype,
            "free_gpu_memory_fraction": 0.8,
            "enable_block_reuse": a.block_reuse,
            "tokens_per_block": 64,
            "mamba_ssm_cache_dtype": "float16",
            "mamba_ssm_stochastic_rounding": True,
            "mamba_ssm_philox_rounds": 5,
            "mamba_state_config": {
                "periodic_snapshot_interval": 256,
                "additional_snapshot_offsets_from_end": [0],
            },
        },
    )


QK8_SUFFIX = "+qk8"  # a --kv-dtypes entry "fp8+qk8": an fp8 cache prefilled by the QK8 form


def run_child(a: argparse.Namespace, kv_dtype: str) -> dict[str, Any]:
    """One engine, the two prompts in turn (this process only). A `+qk8` entry runs an fp8 cache's prefill on
    the Gluon kernel's QK8 form (`gluon_attention._PREFILL_SM90_QK8`: e4m3 products for S) instead of the
    default converter form."""
    import random

    from benchmarks.roofline import decode_step_bytes
    from hyserve import LLM, SamplingParams

    label = kv_dtype
    form = ""
    if kv_dtype.endswith(QK8_SUFFIX):
        import hyserve.kernels.gluon_attention as ga

        kv_dtype = kv_dtype.removesuffix(QK8_SUFFIX)
        ga._PREFILL_SM90_FP8 = dict(ga._PREFILL_SM90_QK8)
        form = " (QK8 prefill)"
    model = a.model_dir or None
    t0 = time.monotonic()
    llm = LLM(
        model,
        load_format="dummy" if model else "auto",
        log=lambda s: print(s, flush=True),
        **engine_options(a, kv_dtype),
    )
    startup_s = time.monotonic() - t0
    cfg = llm.engine.model_config
    vocab = cfg.vocab_size
    rng = random.Random(a.seed)
    runs = []
    for n in (a.mid_len, a.long_len):
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        out = llm.generate(
            [ids], SamplingParams(max_tokens=a.decode_tokens, temperature=0.0, ignore_eos=True)
        )[0]
        ttft, e2e = out.metrics["time_to_first_token_s"], out.metrics["e2e_latency_s"]
        n_out = len(out.token_ids)
        decode = (n_out - 1) / (e2e - ttft) if n_out > 1 and e2e > ttft else None
        # one batch-1 decode step's bytes at this context, with the engine's cache dtypes
        runs.append(
            dict(
                prompt_tokens=n,
                output_tokens=n_out,
                ttft_s=ttft,
                e2e_s=e2e,
                decode_tok_s=decode,
                prefill_tok_s=n / ttft,
                decode_step_bytes=decode_step_bytes(cfg, 1, n),
                token_ids=list(out.token_ids),
            )
        )
        print(
            f"  kv {kv_dtype}: {n} tokens: first token after {ttft:.2f} s, decode {decode or 0:.1f} tok/s",
            flush=True,
        )
    return dict(
        kv_dtype=label,
        resolved_kv_dtype=str(cfg.attention_cache_spec().dtype).replace("torch.", "") + form,
        startup_s=startup_s,
        runs=runs,
        config_name=getattr(cfg, "name", ""),
        kv_bytes_per_token=cfg.kv_bytes_per_token,
        state_bytes_per_sequence=cfg.state_bytes_per_sequence,
    )


def greedy_agreement(tokens: list[int], reference: list[int]) -> dict[str, float]:
    """How far two greedy outputs of the same prompt agree: `prefix`, the fraction of the reference's tokens
    before the first difference (1.0: identical); `same`, the fraction of positions that hold the same token
    (after a first difference the two continue from different text, so this is the looser figure)."""
    n = len(reference)
    if n == 0:
        return dict(prefix=1.0, same=1.0)
    first = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), n))
    same = sum(a == b for a, b in zip(tokens, reference))
    return dict(prefix=first / n, same=same / n)


def build_records(results: list[dict[str, Any]], read_bw: float | None) -> list[dict[str, Any]]:
    """Per dtype and prompt: the time to the first token (against the first dtype's), the decode rate
    (against its bytes roofline), and, for every dtype after the first, its greedy agreement with the first
    dtype's output on the same prompt and weights (reported: random weights give near-flat logits, where
    e4m3 rounding flips close calls)."""
    recs = []
    base = results[0] if results else None
    for r in results:
        for i, run in enumerate(r["runs"]):
            n = run["prompt_tokens"]
            label = f"kv {r['resolved_kv_dtype']}: {n}-token prompt"
            ref = base["runs"][i]["ttft_s"] if base is not None and r is not base else None
            recs.append(
                record(
                    f"{label}, to first token (s)",
                    run["ttft_s"],
                    "s",
                    f"kv {base['resolved_kv_dtype']}, same run" if ref else None,
                    ref,
                )
            )
            if ref and "token_ids" in run and "token_ids" in base["runs"][i]:
                agree = greedy_agreement(run["token_ids"], base["runs"][i]["token_ids"])
                what = f"kv {base['resolved_kv_dtype']}'s greedy output, same prompt and weights"
                recs.append(
                    record(
                        f"{label}, greedy tokens before the first difference (fraction)",
                        agree["prefix"],
                        "fraction",
                        what,
                        None,
                    )
                )
                recs.append(
                    record(
                        f"{label}, greedy tokens equal position by position (fraction)",
                        agree["same"],
                        "fraction",
                        what,
                        None,
                    )
                )
            if run["decode_tok_s"] and read_bw:
                recs.append(
                    record(
                        f"{label}, batch-1 decode after it (tok/s)",
                        run["decode_tok_s"],
                        "tok/s",
                        "bytes roofline (weights + KV of the context + Mamba state) at the read "
                        "ceiling measured this run",
                        read_bw / run["decode_step_bytes"],
                    )
                )
    return recs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model-dir", default=str(CFG_DIR), help="config-only directory ('' = the built-in tiny model)"
    )
    ap.add_argument("--kv-dtypes", default="auto,fp8")
    ap.add_argument("--mid-len", type=int, default=131072)
    ap.add_argument("--long-len", type=int, default=1_040_000)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=1048576)
    ap.add_argument("--max-num-tokens", type=int, default=16384)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--block-reuse", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--git-sha", default="")
    ap.add_argument("--result-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--timeout-s", type=float, default=560, help="per dtype's process")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one dtype, print JSON
    a = ap.parse_args(argv)
    for name in ("mid_len", "long_len"):
        if getattr(a, name) + a.decode_tokens > a.max_seq_len:
            ap.error(
                f"--{name.replace('_', '-')} {getattr(a, name)} + --decode-tokens {a.decode_tokens} exceeds "
                f"--max-seq-len {a.max_seq_len}"
            )
    if a.decode_tokens < 2:
        ap.error("--decode-tokens must be >= 2 (the decode rate is timed after the first token)")
    if a.child is not None:
        print("RESULT " + json.dumps(run_child(a, a.child)), flush=True)
        return 0

    import torch

    head = stamp(
        "long_prompt",
        invocation() if argv is None else ["python", "-m", "benchmarks.bench_long_prompt", *argv],
        a.git_sha or None,
    )
    read_bw = None
    ceilings = None
    if torch.cuda.is_available():
        from benchmarks.roofline import measure_ceilings

        c = measure_ceilings("cuda", matmul_shapes=((8192, 8192, 8192),))
        ceilings, read_bw = c.to_dict(), c.read_bw
        print(c.summary(), flush=True)
        torch.cuda.empty_cache()
    results, failures = [], []
    # the child runs this module by name: the repository root (the parent of benchmarks/) goes on its path
    child_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    for kv in [d.strip() for d in a.kv_dtypes.split(",") if d.strip()]:
        args = [
            sys.executable,
            "-m",
            "benchmarks.bench_long_prompt",
            *(argv if argv is not None else sys.argv[1:]),
            "--child",
            kv,
        ]
        try:
            p = subprocess.run(
                args,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=a.timeout_s,
                env=child_env,
            )
            out, status = p.stdout, f"exit status {p.returncode}"
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            status = f"timed out after {a.timeout_s:.0f} s"
        print(
            "\n".join(ln for ln in out.splitlines() if "warm-up [" not in ln and not ln.startswith("RESULT "))
        )
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            failures.append(f"kv {kv}: no result ({status})")
            continue
        results.append(json.loads(line[len("RESULT ") :]))
    recs = build_records(results, read_bw)
    result = {
        **head,
        "model": Path(a.model_dir).name if a.model_dir else "hyserve-tiny",
        "ceilings": ceilings,
        "engine_options": engine_options(a, "<kv_dtype>"),
        "results": results,
        "failures": failures,
        "records": recs,
    }
    out_dir = Path(a.result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"long_prompt_{dt.date.today().isoformat()}_{head['git_sha']}.json"
    path.write_text(json.dumps(sanitize(result), indent=2) + "\n")
    print(
        format_table(
            ["record", "value", "unit", "reference", "ratio"],
            [[r["name"], r["value"], r["unit"], r["reference"] or "", r["ratio"]] for r in recs],
        )
    )
    for f in failures:
        print("FAILED", f)
    print(f"wrote {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
