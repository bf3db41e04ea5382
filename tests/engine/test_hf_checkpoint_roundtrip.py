"""Checkpoints written by transformers load.

transformers 5.x writes a non-finite float as `{"__float__": "Infinity"}` (JSON has no inf), so every
`NemotronHConfig(...).save_pretrained(dir)` with the default `time_step_limit` (0, inf) used to stop
`HybridModelConfig.from_hf` with a TypeError. Here: the default config, every shipped config (tiny test
configs and the real architectures) through `save_pretrained`, and a whole tiny model saved by
transformers served by `LLM`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from hyserve.model.config import LAYER_MOE
from hyserve.model.nemotron_h.config import HybridModelConfig
from tests.shipped_configs import ALL, config_dir

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

_MOE_FIELDS = (
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "moe_shared_expert_intermediate_size",
)


def _comparable(cfg: HybridModelConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d.pop("name")
    if LAYER_MOE not in cfg.layer_types:  # transformers writes its MoE defaults into dense configs: unused
        for k in _MOE_FIELDS:
            d.pop(k, None)
    return d


def test_default_config_saved_by_transformers_parses(tmp_path: Path) -> None:
    transformers.NemotronHConfig().save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["time_step_limit"][1] == {"__float__": "Infinity"}  # the spelling this test is about
    cfg = HybridModelConfig.from_hf(tmp_path)
    assert cfg.time_step_limit == (0.0, math.inf)


@pytest.mark.parametrize("name", ALL)
def test_shipped_config_round_trips_through_save_pretrained(name: str, tmp_path: Path) -> None:
    d = json.loads((config_dir(name) / "config.json").read_text())
    transformers.NemotronHConfig(**d).save_pretrained(tmp_path)
    assert _comparable(HybridModelConfig.from_hf(tmp_path)) == _comparable(
        HybridModelConfig.from_hf(config_dir(name))
    )


@pytest.mark.parametrize("bound", [{"__float__": "Infinity"}, "inf", 1e9, 7])
def test_time_step_limit_spellings(bound: object) -> None:
    d = json.loads((config_dir("tiny-nemotron-h-dense") / "config.json").read_text())
    d["time_step_limit"] = [0.0, bound]
    assert HybridModelConfig.from_dict(d).time_step_limit[1] == float(
        bound["__float__"] if isinstance(bound, dict) else bound
    )


@pytest.mark.parametrize("bound", [{"__float__": "lots"}, {"x": 1}, [1.0], True])
def test_time_step_limit_garbage_names_the_field(bound: object) -> None:
    d = json.loads((config_dir("tiny-nemotron-h-dense") / "config.json").read_text())
    d["time_step_limit"] = [0.0, bound]
    with pytest.raises(ValueError, match="time_step_limit"):
        HybridModelConfig.from_dict(d)


def test_model_saved_by_transformers_serves(tmp_path: Path) -> None:
    """A tiny NemotronH built and saved by transformers (config + safetensors) loads into `LLM` and its greedy
    first token is transformers' own argmax."""
    from hyserve.engine.llm import LLM
    from hyserve.engine.sampling_params import SamplingParams

    d = json.loads((config_dir("tiny-nemotron-h-dense") / "config.json").read_text())
    d.pop("time_step_limit")  # transformers' default (0, inf)
    torch.manual_seed(0)
    hf_cfg = transformers.NemotronHConfig(**d)
    hf = transformers.NemotronHForCausalLM(hf_cfg).float().eval()
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["time_step_limit"][1] == {
        "__float__": "Infinity"
    }
    prompt = [5, 17, 33, 2, 9, 41, 8]
    # transformers' torch path clamps dt at time_step_min in prefill; hyserve (like the kernels) clamps at
    # time_step_limit (tests/engine/test_model_parity.py): give transformers the same limit
    mixers = [m for m in hf.modules() if type(m).__name__ == "NemotronHMamba2Mixer"]
    assert mixers
    for m in mixers:
        m.time_step_limit = (0.0, math.inf)
    with torch.no_grad():
        want = int(hf(torch.tensor([prompt])).logits[0, -1].argmax())
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", max_seq_len=64, max_batch_size=2)
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3
    assert out.token_ids[0] == want
