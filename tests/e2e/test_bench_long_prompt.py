"""benchmarks/bench_long_prompt.py (long prompts per KV-cache dtype through LLM) on the CPU: the built-in tiny
model, short prompts, one fp8 run in its own process; the records it writes and the options it refuses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ["-m", "benchmarks.bench_long_prompt"]  # run from ROOT
TINY = [
    "--model-dir",
    "",
    "--mid-len",
    "200",
    "--long-len",
    "700",
    "--max-seq-len",
    "1024",
    "--max-num-tokens",
    "128",
    "--decode-tokens",
    "4",
    "--git-sha",
    "test",
]


@pytest.mark.parametrize(
    "entry, resolved", [("fp8", "float8_e4m3fn"), ("fp8+qk8", "float8_e4m3fn (QK8 prefill)")]
)
def test_bench_long_prompt_runs_each_dtype_in_its_own_process(
    tmp_path: Path, entry: str, resolved: str
) -> None:
    """An fp8 run (`fp8+qk8`: with the prefill's QK8 form selected, which only Hopper runs; the CPU path is
    the same) in its own process, its records and its token ids."""
    r = subprocess.run(
        [sys.executable, *SCRIPT, *TINY, "--kv-dtypes", entry, "--result-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    [path] = tmp_path.glob("long_prompt_*_test.json")
    doc = json.loads(path.read_text())
    assert {"date", "git_sha", "gpu", "command", "records", "results", "engine_options"} <= set(doc)
    assert doc["failures"] == []
    [res] = doc["results"]
    assert res["kv_dtype"] == entry and res["resolved_kv_dtype"] == resolved
    assert [run["prompt_tokens"] for run in res["runs"]] == [200, 700]
    for run in res["runs"]:
        assert run["output_tokens"] == 4 and 0 < run["ttft_s"] <= run["e2e_s"] and run["decode_tok_s"] > 0
        assert len(run["token_ids"]) == 4  # what the greedy agreement across dtypes compares
    # the first dtype is the reference of the others' prefill; no roofline without a GPU ceiling
    assert [rec["name"] for rec in doc["records"]] == [
        f"kv {resolved}: 200-token prompt, to first token (s)",
        f"kv {resolved}: 700-token prompt, to first token (s)",
    ]
    assert all(rec["reference_value"] is None for rec in doc["records"])


def test_bench_long_prompt_refuses_prompts_longer_than_max_seq_len(tmp_path: Path) -> None:
    args = [*TINY[:5], "1021", *TINY[6:]]  # --long-len 1021 + 4 output tokens > 1024
    r = subprocess.run(
        [sys.executable, *SCRIPT, *args, "--result-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 2 and "--long-len 1021 + --decode-tokens 4 exceeds --max-seq-len 1024" in r.stderr
    r = subprocess.run(
        [sys.executable, *SCRIPT, *TINY[:-4], "--decode-tokens", "1", "--result-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 2 and "--decode-tokens must be >= 2" in r.stderr
    assert not list(tmp_path.iterdir())


def test_greedy_agreement_and_its_records() -> None:
    from benchmarks.bench_long_prompt import build_records, greedy_agreement

    assert greedy_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == dict(prefix=1.0, same=1.0)
    assert greedy_agreement([1, 2, 9, 4], [1, 2, 3, 4]) == dict(prefix=0.5, same=0.75)
    assert greedy_agreement([7, 2, 3, 4], [1, 2, 3, 4]) == dict(prefix=0.0, same=0.75)
    assert greedy_agreement([1, 2], [1, 2, 3, 4]) == dict(
        prefix=0.5, same=0.5
    )  # a shorter output stops there
    assert greedy_agreement([], []) == dict(prefix=1.0, same=1.0)

    def result(dtype: str, tokens: list[int]) -> dict:
        run = dict(prompt_tokens=100, ttft_s=2.0, decode_tok_s=None, token_ids=tokens)
        return dict(resolved_kv_dtype=dtype, runs=[run])

    recs = build_records([result("bfloat16", [5, 6, 7, 8]), result("float8_e4m3fn", [5, 6, 0, 8])], None)
    by_name = {r["name"]: r for r in recs}
    prefix = by_name[
        "kv float8_e4m3fn: 100-token prompt, greedy tokens before the first difference (fraction)"
    ]
    same = by_name["kv float8_e4m3fn: 100-token prompt, greedy tokens equal position by position (fraction)"]
    assert (prefix["value"], same["value"]) == (0.5, 0.75)
    assert (
        prefix["reference"] == "kv bfloat16's greedy output, same prompt and weights"
        and prefix["ratio"] is None
    )
    # the first dtype is the reference: it gets no agreement records of its own
    assert not any(r["name"].startswith("kv bfloat16") and "greedy" in r["name"] for r in recs)
