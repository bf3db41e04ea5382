"""FP8 weights (model/quant_config.py, model/fp8_weights.py, kernels/fp8_linear.py): the weight-format
option and checkpoint detection with every refusal, quantisation and the reference path's error bounds,
loading ModelOpt (per-tensor, per-channel, block, mixed-precision), block-scaled `fp8` and compressed-tensors
checkpoints, tensor-parallel shards of weights and scales
(simulated ranks in this process, and two gloo ranks end to end), online quantisation from a 16-bit
checkpoint and from dummy weights, and the capacity planner's use of the freed memory."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hyserve.cli import build_parser, engine_options_from_args
from hyserve.config import build_engine_config
from hyserve.distributed import Group, tp_group
from hyserve.engine.runner.model_loader import load_model
from hyserve.kernels.fp8_linear import (
    E4M3,
    FP8_MAX,
    dequantize_weight_ref,
    fp8_linear_ref,
    quantize_rows_ref,
    quantize_weight_ref,
)
from hyserve.model.fp8_weights import convert_linear, fp8_layers, tensor_bytes
from hyserve.model.nemotron_h.checkpoint import NAMES, weight_bytes
from hyserve.model.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    ShardedPart,
)
from hyserve.model.quant_config import QUANTIZABLE_LINEARS, QuantConfig, checkpoint_quant, resolve_quant
from hyserve.model.tiny import make_tiny
from tests.dist_pool import RankPool
from tests.model_harness import Harness

TORCH_SEED = 1919
F64 = torch.float64
E4M3_REL = 2.0**-4  # half an ulp of a 3-bit mantissa, relative
E4M3_SUB = 2.0**-10  # half the subnormal spacing (2^-9), absolute, in scaled units
ONLINE = QuantConfig(method="online", scheme="channel")


def _write_config(d: Path, **extra: Any) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "nemotron_h", **extra}))
    return d


# ---- the option and the detection ----------------------------------------------------------------------
def test_quantization_option_and_flag() -> None:
    assert build_engine_config().quantization is None
    assert build_engine_config(quantization="FP8").quantization == "fp8"
    assert build_engine_config(quantization="none").quantization is None
    for bad in ("int4", 8, "awq"):
        with pytest.raises(ValueError, match=r"quantization: .* is not supported; use one of \['fp8'\]"):
            build_engine_config(quantization=bad)
    args = build_parser().parse_args(["serve", "--quantization", "fp8"])
    opts, _, _ = engine_options_from_args(args)
    assert opts["quantization"] == "fp8"
    assert build_engine_config(opts).quantization == "fp8"


def test_detects_modelopt_in_config_json_and_hf_quant_config(tmp_path: Path) -> None:
    d = _write_config(
        tmp_path / "a",
        quantization_config={
            "quant_method": "modelopt",
            "quant_algo": "FP8",
            "kv_cache_quant_algo": "FP8",
            "exclude_modules": ["lm_head", "model.layers.0.mixer.in_proj"],
            "ignore": ["*.mixer.o_proj"],
        },
    )
    q = checkpoint_quant(d)
    assert (q.method, q.scheme, q.kv_cache_fp8, q.from_checkpoint) == ("modelopt", "tensor", True, True)
    assert q.exclude == ("lm_head", "model.layers.0.mixer.in_proj", "*.mixer.o_proj")
    assert not q.quantizes("backbone.layers.0.mixer.in_proj")
    assert q.quantizes("backbone.layers.2.mixer.in_proj")
    assert not q.quantizes("backbone.layers.5.mixer.o_proj")
    assert q.quantizes("backbone.layers.5.mixer.q_proj")
    for never in (
        "backbone.layers.3.mixer.gate",
        "backbone.layers.0.mixer.conv1d",
        "lm_head",
        "backbone.embeddings",
    ):
        assert not q.quantizes(never)
    e = _write_config(tmp_path / "b")
    (e / "hf_quant_config.json").write_text(
        json.dumps(
            {
                "producer": {"name": "modelopt", "version": "0.31"},
                "quantization": {
                    "quant_algo": "FP8",
                    "kv_cache_quant_algo": None,
                    "exclude_modules": ["lm_head"],
                },
            }
        )
    )
    q = checkpoint_quant(e)
    assert (q.method, q.scheme, q.kv_cache_fp8, q.exclude) == ("modelopt", "tensor", False, ("lm_head",))
    assert checkpoint_quant(_write_config(tmp_path / "c")) is None


def test_detects_block_and_per_tensor_fp8(tmp_path: Path) -> None:
    d = _write_config(
        tmp_path / "a",
        quantization_config={
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["backbone.layers.1.mixer.q_proj"],
        },
    )
    q = checkpoint_quant(d)
    assert (q.method, q.scheme, q.block_size) == ("fp8", "block", (128, 128))
    assert not q.quantizes("backbone.layers.1.mixer.q_proj")
    d = _write_config(
        tmp_path / "b", quantization_config={"quant_method": "fp8", "activation_scheme": "static"}
    )
    assert checkpoint_quant(d).scheme == "tensor"


@pytest.mark.parametrize(
    ("algo", "scheme"),
    [
        ("FP8", "tensor"),
        ("FP8_PER_CHANNEL_PER_TOKEN", "channel"),
        ("FP8_PB_WO", "block"),
        ("fp8_pb_wo", "block"),
    ],
)
def test_detects_each_modelopt_fp8_algorithm(tmp_path: Path, algo: str, scheme: str) -> None:
    """ModelOpt's three FP8 layouts, from either file and in config.json's own form (quant_method beside
    quant_algo, `ignore` and `kv_cache_scheme`) or with hf_quant_config.json's nesting inside it."""
    flat = _write_config(
        tmp_path / "flat",
        quantization_config={
            "quant_method": "modelopt",
            "quant_algo": algo,
            "ignore": ["lm_head", "model.layers.1*"],
            "kv_cache_scheme": {"type": "float", "num_bits": 8, "dynamic": False},
        },
    )
    nested = _write_config(
        tmp_path / "nested",
        quantization_config={
            "quant_method": "modelopt",
            "quantization": {
                "quant_algo": algo,
                "kv_cache_quant_algo": "FP8",
                "exclude_modules": ["lm_head", "model.layers.1*"],
            },
        },
    )
    hf = _write_config(tmp_path / "hf")
    (hf / "hf_quant_config.json").write_text(
        json.dumps(
            {
                "producer": {"name": "modelopt"},
                "quantization": {
                    "quant_algo": algo,
                    "kv_cache_quant_algo": "FP8",
                    "exclude_modules": ["lm_head", "model.layers.1*"],
                },
            }
        )
    )
    for d in (flat, nested, hf):
        q = checkpoint_quant(d)
        assert (q.method, q.scheme, q.kv_cache_fp8, q.include) == ("modelopt", scheme, True, None), d
        assert q.quantizes("backbone.layers.0.mixer.in_proj") and q.quantizes(
            "backbone.layers.2.mixer.o_proj"
        )
        assert not q.quantizes("backbone.layers.1.mixer.in_proj")  # ModelOpt's "a whole subtree" pattern
    no_kv = _write_config(
        tmp_path / "no-kv",
        quantization_config={"quant_method": "modelopt", "quant_algo": algo, "kv_cache_scheme": None},
    )
    assert not checkpoint_quant(no_kv).kv_cache_fp8


def test_mixed_precision_fp8_loads_only_the_listed_modules(tmp_path: Path) -> None:
    listed = {
        "model.layers.0.mixer.in_proj": {"quant_algo": "FP8"},
        "backbone.layers.3.mixer.experts.0.up_proj": {"quant_algo": "FP8"},
    }
    d = _write_config(
        tmp_path,
        quantization_config={
            "quant_method": "modelopt",
            "quant_algo": "MIXED_PRECISION",
            "kv_cache_quant_algo": "FP8",
            "quantized_layers": listed,
        },
    )
    q = checkpoint_quant(d)
    assert (q.scheme, q.kv_cache_fp8) == ("tensor", True)
    assert q.include == {"backbone.layers.0.mixer.in_proj", "backbone.layers.3.mixer.experts.0.up_proj"}
    assert q.quantizes("backbone.layers.0.mixer.in_proj")
    assert q.quantizes("backbone.layers.3.mixer.experts.0.up_proj")
    assert not q.quantizes("backbone.layers.2.mixer.in_proj")  # not listed: 16-bit
    assert "2 FP8 modules listed" in q.describe()
    parent = QuantConfig(
        method="modelopt", scheme="tensor", include=frozenset({"backbone.layers.5.mixer.experts"})
    )
    assert parent.quantizes_experts("backbone.layers.5.mixer.experts")  # an entry for the experts' module
    assert not parent.quantizes("backbone.layers.50.mixer.experts.0.up_proj")


def test_module_patterns_read_as_modelopt_and_compressed_tensors_mean_them() -> None:
    q = QuantConfig(method="modelopt", scheme="tensor", exclude=("model.layers.1*", "re:layers\\.2\\."))
    assert not q.quantizes("backbone.layers.1.mixer.in_proj")  # `path*`: the module and what is under it
    assert q.quantizes("backbone.layers.10.mixer.in_proj")  # ... not layers 10-19
    assert q.quantizes("backbone.layers.2.mixer.in_proj")  # re: matches the whole name from its start
    r = QuantConfig(method="compressed-tensors", scheme="channel", exclude=("re:model\\.layers\\.2\\.",))
    assert not r.quantizes("backbone.layers.2.mixer.in_proj")  # in the checkpoint's model. spelling too


