"""On CUDA: after the warm-up, a mixed workload compiles no Triton kernel (skipped without CUDA).

A fresh kernel-cache directory makes the warm-up compile everything itself; the workload then mixes
what serving sees: random lengths (1 token to several chunks), shared prefixes (prefix-cache hits),
prompts longer than the token budget (chunked prefill), decode batches of many sizes (graphs with
padding and eager), and every sampling path."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from hyserve import LLM, SamplingParams
from hyserve.model.tiny import make_tiny

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def mixed_workload(llm: LLM, vocab: int, *, n: int = 48, seed: int = 0) -> None:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(300)]
    budget = llm.engine.config.scheduler.max_num_tokens
    params = [
        SamplingParams(max_tokens=rng.randrange(1, 24), temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, top_k=5, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.5, min_p=0.1, logprobs=3, ignore_eos=True),
    ]
    e = llm.engine
    for i in range(n):
        kind = i % 4
        if kind == 0:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 400))]
        elif kind == 1:
            prompt = shared[: rng.randrange(100, 300)] + [
                rng.randrange(3, vocab) for _ in range(rng.randrange(1, 50))
            ]
        elif kind == 2:
            prompt = [rng.randrange(3, vocab) for _ in range(budget + rng.randrange(1, 200))]
        else:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 9))]
        e.add_request(f"w{i}", prompt, params[rng.randrange(len(params))])
        for _ in range(rng.randrange(0, 3)):  # arrivals interleave with steps: mixed prefill + decode
            e.step()
    while e.has_unfinished():
        e.step()


def late_variants(llm: LLM) -> list[str]:
    """Each variant compiled after ready, next to the warm-up's variants of the same kernel."""
    ev = llm.engine.jit.events
    out = []
    for late in {e.specialization: e for e in ev if e.after_ready}.values():
        warm = {e.specialization for e in ev if not e.after_ready and e.kernel == late.kernel}
        out.append(f"LATE {late.kernel}: {late.specialization}\n  WARM: " + "\n  WARM: ".join(sorted(warm)))
    return out


@pytest.mark.parametrize(
    "variant, extra, kv",
    [
        ("dense", {}, {}),
        # MoE decode from CUDA graphs, every token bucket warmed; the step cost model calibrated and sizing
        # chunks
        ("moe", {"max_step_ms": 20.0}, {}),
        # an fp8 KV cache: the start-up scale calibration (16-bit scratch cache) and the fp8 attention
        # variants
        ("dense", {}, {"dtype": "fp8"}),
    ],
)
def test_no_jit_after_warmup_tiny(tmp_path: Path, variant: str, extra: dict, kv: dict) -> None:
    d = make_tiny(tmp_path / "tiny", variant=variant)
    opts = dict(
        device="cuda",
        dtype="bfloat16",
        max_seq_len=4096,
        max_batch_size=40,
        max_num_tokens=512,
        cache_dir=str(tmp_path / "cache"),
        kv_cache_config={"tokens_per_block": 16, "free_gpu_memory_fraction": 0.2, **kv},
        **extra,
    )
    llm = LLM(str(d), **opts)
    rep = llm.engine.warmup_report
    assert rep is not None and not rep.failed
    assert llm.engine.runner.graphs is not None and llm.engine.runner.mixed_graphs is not None
    assert llm.engine.scheduler.cost is not None  # the step-time target is on by default on CUDA
    mixed_workload(llm, llm.engine.model_config.vocab_size)
    assert not late_variants(llm), late_variants(llm)
    # the profiled activation headroom held: no allocation had to free the allocator's cache and retry
    assert llm.engine.stats()["cuda_alloc_retries"] == 0


def _warmup_in_fresh_process(model_dir: Path, opts: dict) -> dict:
    """Start an engine in a new interpreter (nothing compiled in memory) and return its warm-up report."""
    script = (
        "import json, sys; from hyserve import LLM\n"
        "llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))\n"
        "r = llm.engine.warmup_report\n"
        "print(json.dumps({'compiled': r.compiled, 'loaded': r.loaded, 'failed': r.failed,"
        " 's': r.seconds}))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", script, str(model_dir), json.dumps(opts)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_restart_loads_every_variant_from_the_cache_dir(tmp_path: Path) -> None:
    d = make_tiny(tmp_path / "tiny", variant="dense")
    opts = dict(
        device="cuda",
        dtype="bfloat16",
        max_seq_len=4096,
        max_batch_size=40,
        max_num_tokens=512,
        cache_dir=str(tmp_path / "cache"),
        kv_cache_config={"tokens_per_block": 16, "free_gpu_memory_fraction": 0.2},
    )
    cold = _warmup_in_fresh_process(d, opts)
    assert cold["compiled"] > 0 and not cold["failed"], cold
    warm = _warmup_in_fresh_process(d, opts)
    assert warm["compiled"] == 0 and warm["loaded"] == cold["compiled"] + cold["loaded"], (cold, warm)


def test_structured_outputs_compile_nothing_after_ready(tmp_path: Path) -> None:
    """A JSON-schema request and a choice request, alone and beside free rows, after the warm-up: the token
    mask kernel was compiled by it (its variant depends on the vocabulary only)."""
    pytest.importorskip("xgrammar")
    from hyserve.engine.sampling_params import StructuredOutputsParams

    d = make_tiny(tmp_path / "tiny", variant="dense")
    llm = LLM(
        str(d),
        device="cuda",
        dtype="bfloat16",
        max_seq_len=2048,
        max_batch_size=8,
        max_num_tokens=512,
        cache_dir=str(tmp_path / "cache"),
        kv_cache_config={"free_gpu_memory_fraction": 0.2},
    )
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = [
        SamplingParams(
            max_tokens=24, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema)
        ),
        SamplingParams(
            max_tokens=8, temperature=0.8, structured_outputs=StructuredOutputsParams(choice=["a", "b"])
        ),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    ]
    llm.generate(["x"], params[:1])
    llm.generate(["x", "y", "z"], params)
    assert not late_variants(llm), late_variants(llm)
