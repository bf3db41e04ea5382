"""Greedy decode of a transformers model against hyserve's through the normal loader (`LLM` on the
directory `save_pretrained` wrote, float32 on the CPU): the same tokens, and each chosen token's logprob
within 1e-3 of transformers'. Again with prefix caching and small prefill chunks: the same tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hyserve import LLM, SamplingParams
from hyserve.kernels import ops
from hyserve.model import registry

PROMPTS = [
    [5, 17, 33, 2, 9, 41, 8, 100, 7, 3, 250, 11],
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
]
NEW_TOKENS = 8
# prefix caching + chunked prefill: 8-token blocks, snapshots every 8 tokens, prefill chunks of 8
PREFIX_CACHING: dict[str, Any] = {
    "max_num_tokens": 8,
    "enable_chunked_prefill": True,
    "kv_cache_config": {
        "tokens_per_block": 8,
        "enable_block_reuse": True,
        "mamba_state_config": {"periodic_snapshot_interval": 8},
    },
}


def hf_greedy(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and each one's logprob (full forward each step: no cache involved)."""
    ids = list(prompt)
    lps: list[float] = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            tok = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            ids.append(tok)
    return ids[len(prompt) :], lps


def check_parity(model_dir: str, hf_model: torch.nn.Module, **options: Any) -> float:
    """Returns the largest |logprob difference| seen (asserts it is below 1e-3). `options` go to both `LLM`s
    (e.g. `quantization="fp8"`)."""
    hf = [hf_greedy(hf_model, p) for p in PROMPTS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=1, ignore_eos=True)
    llm = LLM(model=model_dir, dtype="float32", device="cpu", max_seq_len=128, max_batch_size=2, **options)
    outs = llm.generate(PROMPTS, params)
    worst = 0.0
    for out, (toks, lps) in zip(outs, hf):
        assert list(out.token_ids) == toks
        assert out.logprobs is not None
        for got, want in zip(out.logprobs, lps):
            worst = max(worst, abs(got.logprob - want))
    assert worst < 1e-3, worst
    cached = LLM(
        model=model_dir,
        dtype="float32",
        device="cpu",
        max_seq_len=128,
        max_batch_size=2,
        **PREFIX_CACHING,
        **options,
    )
    shared = [PROMPTS[0], PROMPTS[0][:8] + PROMPTS[1][:6]]  # the second reuses the first's 8-token prefix
    first = cached.generate([shared[0]], params)[0]
    assert list(first.token_ids) == hf[0][0]
    second = cached.generate([shared[1]], params)[0]
    assert list(second.token_ids) == hf_greedy(hf_model, shared[1])[0]
    again = cached.generate(PROMPTS, params)
    assert [list(o.token_ids) for o in again] == [t for t, _ in hf]
    return worst


def record_op_lookups(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The names of the kernel ops looked up from now on (the returned set fills as they are)."""
    looked_up: set[str] = set()
    real_get = ops.Op.get

    def recording_get(self: ops.Op[..., Any], on_cuda: bool) -> Any:
        looked_up.add(self.name)
        return real_get(self, on_cuda)

    monkeypatch.setattr(ops.Op, "get", recording_get)
    return looked_up


def check_family_parity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hf: torch.nn.Module, family_name: str, config_type: type
) -> tuple[Any, set[str], set[str]]:
    """`hf` saved to `tmp_path` and served through `check_parity`; the directory must read as `family_name`
    with a `config_type` config, and every kernel op the forwards looked up must be one the family declares.
    Returns (the config, the ops declared, the ops looked up)."""
    hf.save_pretrained(tmp_path)
    looked_up = record_op_lookups(monkeypatch)
    worst = check_parity(str(tmp_path), hf)
    family, cfg = registry.read_config(tmp_path)
    print(f"{family_name} ({type(hf).__name__}) max |dlogprob| {worst:.2e}")
    assert family.name == family_name and isinstance(cfg, config_type)
    declared = {op.name for op in family.kernel_ops}
    assert looked_up <= declared, looked_up - declared
    return cfg, declared, looked_up


def check_tp2_matches_tp1(model_dir: str, ep_size: int = 1, **options: Any) -> None:
    """The model at `model_dir` over two gloo ranks (experts split over `ep_size` of them) gives tp_size 1's
    greedy tokens, logprobs within 1e-4; `options` go to both `LLM`s."""
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
    kw: dict[str, Any] = {
        "dtype": "float32",
        "device": "cpu",
        "max_seq_len": 64,
        "max_batch_size": 2,
        **options,
    }
    outs = []
    for tp in (1, 2):
        with LLM(model_dir, tp_size=tp, ep_size=ep_size if tp > 1 else 1, **kw) as llm:
            outs.append(llm.generate(PROMPTS, params))
    one, two = outs
    assert [list(o.token_ids) for o in two] == [list(o.token_ids) for o in one]
    for a, b in zip(one, two):
        assert a.logprobs is not None and b.logprobs is not None
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < 1e-4