def _ct_config(
    strategy: str = "channel",
    *,
    targets: list[str] | None = None,
    ignore: list[str] | None = None,
    static_act: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """A compressed-tensors (llm-compressor) FP8 quantization_config, as its FP8-dynamic / FP8-block recipes
    write them."""
    w = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": False,
        "strategy": strategy,
        "block_structure": [128, 128] if strategy == "block" else None,
        "group_size": None,
    }
    act = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": not static_act,
        "strategy": "tensor" if static_act else "group" if strategy == "block" else "token",
        "group_size": 128 if strategy == "block" else None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": targets or ["Linear"], "weights": w, "input_activations": act}
        },
        "ignore": ignore if ignore is not None else ["lm_head"],
        "kv_cache_scheme": None,
        **extra,
    }


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_detects_compressed_tensors_fp8(tmp_path: Path, strategy: str) -> None:
    d = _write_config(
        tmp_path / "a",
        quantization_config=_ct_config(
            strategy, ignore=["lm_head", "re:.*mixer\\.o_proj$", "model.layers.0.mixer.in_proj"]
        ),
    )
    q = checkpoint_quant(d)
    assert (q.method, q.scheme, q.targets, q.kv_cache_fp8) == ("compressed-tensors", strategy, (), False)
    assert q.quantizes("backbone.layers.2.mixer.in_proj") and q.quantizes(
        "backbone.layers.3.mixer.experts.0.up_proj"
    )
    assert not q.quantizes("backbone.layers.0.mixer.in_proj")  # ignored by name (model. read as backbone.)
    assert not q.quantizes("backbone.layers.5.mixer.o_proj")  # ignored by a re: pattern
    assert q.quantizes("backbone.layers.5.mixer.q_proj")
    t = _write_config(
        tmp_path / "b",
        quantization_config=_ct_config(
            strategy,
            targets=["re:.*mixer\\.(in|out)_proj$", "model.layers.4.mixer.down_proj"],
            kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
        ),
    )
    q = checkpoint_quant(t)
    assert q.kv_cache_fp8 and q.quantizes("backbone.layers.0.mixer.out_proj")
    assert q.quantizes("backbone.layers.4.mixer.down_proj") and not q.quantizes(
        "backbone.layers.3.mixer.down_proj"
    )
    assert not q.quantizes("backbone.layers.5.mixer.q_proj")  # no target names it


@pytest.mark.parametrize(
    ("qc", "needle"),
    [
        (
            {"quant_method": "awq", "bits": 4},
            r"quant_method 'awq' is not supported; hyserve loads quant_method modelopt",
        ),
        (
            {"quant_method": "modelopt", "quant_algo": "NVFP4"},
            r"ModelOpt quant_algo 'NVFP4' is not supported",
        ),
        (
            {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "INT8"},
            r"kv_cache_quant_algo 'INT8' is not supported",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [64, 64]},
            r"weight_block_size \[64, 64\] is not supported; the FP8 kernels take \[128, 128\] blocks",
        ),
        ({"quant_method": "fp8", "weight_block_size": 128}, r"weight_block_size 128 is not supported"),
        (
            {"quant_method": "fp8", "fmt": "e5m2"},
            r"fmt 'e5m2' is not supported; hyserve's FP8 weights are e4m3",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
            r"activation_scheme 'static' with block scales is not supported",
        ),
        ({"quant_method": "fp8", "activation_scheme": "weird"}, r"activation_scheme 'weird' is not one of"),
        (
            {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": "lm_head"},
            r"exclude_modules must be a list of module names",
        ),
        ("fp8", r"quantization_config: expected a mapping"),
        (
            {
                "quant_method": "modelopt",
                "quant_algo": "FP8",
                "kv_cache_scheme": {"type": "int", "num_bits": 8},
            },
            r"kv_cache_scheme \{'type': 'int', 'num_bits': 8\} is not supported \(type float, num_bits 8, "
            r"or null\)",
        ),
        (
            {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"},
            r"quant_algo MIXED_PRECISION needs a non-empty 'quantized_layers' mapping",
        ),
        (
            {
                "quant_method": "modelopt",
                "quant_algo": "MIXED_PRECISION",
                "quantized_layers": {
                    "model.layers.0.mixer.in_proj": {"quant_algo": "FP8"},
                    "model.layers.1.mixer.experts.0.up_proj": {"quant_algo": "NVFP4", "group_size": 16},
                },
            },
            r"MIXED_PRECISION checkpoint with layers in NVFP4 "
            r"\(e.g. model.layers.1.mixer.experts.0.up_proj\): "
            r"not supported; hyserve loads FP8 / FP8_PER_CHANNEL_PER_TOKEN / FP8_PB_WO layers",
        ),
        (
            {
                "quant_method": "modelopt",
                "quant_algo": "MIXED_PRECISION",
                "quantized_layers": {
                    "model.layers.0.mixer.in_proj": {"quant_algo": "FP8"},
                    "model.layers.1.mixer.in_proj": {"quant_algo": "FP8_PB_WO"},
                },
            },
            r"mixes FP8 scale layouts \['FP8', 'FP8_PB_WO'\]: not supported",
        ),
        (
            {
                "quant_method": "modelopt",
                "quant_algo": "MIXED_PRECISION",
                "quantized_layers": {"x.in_proj": "FP8"},
            },
            r"quantized_layers\['x.in_proj'\] has no quant_algo",
        ),
        (
            {**_ct_config(), "format": "pack-quantized"},
            r"compressed-tensors format 'pack-quantized' is not supported",
        ),
        (
            {**_ct_config(), "config_groups": {}},
            r"compressed-tensors needs a non-empty 'config_groups' mapping",
        ),
        (
            {
                **_ct_config(),
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
                    }
                },
            },
            r"config_groups.g has 4-bit int weights: not supported; hyserve loads",
        ),
        (
            {
                **_ct_config(),
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128},
                    }
                },
            },
            r"config_groups.g: weight strategy 'group' is not supported \(tensor, channel or block\)",
        ),
        (
            {
                **_ct_config(),
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {
                            "num_bits": 8,
                            "type": "float",
                            "strategy": "channel",
                            "symmetric": False,
                        },
                    }
                },
            },
            r"config_groups.g: asymmetric or dynamic weight scales are not supported",
        ),
        (
            {
                **_ct_config(),
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {
                            "num_bits": 8,
                            "type": "float",
                            "strategy": "block",
                            "block_structure": [64, 64],
                        },
                    }
                },
            },
            r"block_structure \[64, 64\] is not supported; the FP8 kernels take \[128, 128\] blocks",
        ),
        (
            {
                **_ct_config(),
                "config_groups": {
                    "a": {
                        "targets": ["re:.*in_proj"],
                        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                    },
                    "b": {
                        "targets": ["re:.*out_proj"],
                        "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
                    },
                },
            },
            r"config_groups mix weight strategies \{'a': 'channel', 'b': 'tensor'\}",
        ),
        (
            {
                **_ct_config(),
                "config_groups": {
                    "g": {"targets": [], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
                },
            },
            r"config_groups.g.targets must be a non-empty list of names",
        ),
        (
            _ct_config("block", static_act=True),
            r"static activation scales with block-scaled weights are not supported",
        ),
        (
            _ct_config(targets=["QKVParallelLinear"]),
            r"targets entry 'QKVParallelLinear' is not supported \(Linear, module names or re: patterns\)",
        ),
        (_ct_config(ignore=["re:(unclosed"]), r"ignore entry 're:\(unclosed' is not a regular expression"),
        (
            _ct_config(sparsity_config={"format": "sparse-24-bitmask"}),
            r"compressed-tensors with a sparsity_config is not supported \(dense FP8 weights only\)",
        ),
        (
            _ct_config(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "attn_head"}),
            r"kv_cache_scheme strategy 'attn_head' is not supported",
        ),
        (
            {
                **_ct_config(),
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": None,
                        "input_activations": {"num_bits": 8, "type": "float"},
                    }
                },
            },
            r"no config_groups entry quantises weights \(only activations\)",
        ),
    ],
)
def test_unsupported_quantization_configs_are_refused(tmp_path: Path, qc: Any, needle: str) -> None:
    d = _write_config(tmp_path, quantization_config=qc)
    with pytest.raises(ValueError, match=needle):
        checkpoint_quant(d)
    with pytest.raises(ValueError, match=needle):  # the same at start-up, whatever the option says
        resolve_quant("fp8", d)


