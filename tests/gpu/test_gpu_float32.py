"""float32 on the GPU at Nemotron Nano 9B v2 width (skipped without CUDA): the engine starts (warm-up and
decode graphs included: every kernel variant compiles within the GPU's shared memory) and generates, and
its prompt logprobs match the CPU reference path on the same random weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hyserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu
NANO9B = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "NVIDIA-Nemotron-Nano-9B-v2"


def _few_layers(tmp_path: Path) -> str:
    """The Nano 9B v2 config cut to five layers (Mamba, MLP, Mamba, attention, MLP) at full width."""
    raw = json.loads((NANO9B / "config.json").read_text())
    raw.update(hybrid_override_pattern="M-M*-", num_hidden_layers=5)
    d = tmp_path / "nano9b-width-5-layers"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    return str(d)


def test_nano9b_width_float32_starts_and_generates_on_cuda(tmp_path: Path) -> None:
    d = _few_layers(tmp_path)
    # a 200-token prompt in 128-token chunks: prefill, an extend over cached tokens and the SSD scan from
    # an initial state; then decodes (from CUDA graphs) beside a short prompt's prefill
    prompts = [[1] + [(7 * i) % 100_000 + 3 for i in range(199)], [1, 5, 9, 13, 200, 17, 4]]
    p = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    opts = dict(
        load_format="dummy",
        dummy_init="host",  # the same weights on the GPU and the CPU
        dtype="float32",
        max_seq_len=1024,
        max_batch_size=2,
        max_num_tokens=128,
    )
    gpu = LLM(d, device="cuda", kv_cache_config={"free_gpu_memory_fraction": 0.3}, **opts)
    assert gpu.config.dtype == "float32"
    out = gpu.generate(prompts, p)
    for o in out:
        assert len(o.token_ids) == 5 and all(math.isfinite(lp.logprob) for lp in o.logprobs or [])
    cpu = LLM(d, device="cpu", kv_cache_config={"max_gpu_total_bytes": 2 * 2**30}, **opts).generate(
        prompts, p
    )
    for g, c in zip(out, cpu):
        assert g.prompt_logprobs is not None and c.prompt_logprobs is not None
        got = [lp.logprob for lp in g.prompt_logprobs[1:]]
        want = [lp.logprob for lp in c.prompt_logprobs[1:]]
        assert len(got) == len(want) == len(g.prompt_token_ids) - 1
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3
