"""Speculative decoding: what a verify step costs against a plain decode step, and what drafting gives.

1. **Verify-step cost.** One engine (dummy weights of `--model-dir`, decode and verify CUDA graphs captured)
   holds `batch` requests that decode. Per batch size, `LLMEngine.step()` is timed over decode-only steps
   with drafting off, then with a drafter that proposes exactly k tokens every step (random tokens: almost
   never accepted, so every step verifies k + 1 positions). The ratio verify / plain at each k is the cost
   of speculating, and L / ratio the speed-up at an acceptance length of L tokens per step (the tokens a
   verify step emits: accepted drafts + 1). NVIDIA reports L = 3.45 at k = 7 for Nemotron 3 Super's MTP.
2. **End to end, batch 1.** A needle checkpoint (`--needle`, trained: its answers copy a code from the
   prompt, which n-gram drafting finds) answers the same prompts one at a time with and without n-gram
   drafting: output tokens per second, the acceptance length, and whether every answer is plain decoding's.
3. **Batch 64, speculation on vs off.** The step-cost engine generates the same 64 requests with drafting
   allowed at the default batch threshold (so it switches itself off above it) and off, alternated, the
   best of two runs each.

    python3 -m benchmarks.bench_spec_decode --git-sha SHA                    # Nano 30B-A3B, FP8 weights
    python3 -m benchmarks.bench_spec_decode --dry-run                        # the built-in tiny model, CPU

Writes benchmarks/results/spec_decode_<date>_<sha>.json (date, git sha, GPU, exact command) and a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import invocation
from hyserve import LLM, SamplingParams
from hyserve.bench.report import record, records_markdown, sanitize, stamp
from hyserve.engine.engine import LLMEngine
from hyserve.engine.request import Request
from hyserve.engine.speculative.speculation import DEFAULT_SPEC_MAX_BATCH

ROOT = Path(__file__).resolve().parents[1]
CFG_DIR = ROOT / "benchmarks" / "configs" / "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"
NEEDLE = ROOT / "models" / "hyserve-needle-h200"
ACCEPTANCE_LENGTH = 3.45  # tokens per verify step NVIDIA reports for Nemotron 3 Super's MTP at k = 7


class FixedDrafts:
    """Drafts exactly k random tokens (or what the request has room for) every step."""

    def __init__(self, k: int, vocab: int) -> None:
        self.k = k
        self.vocab = vocab
        self.rng = random.Random(0)

    def propose(self, req: Request, k: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(min(k, self.k))]

    def remove(self, request_id: str) -> None:
        pass


def _sync(eng: LLMEngine) -> None:
    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)


def timed_steps(eng: LLMEngine, n: int, settle: int = 3) -> float:
    """Milliseconds per `LLMEngine.step()` over n steps, after `settle` untimed ones."""
    for _ in range(settle):
        eng.step()
    _sync(eng)
    t = time.perf_counter()
    for _ in range(n):
        eng.step()
    _sync(eng)
    return (time.perf_counter() - t) / n * 1e3


def step_costs(a: argparse.Namespace, llm: LLM, out: dict[str, Any]) -> None:
    eng = llm.engine
    spec = eng.spec
    assert spec is not None
    vocab = eng.model_config.vocab_size
    rng = random.Random(1)
    for b in a.batches:
        # every step emits a token or more (random drafts are almost never accepted): enough for all points
        need = (len(a.ks) + 1) * (a.steps + 3) * 2 + 16
        sp = SamplingParams(max_tokens=min(need, a.max_seq_len - a.prompt_len - 1), ignore_eos=True)
        ids = [f"b{b}-{i}" for i in range(b)]
        for rid in ids:
            eng.add_request(rid, [rng.randrange(3, vocab) for _ in range(a.prompt_len)], sp)
        while any(r.num_computed < r.num_prompt_tokens for r in eng.requests.values()):
            eng.step()
        spec.max_batch = 0  # drafting off
        plain = timed_steps(eng, a.steps)
        spec.max_batch = b
        row = {"batch": b, "plain_ms": plain, "verify_ms": {}}
        for k in a.ks:
            spec.drafter = FixedDrafts(k, vocab)
            ms = timed_steps(eng, a.steps)
            row["verify_ms"][k] = ms
            out["records"].append(
                record(
                    f"verify step k={k}, batch {b} (ms)", ms, "ms", "plain decode step, same engine", plain
                )
            )
            print(f"batch {b}: plain {plain:.3f} ms, verify k={k} {ms:.3f} ms ({ms / plain:.3f}x)")
        out["steps"].append(row)
        for rid in ids:
            eng.abort(rid)
        while eng.has_unfinished():
            eng.step()
    k7 = [r for r in out["steps"] if r["batch"] == 1 and max(a.ks) in r["verify_ms"]]
    if k7:
        ratio = k7[0]["verify_ms"][max(a.ks)] / k7[0]["plain_ms"]
        out["records"].append(
            record(
                f"implied batch-1 speed-up at acceptance length {ACCEPTANCE_LENGTH}, k={max(a.ks)}",
                ACCEPTANCE_LENGTH / ratio,
                "x",
            )
        )


def on_off_batch64(a: argparse.Namespace, llm: LLM, out: dict[str, Any]) -> None:
    """The same requests at batch `a.wide`, drafting allowed (its switch decides) and off; tok/s each."""
    eng = llm.engine
    spec = eng.spec
    assert spec is not None
    vocab = eng.model_config.vocab_size
    rng = random.Random(2)
    prompts = [[rng.randrange(3, vocab) for _ in range(a.prompt_len)] for _ in range(a.wide)]
    sp = SamplingParams(max_tokens=a.wide_tokens, temperature=0.0, ignore_eos=True)
    got: dict[str, float] = {}
    spec.drafter = a.ngram
    for tag, max_batch in (("off", 0), ("on", DEFAULT_SPEC_MAX_BATCH)) * 2:  # alternated, best of two each
        spec.max_batch = max_batch
        t = time.perf_counter()
        outs = llm.generate(prompts, sp)
        _sync(eng)
        got[tag] = max(got.get(tag, 0.0), sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
    out["records"].append(
        record(
            f"batch {a.wide} generate, speculation allowed vs off (tok/s)",
            got["on"],
            "tok/s",
            "speculation off, same engine",
            got["off"],
        )
    )
    print(f"batch {a.wide}: speculation allowed {got['on']:.0f} tok/s, off {got['off']:.0f} tok/s")


def needle_end_to_end(a: argparse.Namespace, out: dict[str, Any]) -> None:
    from scripts import train_needle as T

    tok = T.tiny_tokenizer()
    prompts = [T.bench_prompt_ids(tok, n, d) for n in a.needle_lengths for d in (0.0, 0.5, 1.0)]
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": a.needle_k,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    res = {}
    for tag, extra in (("plain", {}), ("ngram", {"speculative_config": spec})):
        llm = LLM(str(a.needle), max_seq_len=max(a.needle_lengths) + 256, **extra)
        answers, tokens, t = [], 0, time.perf_counter()
        for p in prompts:  # batch 1
            o = llm.generate([p], greedy)[0]
            answers.append(o.token_ids)
            tokens += len(o.token_ids)
        res[tag] = (tokens / (time.perf_counter() - t), answers, llm.stats())
        llm.close()
    (plain_tps, plain_ans, _), (spec_tps, spec_ans, s) = res["plain"], res["ngram"]
    accept_len = 1 + s["spec_decode_num_accepted_tokens"] / max(1, s["spec_decode_num_drafts"])
    out["needle"] = {
        "checkpoint": str(Path(a.needle).name),
        "prompts": len(prompts),
        "same_answers": spec_ans == plain_ans,
        "acceptance_length": accept_len,
        "spec": {k: v for k, v in s.items() if k.startswith("spec_decode")},
    }
    out["records"].append(
        record(
            f"{Path(a.needle).name} batch-1 greedy, n-gram k={a.needle_k} (tok/s)",
            spec_tps,
            "tok/s",
            "plain decoding, same prompts",
            plain_tps,
        )
    )
    print(
        f"needle ({Path(a.needle).name}): plain {plain_tps:.1f} tok/s, n-gram {spec_tps:.1f} tok/s, "
        f"acceptance length {accept_len:.2f}, same answers: {spec_ans == plain_ans}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=CFG_DIR)
    ap.add_argument("--quantization", default="fp8", help="fp8, or none (the config's 16-bit weights)")
    ap.add_argument("--ks", default="1,2,3,5,7", help="draft lengths to time")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per point")
    ap.add_argument("--wide", type=int, default=64, help="batch of the on/off comparison (0: skip)")
    ap.add_argument("--wide-tokens", type=int, default=64)
    ap.add_argument("--needle", type=Path, default=NEEDLE, help="a trained needle checkpoint ('' to skip)")
    ap.add_argument("--needle-lengths", default="512,2048")
    ap.add_argument("--needle-k", type=int, default=4)
    ap.add_argument("--dry-run", action="store_true", help="the built-in tiny model on the CPU, few steps")
    ap.add_argument("--git-sha", default="")
    ap.add_argument("--result-dir", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    a.ks = [int(x) for x in a.ks.split(",")]
    a.batches = [int(x) for x in a.batches.split(",")]
    a.needle_lengths = [int(x) for x in a.needle_lengths.split(",")]
    out: dict[str, Any] = {
        **stamp("spec_decode", invocation(sys.executable), a.git_sha or None),
        "records": [],
        "steps": [],
    }
    a.max_seq_len = 4096
    spec = {"method": "ngram", "num_speculative_tokens": max(a.ks), "disable_by_batch_size": max(a.batches)}
    if a.dry_run:
        llm = LLM(device="cpu", max_seq_len=a.max_seq_len, speculative_config=spec)
    else:
        llm = LLM(
            model=str(a.model_dir),
            load_format="dummy",
            quantization=None if a.quantization == "none" else a.quantization,
            max_batch_size=max(max(a.batches), a.wide),
            max_seq_len=a.max_seq_len,
            speculative_config=spec,
        )
    assert llm.engine.spec is not None
    a.ngram = llm.engine.spec.drafter
    step_costs(a, llm, out)
    if a.wide:
        on_off_batch64(a, llm, out)
    llm.close()
    if str(a.needle):
        needle_end_to_end(a, out)
    path = Path(a.result_dir) / f"spec_decode_{dt.date.today()}_{out['git_sha']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sanitize(out), indent=1))
    table = records_markdown(out["records"])
    path.with_suffix(".md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