def test_hf_quant_config_refusals(tmp_path: Path) -> None:
    d = _write_config(tmp_path)
    for data, needle in (
        ({"producer": {"name": "autoround"}, "quantization": {"quant_algo": "FP8"}}, "producer 'autoround'"),
        ({"producer": {"name": "modelopt"}}, "expected a 'quantization' mapping"),
        ({"quantization": {"quant_algo": "W4A8_AWQ"}}, "quant_algo 'W4A8_AWQ' is not supported"),
    ):
        (d / "hf_quant_config.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match=needle):
            checkpoint_quant(d)
    (d / "hf_quant_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        checkpoint_quant(d)


def test_resolve_quant(tmp_path: Path) -> None:
    plain = _write_config(tmp_path / "plain")
    assert resolve_quant(None, plain) is None
    q = resolve_quant("fp8", plain)
    assert (q.method, q.scheme, q.from_checkpoint) == ("online", "channel", False)
    fp8 = _write_config(
        tmp_path / "fp8", quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}
    )
    assert resolve_quant(None, fp8).scheme == resolve_quant("fp8", fp8).scheme == "block"  # the checkpoint's
    with pytest.raises(ValueError, match=r"quantization: 'int8' is not one of \[None, 'fp8'\]"):
        resolve_quant("int8", plain)
    with pytest.raises(ValueError, match="scheme 'row' is not one of"):
        QuantConfig(method="online", scheme="row")


# ---- quantisation and the reference path ---------------------------------------------------------------
def _scaled_error_ok(w: torch.Tensor, deq: torch.Tensor, scale_full: torch.Tensor) -> bool:
    """Every element within e4m3's rounding: half an ulp of |w| (normals) or of the subnormal spacing."""
    bound = scale_full * torch.maximum(
        E4M3_REL * (w.double() / scale_full).abs(), torch.tensor(E4M3_SUB, dtype=F64)
    )
    return bool(((deq.double() - w.double()).abs() <= bound * (1 + 1e-6)).all())


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_weight_quantisation_is_within_e4m3_rounding(scheme: str) -> None:
    w = torch.randn(300, 260) * torch.logspace(-3, 1, 300)[:, None]  # rows of very different magnitude
    w[7] = 0.0  # an all-zero row gets scale 1 and stays zero
    q, s = quantize_weight_ref(w, scheme)
    assert q.dtype == E4M3 and s.dtype == torch.float32
    assert tuple(s.shape) == {"tensor": (), "channel": (300,), "block": (3, 3)}[scheme]
    deq = dequantize_weight_ref(q, s)
    if scheme == "tensor":
        full = s.double().expand(300, 260)
    elif scheme == "channel":
        full = s.double()[:, None].expand(300, 260)
    else:
        full = s.double().repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    assert _scaled_error_ok(w, deq, full)
    assert torch.equal(deq[7], torch.zeros(260))
    assert q.float().abs().max().item() == FP8_MAX  # the largest element lands on +-448 exactly
    if scheme == "channel":  # so does every non-zero row's
        amax = q.float().abs().amax(1)
        assert torch.equal(amax[amax > 0], torch.full((299,), FP8_MAX))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_reference_linear_against_float64_dequantised_product(dtype: torch.dtype, scheme: str) -> None:
    n, k = 200, 300
    q, s = quantize_weight_ref(torch.randn(n, k) * 0.05, scheme)
    if scheme == "channel":
        s = s.contiguous()
    x = torch.randn(9, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    out = fp8_linear_ref(x, q, s, bias)
    assert out.dtype == dtype and out.shape == (9, n)
    want = x.double() @ dequantize_weight_ref(q, s).double().T + bias.double()
    # the dequantised weight is rounded once to x.dtype, then one matmul in x.dtype
    eps = torch.finfo(dtype).eps
    bound = (
        2 * eps * (x.double().abs() @ dequantize_weight_ref(q, s).double().abs().T + bias.double().abs())
        + 1e-30
    )
    assert ((out.double() - want).abs() <= bound * (k**0.5 + 2)).all()


def test_reference_linear_refuses_bad_operands() -> None:
    q, s = quantize_weight_ref(torch.randn(8, 16), "channel")
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="weight must be float8_e4m3fn"):
        fp8_linear_ref(x, q.float(), s, None)
    with pytest.raises(ValueError, match="weight_scale must be float32"):
        fp8_linear_ref(x, q, s.double(), None)
    with pytest.raises(ValueError, match="per-channel scale has 7 entries for a weight of 8 rows"):
        fp8_linear_ref(x, q, s[:7], None)
    with pytest.raises(ValueError, match=r"block scale has shape \[2, 1\], expected \[1, 1\]"):
        fp8_linear_ref(x, q, torch.ones(2, 1), None)
    with pytest.raises(ValueError, match="scheme 'row' is not one of"):
        quantize_weight_ref(torch.randn(4, 4), "row")


@pytest.mark.parametrize("group", [None, 128])
def test_activation_quantisation_per_token(group: int | None) -> None:
    x = torch.randn(5, 300) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 5.0])[:, None]
    q, s = quantize_rows_ref(x, group)
    assert s.shape == ((5,) if group is None else (5, 3))
    full = s[:, None].expand(5, 300) if group is None else s.repeat_interleave(128, 1)[:, :300]
    assert _scaled_error_ok(x, q.float() * full, full.double())
    assert torch.equal(q[3].float(), torch.zeros(300))


# ---- checkpoints: ModelOpt per-tensor and block-scaled -------------------------------------------------
def _tiny_dir(root: Path, variant: str = "dense") -> Path:
    return make_tiny(root / f"tiny-{variant}", variant=variant, seed=3)


# how each format stores a weight's scales: (scheme, scale tensor name suffix, the stored shape of the scales)
_LAYOUTS = {
    "tensor": ("tensor", ".weight_scale", lambda s: s),
    "tensor_1": ("tensor", ".weight_scale", lambda s: s.reshape(1)),  # compressed-tensors' [1]
    "block": ("block", ".weight_scale_inv", lambda s: s),
    "channel": ("channel", ".weight_scale", lambda s: s.reshape(-1, 1)),  # [N, 1]
    "pb_wo": ("block", ".weight_scale", lambda s: s[:, None, :, None]),  # ModelOpt's [N/128, 1, K/128, 1]
}


