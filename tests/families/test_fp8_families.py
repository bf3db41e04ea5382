"""FP8 projections in the decoder families (Bamba, Falcon-H1, Granite-4.0-H dense and MoE) with
`quantization: fp8` on the CPU. transformers runs the same tiny model with every projection hyserve
quantises replaced by its dequantised e4m3 values (per output channel, as `model/fp8_weights.py` quantises
at load; quantising those values again gives the same codes and scales), so greedy decoding must match it
token for token with logprobs within 1e-3, also with prefix caching and chunked prefill
(`check_parity`). Granite's routed experts are quantised too, per expert and output channel; an FP8
checkpoint whose experts are e4m3 is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hyserve.config import build_engine_config
from hyserve.engine.runner.model_loader import load_model
from hyserve.kernels.fp8_linear import dequantize_weight_ref, quantize_weight_ref
from hyserve.model.fp8_weights import fp8_layers
from hyserve.model.quant_config import QUANTIZABLE_LINEARS, QuantConfig
from tests.families.hf_parity import check_parity

transformers = pytest.importorskip("transformers")

E4M3 = torch.float8_e4m3fn


def _model(family: str) -> Any:
    if family == "bamba":
        from tests.families.test_bamba import _hf_model as bamba

        return bamba()
    if family == "falcon_h1":
        from tests.families.test_falcon_h1 import _hf_model as falcon

        return falcon("gated")
    from tests.families.test_granitemoehybrid import _hf_model as granite

    return granite(family.removeprefix("granite-"))


def _round_trip(w: torch.Tensor) -> torch.Tensor:
    q, s = quantize_weight_ref(w.float(), "channel")
    return dequantize_weight_ref(q, s).to(w.dtype)


def _dequantise_projections(hf: torch.nn.Module) -> tuple[list[str], int]:
    """Every projection hyserve quantises replaced by its e4m3 round trip, and every routed expert's matrix
    (per expert and output channel); returns the projections' names and the number of stacked expert
    tensors."""
    names, experts = [], 0
    with torch.no_grad():
        for name, m in hf.named_modules():
            if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in QUANTIZABLE_LINEARS:
                m.weight.copy_(_round_trip(m.weight))
                names.append(name)
        for name, p in hf.named_parameters():
            if "block_sparse_moe" in name and p.dim() == 3:
                p.copy_(torch.stack([_round_trip(w) for w in p]))
                experts += 1
    return names, experts


@pytest.mark.parametrize("family", ["bamba", "falcon_h1", "granite-dense", "granite-moe"])
def test_fp8_projections_match_transformers_on_the_dequantised_weights(tmp_path: Path, family: str) -> None:
    hf = _model(family)
    projections, n_experts = _dequantise_projections(hf)
    assert projections and (n_experts > 0) == (family == "granite-moe")
    hf.save_pretrained(tmp_path)
    worst = check_parity(str(tmp_path), hf, quantization="fp8")
    print(f"{family} fp8 max |dlogprob| {worst:.2e}")
    lm = load_model(
        build_engine_config(
            {"model": str(tmp_path), "device": "cpu", "dtype": "float32", "quantization": "fp8"}
        )
    )
    model = lm.model
    layers = dict(fp8_layers(model))
    assert len(layers) == len(projections)  # every projection, nothing else
    assert all(layer.weight.dtype == E4M3 for layer in layers.values())
    assert "fp8 e4m3 weights (quantised at load" in lm.config.describe()
    experts = [p for n, p in model.named_parameters() if n.endswith("_linear.weight") and "block_sparse" in n]
    assert len(experts) == n_experts and all(p.dtype == E4M3 for p in experts)


def test_granite_checkpoint_with_fp8_experts_is_refused() -> None:
    from hyserve.model.granitemoehybrid.config import GraniteMoeHybridConfig

    hf_cfg = _model("granite-moe").config.to_dict()
    cfg = GraniteMoeHybridConfig.from_dict(hf_cfg)
    checkpoint = QuantConfig(method="modelopt", scheme="tensor")
    with pytest.raises(ValueError, match="routed experts are FP8"):
        cfg.with_quant(checkpoint)
    excluded = QuantConfig(method="modelopt", scheme="tensor", exclude=("model.layers.*.block_sparse_moe*",))
    assert cfg.with_quant(excluded).quant == excluded  # experts excluded: the projections alone are FP8
    online = QuantConfig(method="online", scheme="channel")
    assert cfg.with_quant(online).quant == online


def test_random_fp8_granite_experts_are_drawn_and_quantised(tmp_path: Path) -> None:
    """`load_format: dummy` with `quantization: fp8`: each expert's random matrix is drawn in float32 and
    quantised as it loads, the same values as the 16-bit model's draw."""
    _model("granite-moe").config.save_pretrained(tmp_path)
    opts = {"model": str(tmp_path), "device": "cpu", "dtype": "float32", "load_format": "dummy", "seed": 3}
    fp8 = load_model(build_engine_config({**opts, "quantization": "fp8"})).model
    ref = dict(load_model(build_engine_config(opts)).model.named_parameters())
    n = 0
    for name, m in fp8.named_modules():
        if name.endswith(("block_sparse_moe.input_linear", "block_sparse_moe.output_linear")):
            for e in range(m.weight.shape[0]):
                q, s = quantize_weight_ref(ref[f"{name}.weight"][e].detach(), "channel")
                assert torch.equal(m.weight[e].view(torch.uint8), q.view(torch.uint8)), (name, e)
                assert torch.equal(m.weight_scale[e], s), (name, e)
            n += 1
    assert n == 2 * 3  # input and output experts of every layer
