"""A family defined outside `hyserve/` (tests/families/toy_recurrent.py) with its own recurrent state shape,
[heads, key_dim, value_dim], served through the normal loader and engine: greedy tokens equal the model's own
cache-free reference, with and without prefix caching (its snapshots restore the toy state) and chunked
prefill; the cache pools take the family's shapes and the capacity plan its bytes."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from hyserve import LLM, SamplingParams
from hyserve.model import registry
from hyserve.model.tokenizer import write_tiny_tokenizer
from tests.families.hf_parity import PREFIX_CACHING
from tests.families.toy_recurrent import TOY_RECURRENT, ToyRecurrentForCausalLM
from tests.server_fixtures import REPO_ROOT, ServerProcess

CONFIG = {
    "model_type": "toy_recurrent",
    "architectures": ["ToyRecurrentForCausalLM"],
    "vocab_size": 320,  # the tiny tokenizer's
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_heads_recurrent": 2,
    "key_dim": 6,
    "value_dim": 10,
    "conv_kernel": 4,
    "intermediate_size": 48,
    "layer_types": ["recurrent", "attention", "recurrent", "recurrent"],
}
PROMPTS = [[5, 17, 33, 2, 9, 41, 8, 100, 7, 3, 250, 11, 60, 61, 62, 63, 64, 65, 66], [7, 8, 9, 10, 11]]
NEW = 8
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A checkpoint directory of the toy family, registered for this module only."""
    families = list(registry._FAMILIES)
    registry.register(TOY_RECURRENT)
    d = tmp_path_factory.mktemp("toy_recurrent")
    (d / "config.json").write_text(json.dumps(CONFIG))
    write_tiny_tokenizer(d)
    yield d
    registry._FAMILIES[:] = families


def _llm(path: Path, **options: object) -> LLM:
    kw: dict[str, Any] = {"dtype": "float32", "device": "cpu", "max_seq_len": 128, "max_batch_size": 2}
    return LLM(model=str(path), load_format="dummy", **kw, **options)


def _reference_greedy(model: ToyRecurrentForCausalLM, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    for _ in range(NEW):
        ids.append(int(model.reference_logits(ids)[-1].argmax()))
    return ids[len(prompt) :]


def test_the_toy_family_reads_its_config_and_lays_out_its_state(toy_dir: Path) -> None:
    family, cfg = registry.read_config(toy_dir)
    assert family.name == "toy_recurrent"
    layout = cfg.cache_layout()  # type: ignore[attr-defined]
    assert set(layout.attention) == {1} and set(layout.recurrent) == {0, 2, 3}
    state = layout.recurrent[0]
    assert state.state_shape == (2, 6, 10) and state.conv_dim == 2 * (6 + 6 + 10)
    # the plan's bytes per sequence: three layers of conv window (3 taps) and state, float32
    assert cfg.state_bytes_per_sequence == 3 * (44 * 3 + 2 * 6 * 10) * 4


def test_the_toy_family_decodes_as_its_reference(toy_dir: Path) -> None:
    llm = _llm(toy_dir)
    model = llm.engine.runner.model
    assert isinstance(model, ToyRecurrentForCausalLM)
    pools = llm.engine.runner.cache
    assert tuple(pools.ssm[0].shape[1:]) == (2, 6, 10) and tuple(pools.conv[2].shape[1:]) == (44, 3)
    assert 1 not in pools.ssm and 1 in pools.k
    want = [_reference_greedy(model, p) for p in PROMPTS]
    got = llm.generate(PROMPTS, GREEDY)
    assert [list(o.token_ids) for o in got] == want


def test_the_toy_family_with_prefix_caching_and_chunked_prefill(toy_dir: Path) -> None:
    """8-token blocks and snapshots, 8-token prefill chunks: the second prompt starts from the first's
    snapshot after 16 tokens (its toy state and conv window), and every answer is the reference's."""
    llm = _llm(toy_dir, **PREFIX_CACHING)
    model = llm.engine.runner.model
    first = PROMPTS[0]
    shared = first[:16] + [90, 91, 92, 93, 94]
    assert list(llm.generate([first], GREEDY)[0].token_ids) == _reference_greedy(model, first)
    hits_before = llm.stats().get("prefix_cache_hit_tokens", 0)
    out = llm.generate([shared], GREEDY)[0]
    assert list(out.token_ids) == _reference_greedy(model, shared)
    assert out.num_cached_tokens == 16 or llm.stats().get("prefix_cache_hit_tokens", 0) > hits_before
    again = llm.generate(PROMPTS, GREEDY)
    assert [list(o.token_ids) for o in again] == [_reference_greedy(model, p) for p in PROMPTS]
    assert math.isfinite(
        float(torch.stack([p.float().sum() for p in llm.engine.runner.cache.ssm.values()]).sum())
    )


def test_the_toy_family_is_served_over_http_from_a_plugin(
    toy_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`hyserve serve` in its own process, where nothing registers the toy family but a package's entry
    point in the `hyserve.model_families` group (as another installed package would ship it): its
    completion is LLM.generate's, greedy."""
    dist = tmp_path / "site" / "toy_family_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-family-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{registry.PLUGIN_GROUP}]\ntoy = tests.families.toy_recurrent:TOY_RECURRENT\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{dist.parent}:{REPO_ROOT}")
    prompt = PROMPTS[0]
    want = _llm(toy_dir).generate([prompt], GREEDY)[0]
    assert want.text and len(want.token_ids) == NEW
    args = [str(toy_dir), "--load-format", "dummy", "--dtype", "float32", "--max-seq-len", "128"]
    server = ServerProcess(args + ["--max-batch-size", "2", "--warmup", "off"]).start()
    try:
        body = {"model": server_model(server), "prompt": prompt, "max_tokens": NEW, "temperature": 0}
        r = httpx.post(f"{server.base_url}/completions", json={**body, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text
    finally:
        server.stop()


def server_model(server: ServerProcess) -> str:
    return httpx.get(f"{server.base_url}/models", timeout=10).json()["data"][0]["id"]