def _quantize_checkpoint(
    src: Path,
    dst: Path,
    qc: dict[str, Any],
    *,
    skip: tuple[str, ...] = (),
    layout: str | None = None,
    only: set[str] | None = None,
    block_experts: bool = True,
) -> dict[str, Any]:
    """dst: src's checkpoint with every projection weight (not in `skip`; in `only` where given) as e4m3 plus
    its scales in `layout` (by default the format `qc` names: block for weight_block_size, else tensor);
    block_experts False keeps the routed experts 16-bit in a block-scaled checkpoint. Returns the tensors
    written."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    layout = layout or ("block" if qc.get("weight_block_size") is not None else "tensor")
    scheme, suffix, stored = _LAYOUTS[layout]
    block = scheme == "block"
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            stem = name.removesuffix(".weight")
            routed = ".experts." in name
            if (
                name.endswith(".weight")
                and stem.rsplit(".", 1)[-1] in QUANTIZABLE_LINEARS
                and stem not in skip
                and (only is None or stem in only)
                and not (routed and block and not block_experts)
            ):
                q, s = quantize_weight_ref(t, scheme)
                out[name] = q
                out[stem + suffix] = stored(s)
                if scheme == "tensor":
                    out[stem + ".input_scale"] = torch.tensor(0.5)
            else:
                out[name] = t
    save_file(out, str(dst / "model.safetensors"))
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / extra).is_file():
            (dst / extra).write_text((src / extra).read_text())
    return out


def _load(d: Path, **opts: Any):
    return load_model(build_engine_config({"model": str(d), "device": "cpu", **opts}))


def _logits(lm: Any, tokens: list[int]) -> torch.Tensor:
    return Harness(lm.model, max_seqs=2, max_len=64).step([(0, tokens)], all_logits=True)


def _close_logits(lm: Any, ref: Any) -> None:
    """FP8 against the 16-bit model on 40 tokens: relative logit error within e4m3's few per cent per layer
    (3-bit mantissas: about 3.6% rms per weight) and the greedy choice mostly the same."""
    toks = list(range(5, 45))
    a, b = _logits(lm, toks), _logits(ref, toks)
    rel = ((a - b).norm() / b.norm()).item()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"relative logit error {rel:.4f}, greedy agreement {agree:.3f}")
    assert 0 < rel < 0.15 and agree >= 0.7, (rel, agree)


@pytest.mark.parametrize("variant", ["dense", "latent-moe"])
def test_modelopt_checkpoint_loads_e4m3_weights_and_scales(tmp_path: Path, variant: str) -> None:
    src = _tiny_dir(tmp_path, variant)
    skip = ("backbone.layers.0.mixer.in_proj",)
    qc = {
        "quant_method": "modelopt",
        "quant_algo": "FP8",
        "exclude_modules": ["model.layers.0.mixer.in_proj"],
    }
    written = _quantize_checkpoint(src, tmp_path / "fp8", qc, skip=skip)
    lm = _load(tmp_path / "fp8")
    layers = dict(fp8_layers(lm.model))
    assert "backbone.layers.0.mixer.in_proj" not in layers  # excluded: 16-bit as the checkpoint holds it
    assert lm.model.get_submodule("backbone.layers.0.mixer.in_proj").weight.dtype == torch.float32
    want = {
        n.removesuffix(".weight")
        for n in written
        if n.endswith(".weight") and written[n].dtype == E4M3 and ".experts." not in n
    }
    assert set(layers) == want and len(want) > 8
    for name, layer in layers.items():
        assert torch.equal(layer.weight.view(torch.uint8), written[name + ".weight"].view(torch.uint8))
        assert torch.equal(layer.weight_scale, written[name + ".weight_scale"].expand(layer.weight.shape[0]))
    experts = [(n, m) for n, m in lm.model.named_modules() if n.endswith(".experts")]
    assert bool(experts) == (variant != "dense")
    for name, m in experts:  # routed experts: e4m3 per expert, the per-tensor scale held per channel
        assert m.quant is not None and m.up_proj.dtype == m.down_proj.dtype == E4M3
        for e in range(m.shard.num_experts):
            for which in ("up", "down"):
                w = written[f"{name}.{e}.{which}_proj.weight"]
                assert torch.equal(getattr(m, f"{which}_proj")[e].view(torch.uint8), w.view(torch.uint8))
                sc = getattr(m, f"{which}_proj_scale")[e]
                assert torch.equal(sc, written[f"{name}.{e}.{which}_proj.weight_scale"].expand(sc.shape[0]))
    _close_logits(lm, _load(src))


def test_block_scaled_checkpoint_loads(tmp_path: Path) -> None:
    src = _tiny_dir(tmp_path)
    written = _quantize_checkpoint(
        src, tmp_path / "blk", {"quant_method": "fp8", "weight_block_size": [128, 128]}
    )
    lm = _load(tmp_path / "blk")
    assert lm.config.quant.scheme == "block"
    layers = dict(fp8_layers(lm.model))
    assert len(layers) == sum(1 for n in written if n.endswith("weight_scale_inv"))
    for name, layer in layers.items():
        assert torch.equal(layer.weight_scale, written[name + ".weight_scale_inv"])
        n, k = layer.weight.shape
        assert layer.weight_scale.shape == (math.ceil(n / 128), math.ceil(k / 128))


@pytest.mark.parametrize(
    ("algo", "layout"), [("FP8_PER_CHANNEL_PER_TOKEN", "channel"), ("FP8_PB_WO", "pb_wo")]
)
@pytest.mark.parametrize("variant", ["dense", "latent-moe"])
def test_modelopt_channel_and_block_checkpoints_load(
    tmp_path: Path, algo: str, layout: str, variant: str
) -> None:
    """ModelOpt's per-channel ([N, 1] scales) and block-scaled ([N/128, 1, K/128, 1]) checkpoints: e4m3 bytes
    and scales as written; routed experts carry per-channel scales (block-scaled ones re-quantised)."""
    src = _tiny_dir(tmp_path, variant)
    qc = {"quant_method": "modelopt", "quant_algo": algo, "ignore": ["lm_head"]}
    written = _quantize_checkpoint(src, tmp_path / "fp8", qc, layout=layout)
    lm = _load(tmp_path / "fp8")
    assert lm.config.quant.scheme == _LAYOUTS[layout][0]
    layers = dict(fp8_layers(lm.model))
    assert len(layers) > 8 and len(layers) == sum(
        1 for n in written if n.endswith(".weight_scale") and ".experts." not in n
    )
    for name, layer in layers.items():
        assert torch.equal(layer.weight.view(torch.uint8), written[name + ".weight"].view(torch.uint8))
        assert torch.equal(
            layer.weight_scale, written[name + ".weight_scale"].reshape(layer.weight_scale.shape)
        )
    for name, m in lm.model.named_modules():
        if name.endswith(".experts"):
            assert m.quant is not None
            if layout == "channel":
                for e in range(m.shard.num_experts):
                    assert torch.equal(
                        m.down_proj_scale[e], written[f"{name}.{e}.down_proj.weight_scale"].reshape(-1)
                    )
    _close_logits(lm, _load(src))


@pytest.mark.parametrize(
    ("strategy", "layout"), [("tensor", "tensor_1"), ("channel", "channel"), ("block", "block")]
)
def test_compressed_tensors_checkpoint_loads(tmp_path: Path, strategy: str, layout: str) -> None:
    """An llm-compressor FP8 checkpoint (weight_scale [1], [N, 1] or [N/128, K/128]; the per-tensor one with
    static input_scales, read past) loads byte for byte, its experts FP8 (block-scaled ones re-quantised)."""
    src = _tiny_dir(tmp_path, "latent-moe")
    qc = _ct_config(strategy, static_act=strategy == "tensor")
    written = _quantize_checkpoint(src, tmp_path / "ct", qc, layout=layout)
    if strategy == "block":  # compressed-tensors names block scales weight_scale too
        written = {n.replace(".weight_scale_inv", ".weight_scale"): t for n, t in written.items()}
        save_file(written, str(tmp_path / "ct" / "model.safetensors"))
    lm = _load(tmp_path / "ct")
    assert (lm.config.quant.method, lm.config.quant.scheme) == ("compressed-tensors", strategy)
    layers = dict(fp8_layers(lm.model))
    assert len(layers) > 8
    for name, layer in layers.items():
        assert torch.equal(layer.weight.view(torch.uint8), written[name + ".weight"].view(torch.uint8))
        sc = written[name + ".weight_scale"]
        assert torch.equal(
            layer.weight_scale,
            sc.reshape(()).expand(layer.weight.shape[0])
            if strategy == "tensor"
            else sc.reshape(layer.weight_scale.shape),
        )
    assert all(m.quant is not None for n, m in lm.model.named_modules() if n.endswith(".experts"))
    _close_logits(lm, _load(src))


def test_mixed_precision_checkpoint_loads_listed_modules_as_fp8(tmp_path: Path) -> None:
    """A MIXED_PRECISION checkpoint whose quantized_layers list half the projections: those load as e4m3,
    the rest as the 16-bit tensors the checkpoint holds."""
    src = _tiny_dir(tmp_path, "latent-moe")
    ref = _load(src)
    names = [
        n
        for n, m in ref.model.named_modules()
        if n.rsplit(".", 1)[-1] in QUANTIZABLE_LINEARS and ".experts" not in n
    ]
    only = set(names[::2])
    experts = next(n for n, _ in ref.model.named_modules() if n.endswith(".experts"))
    n_exp = ref.model.get_submodule(experts).shard.num_experts
    only |= {f"{experts}.{e}.{w}" for e in range(n_exp) for w in ("up_proj", "down_proj")}
    qc = {
        "quant_method": "modelopt",
        "quant_algo": "MIXED_PRECISION",
        "quantized_layers": {
            n.replace("backbone.", "model.", 1): {"quant_algo": "FP8"} for n in sorted(only)
        },
    }
    written = _quantize_checkpoint(src, tmp_path / "mixed", qc, only=only)
    lm = _load(tmp_path / "mixed")
    assert set(dict(fp8_layers(lm.model))) == {n for n in only if ".experts." not in n}
    for n in set(names) - only:
        assert lm.model.get_submodule(n).weight.dtype == torch.float32
    fp8_experts = {n for n, m in lm.model.named_modules() if n.endswith(".experts") and m.quant is not None}
    assert fp8_experts == {experts}
    m = lm.model.get_submodule(experts)
    assert torch.equal(
        m.up_proj[0].view(torch.uint8), written[f"{experts}.0.up_proj.weight"].view(torch.uint8)
    )
    buffers = sum(b.numel() * b.element_size() for b in lm.model.buffers())
    assert (
        weight_bytes(lm.config, torch.float32) == tensor_bytes(lm.model)[0] - buffers
    )  # the planner's count
    _close_logits(lm, ref)


def test_checkpoint_errors_name_the_fp8_tensors(tmp_path: Path) -> None:
    src = _tiny_dir(tmp_path)
    qc = {"quant_method": "modelopt", "quant_algo": "FP8"}
    written = _quantize_checkpoint(src, tmp_path / "fp8", qc)
    # the config loses its quantization_config: e4m3 tensors for 16-bit parameters
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    cfg.pop("quantization_config")
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"float8 tensors for 16-bit parameters .*\n.*in_proj.weight \(F8_E4M3"
    ):
        _load(tmp_path / "fp8")
    # an e4m3 weight without its scale
    cfg["quantization_config"] = qc
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    dropped = {k: v for k, v in written.items() if k != "backbone.layers.1.mixer.q_proj.weight_scale"}
    save_file(dropped, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"missing tensors \(1\):\n    backbone.layers.1.mixer.q_proj.weight_scale"
    ):
        _load(tmp_path / "fp8")
    bad = dict(written)
    bad["backbone.layers.1.mixer.q_proj.weight_scale"] = torch.tensor(-1.0)
    save_file(bad, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(ValueError, match="weight scales must be positive and finite"):
        _load(tmp_path / "fp8")
    bad["backbone.layers.1.mixer.q_proj.weight_scale"] = torch.ones(3)
    save_file(bad, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"q_proj.weight_scale: expected \[\], got \[3\]"):
        _load(tmp_path / "fp8")


# ---- online quantisation -------------------------------------------------------------------------------
_SIXTEEN_BIT = ("embeddings", "lm_head", "norm", "gate", "conv1d", "A_log", ".D", "dt_bias", "bias")


def _check_online(lm: Any, ref: Any) -> None:
    ref_params = dict(ref.model.named_parameters())
    layers = dict(fp8_layers(lm.model))
    assert layers and all(n.rsplit(".", 1)[-1] in QUANTIZABLE_LINEARS for n in layers)
    for name, layer in layers.items():
        q, s = quantize_weight_ref(ref_params[name + ".weight"].detach(), "channel")
        assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(layer.weight_scale, s), name
    experts = {n for n, m in lm.model.named_modules() if n.endswith(".experts")}
    for name in experts:  # routed experts: each expert's matrix quantised per output channel
        m = lm.model.get_submodule(name)
        for which in ("up", "down"):
            ref_w = ref_params[f"{name}.{which}_proj"].detach()
            for e in range(ref_w.shape[0]):
                q, s = quantize_weight_ref(ref_w[e], "channel")
                assert torch.equal(getattr(m, f"{which}_proj")[e].view(torch.uint8), q.view(torch.uint8))
                assert torch.equal(getattr(m, f"{which}_proj_scale")[e], s)
    for name, p in lm.model.named_parameters():
        if name.rsplit(".", 1)[0] in experts or name.endswith(".weight_scale"):
            continue
        if name.removesuffix(".weight") not in layers:
            assert p.dtype != E4M3, name
            assert torch.equal(p, ref_params[name]), name  # untouched: the same 16/32-bit values
    _close_logits(lm, ref)


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_online_quantisation_of_a_16_bit_checkpoint(tmp_path: Path, variant: str) -> None:
    src = _tiny_dir(tmp_path, variant)
    lm, ref = _load(src, quantization="fp8"), _load(src)
    assert lm.config.quant.method == "online" and "quantised at load" in lm.config.describe()
    _check_online(lm, ref)
    total, fp8 = tensor_bytes(lm.model)
    assert fp8 > 0 and total < tensor_bytes(ref.model)[0]


def test_online_quantisation_of_dummy_weights(tmp_path: Path) -> None:
    src = _tiny_dir(tmp_path)
    _check_online(
        _load(src, quantization="fp8", load_format="dummy", seed=5), _load(src, load_format="dummy", seed=5)
    )


def test_dummy_fp8_experts_are_drawn_and_quantised_one_expert_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random FP8 experts stream: each expert's matrix reaches its loader alone (`loads_by_row`), never the
    whole stacked float32 tensor (5.6 GB an expert tensor in Nemotron 3 Super), with the values of the whole
    draw (test_online_quantisation_of_dummy_weights checks those)."""
    from hyserve.model import fp8_weights

    shapes: list[tuple[int, ...]] = []
    load = fp8_weights.Fp8ExpertLoaders.load_weight

    def spy(self: Any, param: torch.Tensor, loaded: torch.Tensor, expert: int | None = None) -> None:
        shapes.append(tuple(loaded.shape))
        load(self, param, loaded, expert)

    monkeypatch.setattr(fp8_weights.Fp8ExpertLoaders, "load_weight", spy)
    lm = _load(_tiny_dir(tmp_path, "moe"), quantization="fp8", load_format="dummy", seed=5)
    cfg = lm.config
    experts = [m for m in lm.model.modules() if type(m).__name__ == "Experts"]
    assert experts and len(shapes) == 2 * cfg.n_routed_experts * len(experts)
    assert all(len(s) == 2 for s in shapes), shapes[:4]


