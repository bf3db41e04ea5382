"""The model's K/V amax recorder (model/kv_scales.record_kv_amax), with the tiny dense model (attention
layers 1 and 5)."""

from __future__ import annotations

import pytest
import torch
from model_harness import Harness, strong_random_weights

ATTN = (1, 5)  # the tiny dense model's attention layers
PROMPTS = [[1, 5, 9, 13, 200, 17, 4, 88, 31], [1, 77] * 20, [1, 3, 250, 251, 7]]


def _no_hooks(model: torch.nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


# ---------------------------------------------------------------------------- the model's recorder


def _harness_model():
    from hyserve.model.config import HybridModelConfig
    from hyserve.model.nemotron_h import NemotronHForCausalLM
    from hyserve.model.tiny import tiny_config

    cfg = HybridModelConfig.from_dict(tiny_config("dense"))
    model = NemotronHForCausalLM(cfg, dtype=torch.float32)
    strong_random_weights(model, cfg, seed=5)
    for i in ATTN:
        model.backbone.layers[i].mixer.set_kv_scales(1.0, 1.0)
    return model.eval()


def test_record_kv_amax_matches_the_projections_and_changes_no_output():
    from hyserve.model.kv_scales import record_kv_amax

    model = _harness_model()
    items = [(0, PROMPTS[0]), (1, PROMPTS[1])]
    want = Harness(model).step(items, all_logits=True)

    seen: dict[int, torch.Tensor] = {}  # the test's own oracle: each attention layer's input, projected here
    handles = [model.backbone.layers[i].mixer.register_forward_pre_hook(
        lambda _m, args, i=i: seen.__setitem__(i, args[0].detach().clone())) for i in ATTN]
    with record_kv_amax(model) as amax:
        got = Harness(model).step(items, all_logits=True)
    for h in handles:
        h.remove()
    assert torch.equal(got, want)
    assert _no_hooks(model)
    assert sorted(amax) == list(ATTN)
    for i in ATTN:
        mixer = model.backbone.layers[i].mixer
        with torch.no_grad():
            k, v = mixer.k_proj(seen[i]).abs().max(), mixer.v_proj(seen[i]).abs().max()
        assert amax[i].dtype == torch.float32 and amax[i].tolist() == [float(k), float(v)]


def test_record_kv_amax_removes_its_hooks_after_an_error_and_keeps_nan():
    from hyserve.model.kv_scales import record_kv_amax

    model = _harness_model()
    with pytest.raises(RuntimeError, match="boom"), record_kv_amax(model):
        raise RuntimeError("boom")
    assert _no_hooks(model)
    with torch.no_grad():
        model.backbone.layers[5].mixer.v_proj.weight[0, 0] = float("nan")
    with record_kv_amax(model) as amax:
        Harness(model).step([(0, PROMPTS[0])])
    assert torch.isfinite(amax[1]).all() and amax[5][0].isfinite() and amax[5][1].isnan()
