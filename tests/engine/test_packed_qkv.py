"""Packed QKV (docs/architecture.md, "Packed QKV"): after loading, each attention layer's q, k and v weights
live in one buffer (the three modules' parameters are views of it) and the layer projects them with one
`linear` call. On the CPU reference path with the tiny dense model (attention layers 1 and 5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hyserve import LLM, SamplingParams
from hyserve.model.attention import Attention
from hyserve.model.nemotron_h.model import NemotronHForCausalLM
from hyserve.model.tiny import make_tiny

PROMPTS = [[1, 5, 9, 13, 200, 17, 4], [1, 77] * 20, [1, 3]]


def _attention(llm: LLM) -> list[Attention]:
    return [m for m in llm.engine.loaded.model.modules() if isinstance(m, Attention)]


def _greedy(llm: LLM):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1))
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("packed") / "dense", variant="dense")


def test_loaded_layers_are_packed_and_their_modules_are_views(tiny: Path) -> None:
    llm = LLM(str(tiny), device="cpu", dtype="float32", max_seq_len=256)
    layers = _attention(llm)
    assert layers and all(m.packed_qkv is not None for m in layers)
    for m in layers:
        w, b = m.packed_qkv
        nq, nk = m.q_proj.out_features, m.k_proj.out_features
        assert w.shape == (nq + 2 * nk, m.q_proj.in_features) and b is None
        # the parameters are views of the packed rows, in q, k, v order
        rows = w.stride(0) * w.element_size()
        assert m.q_proj.weight.data_ptr() == w.data_ptr()
        assert m.k_proj.weight.data_ptr() == w.data_ptr() + nq * rows
        assert m.v_proj.weight.data_ptr() == w.data_ptr() + (nq + nk) * rows
    names = set(llm.engine.loaded.model.state_dict())
    assert not any("packed" in n for n in names)
    assert {
        "backbone.layers.1.mixer.q_proj.weight",
        "backbone.layers.1.mixer.k_proj.weight",
        "backbone.layers.1.mixer.v_proj.weight",
    } <= names


def test_packed_layers_give_the_unpacked_results(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    packed = _greedy(LLM(str(tiny), device="cpu", dtype="float32", max_seq_len=256))
    monkeypatch.setattr(NemotronHForCausalLM, "pack_weights", lambda self: 0)
    llm = LLM(str(tiny), device="cpu", dtype="float32", max_seq_len=256)
    assert all(m.packed_qkv is None for m in _attention(llm))
    plain = _greedy(llm)
    assert packed[0] == plain[0]
    for a, b in zip(packed[1], plain[1]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def test_a_weight_loaded_after_packing_reaches_the_packed_buffer(tiny: Path) -> None:
    llm = LLM(str(tiny), device="cpu", dtype="float32", max_seq_len=256)
    m = _attention(llm)[0]
    new = torch.randn(m.k_proj.weight.shape)
    p = m.k_proj.weight
    p.weight_loader(p, new)  # type: ignore[attr-defined]
    nq, nk = m.q_proj.out_features, m.k_proj.out_features
    assert torch.equal(m.packed_qkv[0][nq : nq + nk], new)
    x = torch.randn(3, m.q_proj.in_features)
    q, k, v = m._project_qkv(x)
    torch.testing.assert_close(k.reshape(3, -1), x @ new.T)


def test_a_converted_model_packs_its_new_weights(tiny: Path) -> None:
    """`to(dtype)` replaces every parameter: the layer packs the new ones, never reading the old buffer."""
    llm = LLM(str(tiny), device="cpu", dtype="float32", max_seq_len=256)
    m = _attention(llm)[0]
    old = m.packed_qkv[0]
    m.to(torch.float64)
    w = m.packed_qkv[0]
    assert w.dtype == torch.float64 and w.data_ptr() != old.data_ptr()
    assert m.q_proj.weight.data_ptr() == w.data_ptr()
    torch.testing.assert_close(w, old.double())
    x = torch.randn(2, m.q_proj.in_features, dtype=torch.float64)
    q, _, v = m._project_qkv(x)
    torch.testing.assert_close(v.reshape(2, -1), x @ m.v_proj.weight.T)


def test_fp8_layers_and_mixed_biases_stay_three_projections(tiny: Path) -> None:
    llm = LLM(str(tiny), device="cpu", dtype="bfloat16", max_seq_len=256, quantization="fp8")
    layers = _attention(llm)
    assert layers and all(m.packed_qkv is None and m.q_proj.quant is not None for m in layers)
    m = _attention(LLM(str(tiny), device="cpu", dtype="float32", max_seq_len=256))[0]
    fresh = Attention.__new__(Attention)
    torch.nn.Module.__init__(fresh)
    for name in ("q_proj", "k_proj", "v_proj"):  # unpacked copies, one given a bias the others lack
        lin = torch.nn.Linear(1, 1)
        lin.weight = torch.nn.Parameter(getattr(m, name).weight.detach().clone())
        lin.bias = torch.nn.Parameter(torch.zeros(lin.weight.shape[0])) if name == "k_proj" else None
        lin.quant = None  # type: ignore[assignment]
        setattr(fresh, name, lin)
    fresh.packed_qkv = None
    assert fresh.pack_qkv() is False and fresh.packed_qkv is None


def test_kv_calibration_hooks_see_k_and_v_of_a_packed_layer(tiny: Path) -> None:
    from hyserve.model.kv_scales import record_kv_amax

    llm = LLM(str(tiny), device="cpu", dtype="float32", max_seq_len=256)
    model = llm.engine.loaded.model
    with record_kv_amax(model) as amax:
        assert all(not m.use_packed_qkv for m in _attention(llm))
        _greedy(llm)
    assert all(m.use_packed_qkv for m in _attention(llm))
    assert amax and all(bool((a > 0).all()) for a in amax.values())