def test_dummy_weights_with_a_block_fp8_config(tmp_path: Path) -> None:
    src = _tiny_dir(tmp_path)
    d = tmp_path / "cfg-only"
    d.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (d / "config.json").write_text(
        json.dumps({**cfg, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    )
    lm, ref = _load(d, load_format="dummy", seed=2), _load(src, load_format="dummy", seed=2)
    refp = dict(ref.model.named_parameters())
    for name, layer in fp8_layers(lm.model):
        q, s = quantize_weight_ref(refp[name + ".weight"].detach(), "block")
        assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(
            layer.weight_scale, s
        )


# ---- tensor-parallel shards: simulated ranks in this process ---------------------------------------------
def _group(rank: int, size: int) -> Group:
    return Group(name="tp", rank=rank, size=size, ranks=tuple(range(size)), timeout_s=1.0)


def _parts(unit: int) -> list[ShardedPart]:
    # Mamba-like in_proj [z | x | B | C | dt] with units of `unit` rows
    return [
        ShardedPart(name="z", units=4, unit_size=unit),
        ShardedPart(name="x", units=4, unit_size=unit),
        ShardedPart(name="B", units=2, unit_size=unit),
        ShardedPart(name="C", units=2, unit_size=unit),
        ShardedPart(name="dt", units=4, unit_size=unit),
    ]


def _local_rows(parts: list[ShardedPart], rank: int, tp: int, full: torch.Tensor) -> torch.Tensor:
    out, off = [], 0
    for p in parts:
        start, n = p.rows(rank, tp)
        out.append(full[off + start : off + start + n])
        off += p.size
    return torch.cat(out)


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
@pytest.mark.parametrize("tp", [2, 4])
def test_column_parallel_fp8_shards(scheme: str, tp: int) -> None:
    parts = _parts(
        128
    )  # every rank's share of every part is whole 128-row blocks (B and C replicated at tp 4)
    n, k = sum(p.size for p in parts), 256
    w = torch.randn(n, k)
    q, s = quantize_weight_ref(w, scheme)
    quant = QuantConfig(method="fp8" if scheme == "block" else "modelopt", scheme=scheme)
    for r in range(tp):
        layer = MergedColumnParallelLinear(k, parts, group=_group(r, tp))
        convert_linear(layer, quant)
        layer.weight.weight_loader(layer.weight, q)
        layer.weight_scale.weight_loader(layer.weight_scale, s)
        want_q = _local_rows(parts, r, tp, q.view(torch.uint8))
        assert torch.equal(layer.weight.view(torch.uint8), want_q)
        if scheme == "block":  # the same parts in units of one block row
            blocks = [ShardedPart(name=p.name, units=p.units) for p in parts]
            assert torch.equal(layer.weight_scale, _local_rows(blocks, r, tp, s))
        else:
            full_s = s.expand(n) if scheme == "tensor" else s
            assert torch.equal(layer.weight_scale, _local_rows(parts, r, tp, full_s))
        # the rank's product is its rows of the whole layer's
        x = torch.randn(3, k)
        assert torch.allclose(
            layer(x), _local_rows(parts, r, tp, fp8_linear_ref(x, q, s if s.dim() else s.expand(n), None).T).T
        )


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_row_parallel_fp8_shards(scheme: str) -> None:
    tp, n, k = 2, 192, 512
    w = torch.randn(n, k)
    q, s = quantize_weight_ref(w, scheme)
    x = torch.randn(4, k)
    total = torch.zeros(4, n)
    for r in range(tp):
        layer = RowParallelLinear(k, n, unit_size=128, group=_group(r, tp))
        convert_linear(layer, QuantConfig(method="fp8" if scheme == "block" else "online", scheme=scheme))
        layer.weight.weight_loader(layer.weight, q)
        layer.weight_scale.weight_loader(layer.weight_scale, s)
        assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)[:, r * 256 : (r + 1) * 256])
        want_s = s if scheme == "channel" else s[:, r * 2 : (r + 1) * 2]
        assert torch.equal(layer.weight_scale, want_s)
        total += layer.matmul(x[:, r * 256 : (r + 1) * 256], bias=False)
    assert torch.allclose(total, fp8_linear_ref(x, q, s, None), atol=1e-4)


def test_online_row_parallel_scales_come_from_whole_rows() -> None:
    """A 16-bit weight quantised by a row-parallel shard's loader uses the whole row's amax: every tp_size
    holds the same e4m3 values and scales."""
    n, k = 64, 256
    w = torch.randn(n, k)
    q, s = quantize_weight_ref(w, "channel")
    for tp in (1, 2, 4):
        for r in range(tp):
            layer = RowParallelLinear(k, n, group=_group(r, tp))
            convert_linear(layer, ONLINE)
            layer.weight.weight_loader(layer.weight, w)
            c = k // tp
            assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)[:, r * c : (r + 1) * c])
            assert torch.equal(layer.weight_scale, s)


def test_online_column_parallel_quantises_its_own_rows_and_parts() -> None:
    parts = [ShardedPart(name="q", units=4, unit_size=8), ShardedPart(name="k", units=1, unit_size=8)]
    wq, wk = torch.randn(32, 16), torch.randn(8, 16)
    for r in range(2):
        layer = MergedColumnParallelLinear(16, parts, group=_group(r, 2))
        convert_linear(layer, ONLINE)
        layer.weight.weight_loader(layer.weight, wq, "q")
        layer.weight.weight_loader(layer.weight, wk.to(torch.bfloat16), "k")
        q, s = quantize_weight_ref(
            torch.cat([wq[r * 16 : (r + 1) * 16], wk.to(torch.bfloat16).float()]), "channel"
        )
        assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(layer.weight_scale, s)


def test_block_split_off_a_block_boundary_is_refused() -> None:
    parts = [ShardedPart(name="z", units=4, unit_size=80), ShardedPart(name="dt", units=4)]
    quant = QuantConfig(method="fp8", scheme="block")
    layer = MergedColumnParallelLinear(256, parts, group=_group(0, 2))
    with pytest.raises(
        ValueError,
        match=r"rank 0's share of part 'z' is rows \[0, 160\) of 324, which does "
        r"not fall on 128-rows block boundaries.*tp_size 2",
    ):
        convert_linear(layer, quant, "in_proj")
    row = RowParallelLinear(320, 64, unit_size=32, group=_group(1, 2))
    with pytest.raises(ValueError, match=r"rank 0's share of part 'in' is columns \[0, 160\) of 320"):
        convert_linear(row, quant)
    one = MergedColumnParallelLinear(256, parts, group=_group(0, 1))
    convert_linear(one, quant)  # one rank: the whole tensor, any size
    assert one.weight_scale.shape == (3, 2)


