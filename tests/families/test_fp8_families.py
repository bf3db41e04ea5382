"""FP8 projections in the decoder families (Bamba, Falcon-H1, Granite-4.0-H dense and MoE) with
`quantization: fp8` on the CPU. transformers runs the same tiny model with every projection hyserve
quantises replaced by its dequantised e4m3 values (per output channel, as `model/fp8_weights.py` quantises
at load; quantising those values again gives the same codes and scales), so greedy decoding must match it
token for token with logprobs within 1e-3, also with prefix caching and chunked prefill
(`check_parity`). Granite's routed experts stay 16-bit; a checkpoint with FP8 experts is refused."""

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


def _dequantise_projections(hf: torch.nn.Module) -> list[str]:
    """Every projection hyserve quantises replaced by its e4m3 round trip; returns their names."""
    names = []
    with torch.no_grad():
        for name, m in hf.named_modules():
            if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in QUANTIZABLE_LINEARS:
                q, s = quantize_weight_ref(m.weight.float(), "channel")
                m.weight.copy_(dequantize_weight_ref(q, s).to(m.weight.dtype))
                names.append(name)
    return names


@pytest.mark.parametrize("family", ["bamba", "falcon_h1", "granite-dense", "granite-moe"])
def test_fp8_projections_match_transformers_on_the_dequantised_weights(tmp_path: Path, family: str) -> None:
    hf = _model(family)
    projections = _dequantise_projections(hf)
    assert projections
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
    experts = [p for n, p in model.named_parameters() if "block_sparse_moe" in n and "router" not in n]
    assert all(p.dtype == torch.float32 for p in experts)  # Granite's routed experts stay 16/32-bit


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
