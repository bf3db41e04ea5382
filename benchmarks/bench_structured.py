"""Decode throughput under a JSON-schema constraint against the same run unconstrained (structured outputs,
docs/architecture.md), Nemotron Nano 9B v2 architecture with random weights, at batch 1 and 64.

The config-only checkpoint has no tokenizer, so the grammar runs over a synthetic 131,072-token byte
vocabulary shaped like a BPE one (all 256 bytes, then deterministic 2-8 character pieces of JSON-ish text:
words with and without a leading space, digits, and in 5% of them one JSON punctuation character:
`--punctuation`), and the outputs are token ids. The schema is an
array of at least 1,000 objects (integer, bounded string, boolean, enum), so it cannot complete inside the
run: every decode step is constrained. Each (batch, constrained) case runs `rounds` times after a warm-up
run; the median is reported, with the ratio constrained / unconstrained (the target is >= 0.95).

    python -m benchmarks.bench_structured [--tokens 256] [--rounds 3] [--git-sha SHA]
Writes benchmarks/results/structured_<date>_<sha>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from benchmarks import invocation  # noqa: E402
from hyserve.bench.report import git_sha  # noqa: E402
from hyserve.engine.llm import LLM  # noqa: E402
from hyserve.engine.sampling.structured_output import StructuredOutputs  # noqa: E402
from hyserve.engine.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

CFG_DIR = ROOT / "benchmarks" / "configs" / "NVIDIA-Nemotron-Nano-9B-v2"
SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "additionalProperties": False,
        "required": ["id", "name", "ok", "kind"],
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 24},
            "ok": {"type": "boolean"},
            "kind": {"enum": ["alpha", "beta", "gamma"]},
        },
    },
}


class SyntheticVocab:
    """The tokenizer interface StructuredOutputs reads (vocab_size, is_special, token_bytes,
    eos_token_ids)."""

    def __init__(
        self, vocab_size: int, specials: int = 16, eos: int = 2, seed: int = 0, punctuation: float = 0.05
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = (eos,)
        self._specials = specials
        rng = random.Random(seed)
        letters = "etaoinshrdlucmfwypvbgkqjxz" * 3 + "ETAOINSHRDLU" + "0123456789"
        punct = '{}[]":,_-. '
        seen: set[bytes] = set()
        pieces: list[bytes] = [bytes([b]) for b in range(256)]
        seen.update(pieces)
        while len(pieces) < vocab_size - specials:
            n = rng.choice((2, 2, 3, 3, 3, 4, 4, 5, 6, 7, 8))
            # `punctuation`: the share of pieces holding JSON punctuation (they are what a grammar must check
            # token by token; in real BPE vocabularies a few percent)
            body = [rng.choice(letters) for _ in range(n)]
            if rng.random() < punctuation:
                body[rng.randrange(n)] = rng.choice(punct)
            s = ("" if rng.random() < 0.4 else " ") + "".join(body)
            b = s.encode()
            if b not in seen:
                seen.add(b)
                pieces.append(b)
        self._pieces = pieces

    def is_special(self, i: int) -> bool:
        return i < self._specials

    def token_bytes(self, i: int) -> bytes:
        return b"" if i < self._specials else self._pieces[i - self._specials]


def run(llm: LLM, batch: int, tokens: int, constrained: bool, seed: int) -> tuple[float, int]:
    """One generate call of `batch` prompts: (decode tokens/s, output tokens)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [[1] + torch.randint(16, 131072, (63,), generator=g).tolist() for _ in range(batch)]
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = [
        SamplingParams(
            max_tokens=tokens, temperature=1.0, ignore_eos=True, seed=seed * 1000 + i, structured_outputs=so
        )
        for i in range(batch)
    ]
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    dt_s = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    return n / dt_s, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--git-sha", default="")
    ap.add_argument(
        "--punctuation",
        type=float,
        default=0.05,
        help="share of synthetic vocabulary pieces holding JSON punctuation",
    )
    args = ap.parse_args()
    llm = LLM(
        str(CFG_DIR),
        load_format="dummy",
        max_seq_len=2048,
        max_batch_size=64,
        max_num_tokens=8192,
        kv_cache_config={"enable_block_reuse": False, "free_gpu_memory_fraction": 0.5},
    )
    eng = llm.engine
    vocab = SyntheticVocab(eng.model_config.vocab_size, punctuation=args.punctuation)
    t = time.perf_counter()
    eng.structured = StructuredOutputs(vocab, eng.model_config.vocab_size)
    eng.structured.compiler.compile(StructuredOutputsParams(json=SCHEMA))
    setup_s = time.perf_counter() - t
    print(f"vocabulary + grammar compile: {setup_s:.2f}s")
    host = {"fill_s": 0.0, "fills": 0}
    fill = eng.structured.fill_bitmask

    def timed_fill(ids: list[str]):  # noqa: ANN202
        t0 = time.perf_counter()
        m = fill(ids)
        host["fill_s"] += time.perf_counter() - t0
        host["fills"] += m is not None
        return m

    eng.structured.fill_bitmask = timed_fill  # type: ignore[method-assign]
    records = []
    for batch in [int(b) for b in args.batches.split(",")]:
        res = {}
        for constrained in (False, True):
            run(llm, batch, 16, constrained, seed=99)  # warm-up of this path
            rates = []
            host["fill_s"], host["fills"] = 0.0, 0
            for r in range(args.rounds):
                tps, n = run(llm, batch, args.tokens, constrained, seed=r)
                assert n == batch * args.tokens, n
                rates.append(tps)
            res[constrained] = rates
            fill_ms = 1e3 * host["fill_s"] / max(1, host["fills"])
            res[f"fill_ms_{constrained}"] = fill_ms
            print(
                f"batch {batch:3d} {'json-schema' if constrained else 'free      '}: "
                + ", ".join(f"{x:8.1f}" for x in rates)
                + f" tok/s (bitmask fill {fill_ms:.2f} ms per step)"
            )
        ratio = statistics.median(res[True]) / statistics.median(res[False])
        print(f"batch {batch:3d} ratio constrained / free: {ratio:.3f}")
        records.append(
            {
                "batch": batch,
                "tokens_per_request": args.tokens,
                "free_tok_s": res[False],
                "constrained_tok_s": res[True],
                "free_median": statistics.median(res[False]),
                "constrained_median": statistics.median(res[True]),
                "ratio": ratio,
                "bitmask_fill_ms_per_step": res["fill_ms_True"],
            }
        )
    sha = git_sha(args.git_sha)
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "git_sha": sha,
        "gpu": torch.cuda.get_device_name(),
        "command": " ".join(invocation(sys.executable)),
        "model": (
            "NVIDIA-Nemotron-Nano-9B-v2 architecture, random weights, bf16; synthetic 131072-token vocab"
        ),
        "schema": SCHEMA,
        "vocab_punctuation_share": args.punctuation,
        "setup_seconds": setup_s,
        "async_scheduling": eng.config.async_scheduling,
        "records": records,
    }
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"structured_{dt.date.today().isoformat()}_{sha}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