def test_fp8_loaders_refuse_bad_tensors() -> None:
    layer = ReplicatedLinear(16, 8)
    convert_linear(layer, QuantConfig(method="modelopt", scheme="tensor"))
    with pytest.raises(ValueError, match="cannot load a torch.int8 weight"):
        layer.weight.weight_loader(layer.weight, torch.zeros(8, 16, dtype=torch.int8))
    with pytest.raises(ValueError, match="a per-tensor weight_scale has one element, got shape"):
        layer.weight_scale.weight_loader(layer.weight_scale, torch.ones(2))
    with pytest.raises(ValueError, match=r"checkpoint tensor has shape \[8, 15\], expected \[8, 16\]"):
        layer.weight.weight_loader(layer.weight, torch.zeros(8, 15, dtype=E4M3))
    blk = ColumnParallelLinear(16, 8, group=_group(0, 1))
    convert_linear(blk, QuantConfig(method="fp8", scheme="block"))
    with pytest.raises(ValueError, match=r"block weight_scale has shape \[2, 1\], expected \[1, 1\]"):
        blk.weight_scale.weight_loader(blk.weight_scale, torch.ones(2, 1))
    with pytest.raises(ValueError, match="must be positive and finite"):
        blk.weight_scale.weight_loader(blk.weight_scale, torch.full((1, 1), float("nan")))


def test_converted_layers_survive_meta_build_and_to_empty() -> None:
    with torch.device("meta"):
        layer = RowParallelLinear(64, 32, group=_group(0, 1))
        convert_linear(layer, ONLINE)
    layer = layer.to_empty(device="cpu")
    w = torch.randn(32, 64)
    layer.weight.weight_loader(layer.weight, w)
    q, s = quantize_weight_ref(w, "channel")
    assert torch.equal(layer.weight_scale, s) and layer.weight.dtype == E4M3
    assert layer.weight.checkpoint_shape == (32, 64) and layer.weight_scale.checkpoint_shape == (32,)


# ---- two gloo ranks ------------------------------------------------------------------------------------
@torch.inference_mode()
def _case_fp8_tp2(path: str) -> dict[str, float]:
    g = tp_group()
    r, tp = g.rank, g.size
    errs: dict[str, float] = {}
    with safe_open(path, framework="pt") as f:
        full = {k: f.get_tensor(k) for k in f.keys()}
        x = full["x"]
        for scheme in ("tensor", "block"):
            quant = QuantConfig(method="fp8", scheme=scheme)
            parts = _parts(128)
            col = MergedColumnParallelLinear(256, parts)
            convert_linear(col, quant)
            col.weight.weight_loader(col.weight, f.get_slice(f"{scheme}.col.weight"))
            col.weight_scale.weight_loader(col.weight_scale, f.get_slice(f"{scheme}.col.scale"))
            want = fp8_linear_ref(
                x, full[f"{scheme}.col.weight"], _s(full[f"{scheme}.col.scale"], 2048), None
            )
            errs[f"{scheme} column"] = (col(x) - _local_rows(parts, r, tp, want.T).T).abs().max().item()
            row = RowParallelLinear(1024, 256, bias=True, unit_size=128)
            convert_linear(row, quant)
            row.weight.weight_loader(row.weight, f.get_slice(f"{scheme}.row.weight"))
            row.weight_scale.weight_loader(row.weight_scale, f.get_slice(f"{scheme}.row.scale"))
            row.bias.weight_loader(row.bias, f.get_slice("row.bias"))  # type: ignore[union-attr]
            h = full["h"]
            want = fp8_linear_ref(
                h, full[f"{scheme}.row.weight"], _s(full[f"{scheme}.row.scale"], 256), full["row.bias"]
            )
            errs[f"{scheme} row"] = (row(h.chunk(tp, -1)[r]) - want).abs().max().item()
    return errs


def _s(scale: torch.Tensor, n: int) -> torch.Tensor:
    return scale.expand(n).contiguous() if scale.dim() == 0 else scale


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2, timeout_s=10.0)
    yield p
    p.close()


@pytest.mark.slow  # two gloo ranks
def test_fp8_layers_at_tp2_match_the_unsharded_layer(pool: RankPool, tmp_path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {
        "x": torch.randn(5, 256),
        "h": torch.randn(5, 1024),
        "row.bias": torch.randn(256),
    }
    n_col = sum(p.size for p in _parts(128))
    for scheme in ("tensor", "block"):
        q, s = quantize_weight_ref(torch.randn(n_col, 256), scheme)
        tensors[f"{scheme}.col.weight"], tensors[f"{scheme}.col.scale"] = q, s
        q, s = quantize_weight_ref(torch.randn(256, 1024), scheme)
        tensors[f"{scheme}.row.weight"], tensors[f"{scheme}.row.scale"] = q, s
    path = tmp_path / "fp8.safetensors"
    save_file(tensors, str(path))
    for rank, errs in enumerate(pool.run(_case_fp8_tp2, str(path))):
        assert len(errs) == 4
        bad = {k: v for k, v in errs.items() if not v <= 1e-4}
        assert not bad, f"rank {rank}: {bad}"


# ---- weight bytes ---------------------------------------------------------------------------------------
def test_weight_bytes_match_the_built_model(tmp_path: Path) -> None:
    src = _tiny_dir(tmp_path, "latent-moe")
    blk = tmp_path / "blk"  # a block-scaled config: block scales for projections, channel scales for experts
    blk.mkdir()
    (blk / "config.json").write_text(
        json.dumps(
            {
                **json.loads((src / "config.json").read_text()),
                "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
            }
        )
    )
    for d, opts in ((src, {}), (src, {"quantization": "fp8"}), (blk, {})):
        lm = _load(d, load_format="dummy", **opts)
        total, _ = tensor_bytes(lm.model)
        buffers = sum(b.numel() * b.element_size() for b in lm.model.buffers())
        assert weight_bytes(lm.config, torch.float32) == total - buffers


# ---- the capacity planner -------------------------------------------------------------------------------
CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
H200_BYTES = 143_771_533_312  # what torch reports as an H200's total memory


def _plan_on_device(cfg: Any, free: int) -> Any:
    from hyserve.cache.capacity import CapacityInputs, device_cache_budget, plan_capacity

    budget = device_cache_budget(free, 0.9, reserved_bytes=3 * 2**30)
    return plan_capacity(
        CapacityInputs(
            budget_bytes=budget,
            kv_bytes_per_token=cfg.kv_bytes_per_token,
            state_bytes_per_slot=cfg.state_bytes_per_sequence,
            max_batch_size=64,
            max_seq_len=131072,
            max_num_tokens=8192,
            tokens_per_block=64,
            enable_block_reuse=True,
            periodic_snapshot_interval=256,
            num_snapshot_offsets=1,
            avg_seq_len=None,
            num_pad_slots=1,
            weight_bytes=weight_bytes(cfg),
            weight_format=cfg.quant.describe() if cfg.quant else "16-bit",
        )
    )


def test_fp8_weights_give_the_cache_the_memory_they_free() -> None:
    """Nano 9B v2 on an H200: the pools' budget is taken from the memory free once the weights are resident;
    FP8 projections (1 byte + scales) leave ~7 GiB more, and the planner gives fraction (0.9) of it to the
    KV blocks and snapshot slots: a bigger cache than bf16 for the same model and settings."""
    from hyserve.model.nemotron_h.config import HybridModelConfig

    bf16 = HybridModelConfig.from_hf(CONFIGS / "NVIDIA-Nemotron-Nano-9B-v2")
    fp8 = bf16.with_quant(ONLINE)
    wb, wq = weight_bytes(bf16), weight_bytes(fp8)
    assert wb == 2 * bf16.num_parameters()
    assert 0.5 * wb < wq < 0.6 * wb  # embeddings and lm_head stay bf16
    a, b = _plan_on_device(bf16, H200_BYTES - wb), _plan_on_device(fp8, H200_BYTES - wq)
    assert b.inputs.budget_bytes - a.inputs.budget_bytes == int((H200_BYTES - wq) * 0.9) - int(
        (H200_BYTES - wb) * 0.9
    )
    # the pools take what they can use of fraction x the freed bytes (whole blocks and slots)
    assert b.total_bytes - a.total_bytes > 0.99 * 0.9 * (wb - wq) > 6 * 2**30
    assert b.num_kv_blocks >= a.num_kv_blocks and b.num_snapshot_slots >= a.num_snapshot_slots
    assert (b.num_kv_blocks, b.num_snapshot_slots) != (a.num_kv_blocks, a.num_snapshot_slots)
    assert "fp8 e4m3 weights (quantised at load, per-output-channel scales)" in b.report()
    assert "16-bit (resident before the budget" in a.report()


def test_weights_that_cannot_fit_are_refused_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    from hyserve.engine.runner import model_loader
    from hyserve.model.nemotron_h.config import HybridModelConfig

    cfg = HybridModelConfig.from_hf(CONFIGS / "NVIDIA-Nemotron-3-Super-120B-A12B-BF16")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (H200_BYTES - 2**30, H200_BYTES))
    with pytest.raises(
        ValueError,
        match=r"the weights need 2\d\d\.\d GiB on each of 1 rank\(s\) \(FP8 weights, "
        r"`quantization: fp8`, hold about half of that\) but cuda:0 has 132\.9 GiB",
    ):
        model_loader.check_weights_fit(weight_bytes(cfg), None, torch.device("cuda:0"))
    small = HybridModelConfig.from_hf(CONFIGS / "NVIDIA-Nemotron-Nano-9B-v2")
    model_loader.check_weights_fit(weight_bytes(small), None, torch.device("cuda:0"))  # fits: no error


