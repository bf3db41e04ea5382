"""Write a 16-bit NemotronH checkpoint's projections as FP8 in ModelOpt's layout (weights only).

    every projection weight X.weight (in_proj, out_proj, q/k/v/o_proj, up/down_proj, the latent projections,
    each routed expert's up/down_proj)  ->  X.weight e4m3 + X.weight_scale float32 [] (one per tensor)
    config.json                          +  quantization_config {quant_method: modelopt, quant_algo: FP8,
                                            exclude_modules: [lm_head]}
    hf_quant_config.json                    ModelOpt's own copy of the same

The rest (embeddings, lm_head, norms, the router, Mamba conv / A / D / dt) is copied as it is. No activation
calibration runs, so no `input_scale` is written: hyserve scales activations per token, dynamically. It is
how `hyserve make-tiny --fp8` builds FP8 test checkpoints; one shard file in, one out, in host memory.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from hyserve.kernels.fp8_linear import quantize_weight_ref
from hyserve.model.quant_config import HF_QUANT_FILE, QUANTIZABLE_LINEARS
from hyserve.model.weights import SINGLE_FILE

EXCLUDE = ["lm_head", "mtp*"]  # the MTP block stays 16-bit, as NVIDIA's FP8 checkpoints ship it


def _is_projection(name: str) -> bool:
    if not name.endswith(".weight"):
        return False
    leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
    return leaf in QUANTIZABLE_LINEARS and not name.startswith(("lm_head", "mtp."))


def write_modelopt_fp8(model_dir: str | Path) -> int:
    """Rewrite `model_dir` (a single-file checkpoint) in place as FP8; returns how many tensors became e4m3.
    Raises ValueError for a sharded or already quantised checkpoint."""
    d = Path(model_dir)
    cfg_path, weights = d / "config.json", d / SINGLE_FILE
    if not weights.is_file():
        raise ValueError(f"{d}: write_modelopt_fp8 takes a single-file checkpoint ({SINGLE_FILE})")
    config = json.loads(cfg_path.read_text())
    if config.get("quantization_config") is not None or (d / HF_QUANT_FILE).exists():
        raise ValueError(f"{d}: the checkpoint is already quantised")
    out = {}
    n = 0
    with safe_open(str(weights), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if _is_projection(name):
                q, s = quantize_weight_ref(t, "tensor")
                out[name], out[name + "_scale"] = q, s
                n += 1
            else:
                out[name] = t
    save_file(out, str(weights), metadata={"format": "pt"})
    quant = {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": EXCLUDE}
    config["quantization_config"] = {"quant_method": "modelopt", **quant}
    cfg_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (d / HF_QUANT_FILE).write_text(
        json.dumps({"producer": {"name": "modelopt"}, "quantization": quant}, indent=2) + "\n"
    )
    return n