def test_fp8_models_warm_up_every_fp8_launch_form(tmp_path: Path) -> None:
    from hyserve.kernels.triton_fp8_linear import SMALL_M

    src = _tiny_dir(tmp_path)
    assert _load(src).model.kernel_token_buckets(8192) == []
    assert _load(src, quantization="fp8").model.kernel_token_buckets(8192) == [1, 2, SMALL_M + 1, 65]
    assert _load(src, quantization="fp8").model.kernel_token_buckets(40) == [1, 2, SMALL_M + 1]


# ---- FP8 routed experts under expert / tensor parallelism (simulated ranks) ------------------------------
def _experts(rank_ep: int, ep: int, rank_tp: int, mtp: int, quant: QuantConfig, num=4, dim=32, inter=16):
    from hyserve.model.fp8_weights import convert_experts
    from hyserve.model.moe import Experts

    m = Experts(
        num,
        dim,
        inter,
        ep=Group(name="ep", rank=rank_ep, size=ep, ranks=tuple(range(ep)), timeout_s=1.0),
        moe_tp=Group(name="moe_tp", rank=rank_tp, size=mtp, ranks=tuple(range(mtp)), timeout_s=1.0),
    )
    assert convert_experts(m, quant, "backbone.layers.1.mixer.experts")
    return m


@pytest.mark.parametrize("per_expert", [False, True])
def test_online_fp8_experts_shard_over_ep_and_moe_tp(per_expert: bool) -> None:
    """Each rank holds its experts' rows (up) / columns (down) of the intermediate dimension, quantised from
    each expert's whole matrix: every (ep, tp) split holds the same e4m3 values and channel scales."""
    up, down = torch.randn(4, 16, 32), torch.randn(4, 32, 16)
    qs = {
        w: [quantize_weight_ref(m[e], "channel") for e in range(4)] for w, m in (("up", up), ("down", down))
    }
    for r_ep, r_tp in ((0, 0), (0, 1), (1, 0), (1, 1)):
        m = _experts(r_ep, 2, r_tp, 2, ONLINE)
        for e in range(4) if per_expert else (None,):
            m.up_proj.weight_loader(m.up_proj, up if e is None else up[e], e)
            m.down_proj.weight_loader(m.down_proj, down if e is None else down[e], e)
        for i in range(2):
            e = 2 * r_ep + i
            rows = slice(8 * r_tp, 8 * r_tp + 8)
            assert torch.equal(m.up_proj[i].view(torch.uint8), qs["up"][e][0].view(torch.uint8)[rows])
            assert torch.equal(m.up_proj_scale[i], qs["up"][e][1][rows])
            assert torch.equal(m.down_proj[i].view(torch.uint8), qs["down"][e][0].view(torch.uint8)[:, rows])
            assert torch.equal(
                m.down_proj_scale[i], qs["down"][e][1]
            )  # whole rows of down: every rank the same


def test_checkpoint_fp8_experts_load_per_tensor_scales_per_expert() -> None:
    quant = QuantConfig(method="modelopt", scheme="tensor")
    up = torch.randn(4, 16, 32)
    q = [quantize_weight_ref(up[e], "tensor") for e in range(4)]
    m = _experts(1, 2, 1, 2, quant)
    assert m.up_proj_scale.checkpoint_shape == (4,)
    for e in range(4):
        m.up_proj.weight_loader(m.up_proj, q[e][0], e)
        m.up_proj_scale.weight_loader(m.up_proj_scale, q[e][1], e)
    for i in range(2):
        assert torch.equal(m.up_proj[i].view(torch.uint8), q[2 + i][0].view(torch.uint8)[8:])
        assert torch.equal(m.up_proj_scale[i], q[2 + i][1].expand(8))
    with pytest.raises(ValueError, match="a per-tensor expert scale has one element"):
        m.up_proj_scale.weight_loader(m.up_proj_scale, torch.ones(3), 2)
    with pytest.raises(ValueError, match="weight scales must be positive and finite"):
        m.up_proj_scale.weight_loader(m.up_proj_scale, torch.tensor(0.0), 2)
    with pytest.raises(ValueError, match=r"checkpoint tensor has shape \[16, 31\], expected \[16, 32\]"):
        m.up_proj.weight_loader(m.up_proj, torch.randn(16, 31), 2)


@pytest.mark.parametrize("layout", ["block", "pb_wo"])
def test_block_scaled_experts_are_requantised_per_channel(tmp_path: Path, layout: str) -> None:
    """A block-scaled checkpoint's e4m3 experts load as e4m3 with channel scales: each expert dequantised
    from its codes and block scales, then quantised per row, the same values at every ep split and whether
    the weight or its scales come first; leftovers and scales of a 16-bit weight are refused."""
    from hyserve.kernels.fp8_linear import dequantize_weight_ref
    from hyserve.model.fp8_weights import convert_experts
    from hyserve.model.moe import Experts

    src = _tiny_dir(tmp_path, "moe")
    d = tmp_path / "blk"
    qc = (
        {"quant_method": "fp8", "weight_block_size": [128, 128]}
        if layout == "block"
        else {"quant_method": "modelopt", "quant_algo": "FP8_PB_WO"}
    )
    written = _quantize_checkpoint(src, d, qc, layout=layout)
    lm = _load(d)
    suffix = _LAYOUTS[layout][1]
    found = 0
    for name, m in lm.model.named_modules():
        if not name.endswith(".experts"):
            continue
        assert m.quant is not None and m.up_proj.dtype == E4M3
        for e in range(m.shard.num_experts):
            for which in ("up", "down"):
                w = written[f"{name}.{e}.{which}_proj.weight"]
                sc = written[f"{name}.{e}.{which}_proj{suffix}"].reshape(
                    -(-w.shape[0] // 128), -(-w.shape[1] // 128)
                )
                q, s = quantize_weight_ref(dequantize_weight_ref(w, sc), "channel")
                assert torch.equal(getattr(m, f"{which}_proj")[e].view(torch.uint8), q.view(torch.uint8))
                assert torch.equal(getattr(m, f"{which}_proj_scale")[e], s)
                found += 1
    assert found
    _close_logits(lm, _load(src))
    # the scales before the weight, and the experts split over two ranks: the same rows
    up = torch.randn(4, 160, 136)
    qs = [quantize_weight_ref(up[e], "block") for e in range(4)]
    quant = QuantConfig(method="fp8", scheme="block")
    for ep_rank in (0, 1):
        m = Experts(
            4,
            136,
            160,
            ep=Group(name="ep", rank=ep_rank, size=2, ranks=(0, 1), timeout_s=1.0),
            device="cpu",
            dtype=torch.float32,
        )
        assert convert_experts(m, quant, "x.experts") and m.up_proj_scale.checkpoint_shape == (4, 2, 2)
        for e in range(4):
            m.up_proj_scale.weight_loader(m.up_proj_scale, qs[e][1], e)
            m.up_proj.weight_loader(m.up_proj, qs[e][0], e)
        for i in range(2):
            q, s = quantize_weight_ref(dequantize_weight_ref(*qs[2 * ep_rank + i]), "channel")
            assert torch.equal(m.up_proj[i].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(m.up_proj_scale[i], s)
        assert not m._fp8_up.pending
    with pytest.raises(
        ValueError,
        match=r"x.experts.up_proj \(FP8\): a block-scaled expert's scales have shape "
        r"\[3, 2\], expected \[2, 2\]",
    ):
        m.up_proj_scale.weight_loader(m.up_proj_scale, torch.ones(3, 2), 2)
    m.up_proj_scale.weight_loader(m.up_proj_scale, qs[2][1], 2)
    with pytest.raises(ValueError, match="expert 2's block scales given twice"):
        m.up_proj_scale.weight_loader(m.up_proj_scale, qs[2][1], 2)
    with pytest.raises(ValueError, match="incomplete: expert 2 has only its block scales"):
        m.after_checkpoint_load()
    with pytest.raises(ValueError, match="expert 2 has block scales but a 16-bit weight in the checkpoint"):
        m.up_proj.weight_loader(m.up_proj, up[2], 2)  # scales first, then a 16-bit weight
    m.up_proj.weight_loader(m.up_proj, up[3], 3)  # a 16-bit weight first (quantised per channel), then scales
    with pytest.raises(ValueError, match="expert 3 has block scales but a 16-bit weight in the checkpoint"):
        m.up_proj_scale.weight_loader(m.up_proj_scale, qs[3][1], 3)


def test_block_scaled_experts_stacked_and_split_over_moe_tp() -> None:
    """Stacked [E, ...] block-scaled expert tensors (one call each) with the intermediate dimension split over
    two moe_tp ranks: each rank's rows of up and columns of down are the rows / columns of the per-channel
    re-quantisation of the whole expert."""
    from hyserve.kernels.fp8_linear import dequantize_weight_ref
    from hyserve.model.fp8_weights import convert_experts
    from hyserve.model.moe import Experts

    up, down = torch.randn(3, 256, 136), torch.randn(3, 136, 256)
    qu = [quantize_weight_ref(up[e], "block") for e in range(3)]
    qd = [quantize_weight_ref(down[e], "block") for e in range(3)]
    quant = QuantConfig(method="fp8", scheme="block")
    for rank in (0, 1):
        m = Experts(
            3,
            136,
            256,
            moe_tp=Group(name="moe_tp", rank=rank, size=2, ranks=(0, 1), timeout_s=1.0),
            device="cpu",
            dtype=torch.float32,
        )
        assert convert_experts(m, quant, "y.experts")
        m.up_proj.weight_loader(m.up_proj, torch.stack([q for q, _ in qu]))
        m.down_proj_scale.weight_loader(m.down_proj_scale, torch.stack([s for _, s in qd]))
        m.up_proj_scale.weight_loader(m.up_proj_scale, torch.stack([s for _, s in qu]))
        m.down_proj.weight_loader(m.down_proj, torch.stack([q for q, _ in qd]))
        m.after_checkpoint_load()
        rows = slice(128 * rank, 128 * rank + 128)
        for e in range(3):
            q, sc = quantize_weight_ref(dequantize_weight_ref(*qu[e]), "channel")
            assert torch.equal(m.up_proj[e].view(torch.uint8), q.view(torch.uint8)[rows])
            assert torch.equal(m.up_proj_scale[e], sc[rows])
            q, sc = quantize_weight_ref(dequantize_weight_ref(*qd[e]), "channel")
            assert torch.equal(m.down_proj[e].view(torch.uint8), q.view(torch.uint8)[:, rows])
            assert torch.equal(m.down_proj_scale[e], sc)


def test_experts_take_one_format_for_up_and_down(tmp_path: Path) -> None:
    """A config that would quantise the routed experts' up_proj but not their down_proj (or the reverse) is
    refused naming the module, at build and in the capacity planner alike."""
    q = QuantConfig(
        method="compressed-tensors",
        scheme="channel",
        exclude=("re:.*experts\\.\\d+\\.down_proj$",),
        source="cfg",
    )
    with pytest.raises(
        ValueError,
        match=r"cfg: the routed experts backbone.layers.1.mixer.experts would have an FP8 "
        r"up_proj and a 16-bit down_proj; .* must quantise or exclude both",
    ):
        q.quantizes_experts("backbone.layers.1.mixer.experts")
    src = _tiny_dir(tmp_path, "latent-moe")
    d = _write_config(
        tmp_path / "split",
        **{
            **json.loads((src / "config.json").read_text()),
            "quantization_config": _ct_config(ignore=["re:.*experts.*up_proj$"]),
        },
    )
    with pytest.raises(ValueError, match="would have an FP8 down_proj and a 16-bit up_proj"):
        _load(d, load_format="dummy")


# ---- a whole FP8 model at tp 2 over two gloo ranks against tp 1 ----------------------------------------
def _tp_cfg(variant: str) -> Any:
    from hyserve.model.nemotron_h.config import HybridModelConfig
    from hyserve.model.tiny import tiny_config

    raw = {**tiny_config("dense" if variant == "spanning" else variant), "dtype": "float32"}
    if variant == "spanning":  # one Mamba group and one KV head, replicated: the gated norm spans the ranks
        raw.update(n_groups=1, num_key_value_heads=1)
    return HybridModelConfig.from_dict(raw, name=variant).with_quant(ONLINE)


def _tp_logits(cfg: Any, ckpt: str) -> tuple[int, int, list[torch.Tensor]]:
    """(tp size, FP8 modules, logits of a prefill step and three decode steps of two sequences)."""
    from hyserve.model.kv_scales import load_checkpoint_with_kv_scales
    from hyserve.model.nemotron_h.model import NemotronHForCausalLM

    model = NemotronHForCausalLM(cfg)
    load_checkpoint_with_kv_scales(model, Path(ckpt))  # 16-bit checkpoint, quantised as it loads
    h = Harness(model, max_seqs=3, max_len=64, bs=4)
    h.cache = model.allocate_cache(num_blocks=3 * h.bps, tokens_per_block=4, num_slots=3 + 8, device="cpu")
    g = torch.Generator().manual_seed(4)
    toks = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (11, 6, 1, 1, 1)]
    out = [h.step([(0, toks[0]), (1, toks[1])], all_logits=True)]
    out += [h.step([(0, toks[i]), (1, toks[i])]) for i in (2, 3, 4)]
    fp8 = sum(1 for _, m in model.named_modules() if getattr(m, "quant", None) is not None)
    return tp_group().size, fp8, out


@pytest.mark.parametrize("variant", ["dense", "spanning", "latent-moe"])
def test_fp8_model_at_tp2_is_the_tp1_model(pool: RankPool, tmp_path: Path, variant: str) -> None:
    """Online FP8 quantisation is the same at every tp_size (whole-row scales), so the tp 2 model's logits are
    the tp 1 model's up to float32 summation order, prefill and decode, through the FP8 projections, the
    sharded gated norm before an FP8 out_proj, and FP8 experts with their intermediate dimension split."""
    from hyserve.model.nemotron_h.model import NemotronHForCausalLM
    from hyserve.model.random_init import init_random_weights
    from hyserve.model.weights import save_checkpoint

    cfg = _tp_cfg(variant)
    plain = NemotronHForCausalLM(cfg.with_quant(None))
    init_random_weights(plain, cfg, seed=9)
    save_checkpoint(plain, tmp_path, names=NAMES)
    tp1, n_fp8, want = _tp_logits(cfg, str(tmp_path))
    assert tp1 == 1 and n_fp8 >= 8
    for rank, (tp, n, got) in enumerate(pool.run(_tp_logits, cfg, str(tmp_path))):
        assert (tp, n) == (2, n_fp8)
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            err = (a - b).abs().max().item()
            assert err <= 1e-5 * max(1.0, b.abs().max().item()), f"rank {rank} step {step}: {err:.2e}"


def test_engine_runs_fp8_weights_end_to_end(tmp_path: Path) -> None:
    """`LLM(..., quantization="fp8")` on the CPU: start-up reports the weight format and bytes, the capacity
    report carries them, and generation runs through the FP8 reference path (greedy, same tokens as the
    16-bit engine on this tiny model for the first steps)."""
    from hyserve import LLM, SamplingParams

    src = _tiny_dir(tmp_path, "latent-moe")
    lines: list[str] = []
    llm = LLM(str(src), device="cpu", quantization="fp8", log=lines.append)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out = llm.generate([[1, 5, 6, 7, 8, 9]], params)
    assert len(out[0].token_ids) == 8
    start = next(ln for ln in lines if "weights on this rank" in ln)
    assert "fp8 e4m3 weights (quantised at load, per-output-channel scales)" in start
    assert "fp8 e4m3 weights" in llm.engine.capacity_report()
    ref = LLM(str(src), device="cpu").generate([[1, 5, 6, 7, 8, 9]], params)
    assert out[0].token_ids[:2] == ref[0].token_ids[:2]


def test_start_up_refuses_an_unsupported_checkpoint_format(tmp_path: Path) -> None:
    """The refusal reaches start-up (load_model) before anything is built."""
    src = _tiny_dir(tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    d = tmp_path / "awq"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps({**cfg, "quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}})
    )
    with pytest.raises(ValueError, match=r"weight_block_size \[64, 64\] is not supported"):
        _load(d, load_format="dummy")


def test_fp8_moe_keeps_the_shared_expert_as_its_fp8_mlp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 16-bit MoE layer folds its shared expert into the experts op; with FP8 weights the experts and the
    shared MLP are FP8 and the shared expert runs as the MLP (the folded kernels take 16-bit weights)."""
    src = _tiny_dir(tmp_path, "moe")
    lm = _load(src, quantization="fp8")
    moes = [m.mixer for m in lm.model.backbone.layers if hasattr(m.mixer, "experts")]
    assert moes and all(m.fold_shared for m in moes)  # a layer the 16-bit model folds
    for m in moes:
        assert m.experts.quant is not None and m.shared_experts.up_proj.quant is not None
    calls: list[dict] = []
    from hyserve.kernels import ops

    real = ops.moe_experts.ref

    def spy(*a: Any, **k: Any) -> torch.Tensor:
        calls.append({"shared": len(a) > 5 and a[5] is not None, "fp8": k.get("up_scale") is not None})
        return real(*a, **k)

    monkeypatch.setattr(ops.moe_experts, "ref", spy)
    _logits(lm, list(range(5, 15)))
    assert calls and all(c == {"shared": False, "fp8": True} for c in calls)


@pytest.mark.parametrize("variant", ["dense", "latent-moe"])
def test_make_tiny_fp8_writes_a_modelopt_checkpoint_hyserve_loads(tmp_path: Path, variant: str) -> None:
    """`hyserve make-tiny --fp8`: the tiny checkpoint with every projection and routed expert as e4m3 and a
    per-tensor scale (ModelOpt's layout and files), detected and loaded with nothing else to set; the values
    are the per-tensor quantisation of the 16-bit tiny checkpoint's, and its lm_head stays 16-bit."""
    from hyserve.cli import main

    plain = _tiny_dir(tmp_path, variant)
    assert main(["make-tiny", str(tmp_path / "fp8"), "--variant", variant, "--seed", "3", "--fp8"]) == 0
    d = tmp_path / "fp8"
    assert checkpoint_quant(d).method == "modelopt"
    assert json.loads((d / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "FP8"
    lm, ref = _load(d), _load(plain)
    refp = dict(ref.model.named_parameters())
    for name, layer in fp8_layers(lm.model):
        q, s = quantize_weight_ref(refp[name + ".weight"].detach(), "tensor")
        assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(layer.weight_scale, s.expand(layer.weight.shape[0]))
    for name, m in lm.model.named_modules():
        if name.endswith(".experts"):
            assert m.quant is not None and m.up_proj.dtype == E4M3
    _close_logits(lm, ref)
    from hyserve.model.fp8_export import write_modelopt_fp8

    with pytest.raises(ValueError, match="already quantised"):
        write_modelopt_fp8(d)
