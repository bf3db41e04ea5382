"""`kv_cache_config.kv_scales` (where an fp8 KV cache's k_scale / v_scale come from) and the start-up
calibration of engine/assembly/kv_calibration.py, on the CPU reference path with the tiny dense model
(attention layers 1 and 5).

    checkpoint: the checkpoint's, all layers or a start-up error naming the layers without
    calibrate:  HEADROOM * amax / 448 of a fixed start-up prefill, in every layer
    unit:       1.0, said once at info level
    auto:       the checkpoint's where it has them, calibrated elsewhere
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from hyserve.kernels.attention import FP8_E4M3_MAX
from tests.model_harness import Harness, strong_random_weights

FP8 = torch.float8_e4m3fn
ATTN = (1, 5)  # the tiny dense model's attention layers
PROMPTS = [[1, 5, 9, 13, 200, 17, 4, 88, 31], [1, 77] * 20, [1, 3, 250, 251, 7]]


def _tiny(
    tmp_path: Path,
    *,
    kv_gain: float = 1.0,
    extra: dict[str, torch.Tensor] | None = None,
    poison_k: bool = False,
) -> Path:
    """The tiny dense checkpoint with O(1) activations (strong random weights). kv_gain c scales k_proj and
    v_proj by c and q_proj and o_proj by 1/c: in exact arithmetic the same model, with |K| and |V| c times
    larger. `extra` tensors (KV scales) are added under their checkpoint names; poison_k puts an inf in
    layer 1's k_proj."""
    from hyserve.model.nemotron_h.checkpoint import NAMES
    from hyserve.model.nemotron_h.config import HybridModelConfig
    from hyserve.model.nemotron_h.model import NemotronHForCausalLM
    from hyserve.model.tiny import make_tiny
    from hyserve.model.weights import StateDictModule, save_checkpoint

    d = make_tiny(tmp_path / "tiny", variant="dense")
    cfg = HybridModelConfig.from_hf(d)
    model = NemotronHForCausalLM(cfg)
    strong_random_weights(model, cfg, seed=11)
    with torch.no_grad():
        for i in ATTN:
            mixer = model.backbone.layers[i].mixer
            mixer.k_proj.weight.mul_(kv_gain)
            mixer.v_proj.weight.mul_(kv_gain)
            mixer.q_proj.weight.div_(kv_gain)
            mixer.o_proj.weight.div_(kv_gain)
        if poison_k:
            model.backbone.layers[1].mixer.k_proj.weight[0, 0] = float("inf")
    sd = dict(model.state_dict())
    sd.update(extra or {})
    save_checkpoint(StateDictModule(sd), d, names=NAMES)
    return d


def _llm(d: Path, lines: list[str] | None = None, **kv):
    from hyserve import LLM

    log = (lambda s: None) if lines is None else lines.append
    return LLM(str(d), device="cpu", dtype="float32", max_seq_len=256, kv_cache_config=kv, log=log)


def _scales(llm) -> dict[int, tuple[float, float]]:
    model = llm.engine.loaded.model
    return {
        i: (float(model.backbone.layers[i].mixer.k_scale), float(model.backbone.layers[i].mixer.v_scale))
        for i in ATTN
    }


def _greedy(llm, n: int = 16):
    from hyserve import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1))
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]


def _no_hooks(model: torch.nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def _calibration_line(lines: list[str]) -> list[str]:
    return [s for s in lines if "calibrated in" in s]


# ---------------------------------------------------------------------------- the options at start-up


def test_auto_without_checkpoint_scales_calibrates_every_layer(tmp_path, caplog):
    lines: list[str] = []
    with caplog.at_level(logging.INFO, logger="hyserve"):
        llm = _llm(_tiny(tmp_path), lines, dtype="fp8")
    got = _scales(llm)
    assert all(0 < s < 1.0 for pair in got.values() for s in pair), got  # O(1) K/V: well below 448
    (line,) = _calibration_line(lines)
    assert "2 of 2 attention layers" in line and "amax / 448 x 2 headroom" in line
    ks = sorted(k for k, _ in got.values())
    assert f"k_scale {ks[0]:.4g}..{ks[1]:.4g}" in line
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # no "saturate" warning any more
    assert _no_hooks(llm.engine.loaded.model)


def test_auto_takes_the_checkpoint_where_it_has_scales_and_calibrates_the_rest(tmp_path):
    lines: list[str] = []
    d = _tiny(
        tmp_path,
        extra={
            "backbone.layers.5.mixer.k_scale": torch.tensor(0.125),
            "backbone.layers.5.mixer.attn.v_scale": torch.tensor(4.0),
            "backbone.layers.1.mixer.k_proj.k_scale": torch.tensor(0.5),  # layer 1: K only, V is calibrated
        },
    )
    got = _scales(_llm(d, lines, dtype="fp8"))
    assert got[5] == (0.125, 4.0) and got[1][0] == 0.5 and 0 < got[1][1] < 1.0 and got[1][1] != 1.0
    (line,) = _calibration_line(lines)
    assert (
        "1 of 2 attention layers; the other 1 from the checkpoint" in line
        and "k_scale from the checkpoint" in line
    )


def test_auto_with_full_checkpoint_scales_calibrates_nothing(tmp_path, caplog):
    lines: list[str] = []
    d = _tiny(
        tmp_path,
        extra={
            "backbone.layers.1.mixer.kv_scale": torch.tensor(0.25),
            "backbone.layers.5.mixer.kv_scale": torch.tensor(0.5),
        },
    )
    with caplog.at_level(logging.INFO, logger="hyserve"):
        got = _scales(_llm(d, lines, dtype="fp8"))
    assert got == {1: (0.25, 0.25), 5: (0.5, 0.5)}
    assert not _calibration_line(lines)
    assert "from the checkpoint for all 2 attention layers" in caplog.text


def test_checkpoint_uses_the_checkpoint_scales(tmp_path):
    d = _tiny(
        tmp_path,
        extra={
            "backbone.layers.1.mixer.kv_scale": torch.tensor(0.25),
            "backbone.layers.5.mixer.kv_scale": torch.tensor(0.5),
        },
    )
    assert _scales(_llm(d, dtype="fp8", kv_scales="checkpoint")) == {1: (0.25, 0.25), 5: (0.5, 0.5)}


@pytest.mark.parametrize(
    "extra, needle",
    [
        (
            {},
            r"the checkpoint has none for 2 of 2 attention layers: layer 1 \(k_scale / v_scale\), layer 5 "
            r"\(k_scale / v_scale\)",
        ),
        (
            {
                "backbone.layers.5.mixer.kv_scale": torch.tensor(0.5),
                "backbone.layers.1.mixer.k_scale": torch.tensor(0.5),
            },
            r"the checkpoint has none for 1 of 2 attention layers: layer 1 \(v_scale\);",
        ),
    ],
)
def test_checkpoint_without_scales_fails_at_start_up_naming_the_layers(tmp_path, extra, needle):
    d = _tiny(tmp_path, extra=extra)
    with pytest.raises(ValueError, match=r"kv_cache_config\.kv_scales: 'checkpoint', but " + needle) as e:
        _llm(d, dtype="fp8", kv_scales="checkpoint")
    assert "'auto' or 'calibrate'" in str(e.value) and "'unit'" in str(e.value)


def test_unit_is_one_everywhere_without_a_warning(tmp_path, caplog):
    lines: list[str] = []
    d = _tiny(tmp_path, extra={"backbone.layers.1.mixer.kv_scale": torch.tensor(0.25)})
    with caplog.at_level(logging.INFO, logger="hyserve"):
        llm = _llm(d, lines, dtype="fp8", kv_scales="unit")
    assert _scales(llm) == {1: (1.0, 1.0), 5: (1.0, 1.0)}
    assert not _calibration_line(lines)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    infos = [r.getMessage() for r in caplog.records if "kv_scales unit" in r.getMessage()]
    assert infos == [
        "fp8 KV cache: kv_scales unit, k_scale = v_scale = 1.0 in all 2 attention layers; "
        "the checkpoint's scales for 1 layers are not used"
    ]


def test_calibrate_replaces_the_checkpoint_scales(tmp_path):
    lines: list[str] = []
    d = _tiny(
        tmp_path,
        extra={
            "backbone.layers.1.mixer.kv_scale": torch.tensor(0.25),
            "backbone.layers.5.mixer.kv_scale": torch.tensor(0.5),
        },
    )
    calibrated = _scales(_llm(d, lines, dtype="fp8", kv_scales="calibrate"))
    assert all(s not in (0.25, 0.5, 1.0) for pair in calibrated.values() for s in pair)
    assert "2 of 2 attention layers" in _calibration_line(lines)[0]
    # the same values as auto finds on the checkpoint without scales: the checkpoint's play no part
    assert calibrated == _scales(_llm(_tiny(tmp_path / "plain"), dtype="fp8"))


def test_dummy_weights_calibrate_under_auto_and_have_no_checkpoint_scales(tmp_path):
    import json

    from hyserve import LLM
    from hyserve.model.tiny import tiny_config

    (tmp_path / "config.json").write_text(json.dumps(tiny_config("dense")))
    kw = dict(load_format="dummy", device="cpu", max_seq_len=128, log=lambda s: None)
    auto = LLM(str(tmp_path), kv_cache_config={"dtype": "fp8"}, **kw)
    assert all(s != 1.0 for pair in _scales(auto).values() for s in pair)
    unit = LLM(str(tmp_path), kv_cache_config={"dtype": "fp8", "kv_scales": "unit"}, **kw)
    assert _scales(unit) == {1: (1.0, 1.0), 5: (1.0, 1.0)}
    with pytest.raises(ValueError, match="load_format=dummy has no checkpoint for 2 of 2 attention layers"):
        LLM(str(tmp_path), kv_cache_config={"dtype": "fp8", "kv_scales": "checkpoint"}, **kw)


def test_a_16_bit_cache_calibrates_nothing(tmp_path):
    lines: list[str] = []
    llm = _llm(_tiny(tmp_path), lines, dtype="float32")
    assert _scales(llm) == {1: (1.0, 1.0), 5: (1.0, 1.0)} and not _calibration_line(lines)


def test_a_non_finite_calibration_stops_start_up(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"attention layer 1's K is not finite over the calibration prefill.*"
        r"'checkpoint'.*'unit'",
    ):
        _llm(_tiny(tmp_path, poison_k=True), dtype="fp8")


# ---------------------------------------------------------------------------- what calibration gives


def test_calibrated_scales_stop_saturation_where_unit_saturates(tmp_path):
    """|K| and |V| ~1000x the usual (k_proj, v_proj x 1000; q_proj, o_proj / 1000: the same model in exact
    arithmetic). A float32 KV cache is the reference. With unit scales nearly every K/V saturates at 448 and
    greedy decoding goes elsewhere; calibrated scales put the batch's amax at 448 / 2 and the fp8 engine
    follows the reference within e4m3 rounding."""
    from hyserve.engine.assembly.kv_calibration import HEADROOM, calibration_batch, measure_kv_amax

    d = _tiny(tmp_path, kv_gain=1000.0)
    ref_tokens, ref_lp = _greedy(_llm(d, dtype="float32"))
    cal = _llm(d, dtype="fp8")
    unit = _llm(d, dtype="fp8", kv_scales="unit")

    # the calibrated scales hold the calibration batch's K/V without saturating, with the headroom to spare
    lm = cal.engine.loaded
    amax = measure_kv_amax(lm, calibration_batch(lm, 256)[0], 64)
    for i, (k_scale, v_scale) in _scales(cal).items():
        assert amax[i][0] > 5 * FP8_E4M3_MAX and amax[i][1] > 5 * FP8_E4M3_MAX  # unit clamps these
        assert amax[i][0] / k_scale == pytest.approx(FP8_E4M3_MAX / HEADROOM, rel=1e-5)
        assert amax[i][1] / v_scale == pytest.approx(FP8_E4M3_MAX / HEADROOM, rel=1e-5)

    def worst(tokens, lps):
        """(sequences whose greedy tokens differ from the reference, max |logprob diff| over the common
        prefix)"""
        differ, diff = 0, 0.0
        for rt, rl, t, lp in zip(ref_tokens, ref_lp, tokens, lps):
            n = next((j for j, (a, b) in enumerate(zip(rt, t)) if a != b), len(rt))
            differ += n < len(rt)
            diff = max([diff] + [abs(a - b) for a, b in zip(rl[: n + 1], lp[: n + 1])])
        return differ, diff

    cal_differ, cal_diff = worst(*_greedy(cal))
    unit_differ, unit_diff = worst(*_greedy(unit))
    # measured: calibrated 0 sequences off, 0.056; unit 3 of 3 off, 0.98 (strong random weights give sharp
    # O(1) logits, so e4m3's 3 mantissa bits show at the 5e-2 level)
    assert cal_differ == 0 and cal_diff < 0.1, (cal_differ, cal_diff)
    assert unit_differ >= 1 and unit_diff > 10 * cal_diff, (unit_differ, unit_diff, cal_diff)

    # calibration is scale-free: the model at its usual magnitudes, calibrated, is off its own float32-KV
    # reference by as much (the e4m3 codes differ only where rounding the gain x 1/gain weights does)
    d1 = _tiny(tmp_path / "gain1")
    ref_tokens, ref_lp = _greedy(_llm(d1, dtype="float32"))
    one_differ, one_diff = worst(*_greedy(_llm(d1, dtype="fp8")))
    assert one_differ == 0 and cal_diff == pytest.approx(one_diff, rel=0.1), (cal_diff, one_diff)


def test_calibration_changes_nothing_but_the_scales(tmp_path):
    """An engine that calibrated and one that reads the same scale values from the checkpoint give identical
    greedy tokens and logprobs (calibration leaves no state behind in the pools, the model or its hooks),
    and the calibrated engine keeps serving."""
    d = _tiny(tmp_path)
    cal = _llm(d, dtype="fp8", kv_scales="calibrate")
    scales = _scales(cal)
    assert _no_hooks(cal.engine.loaded.model)
    first = _greedy(cal)
    assert _greedy(cal) == first  # serving goes on (prefix-cache hits the second time), same answers

    extra = {}
    for i, (k, v) in scales.items():
        extra[f"backbone.layers.{i}.mixer.k_scale"] = torch.tensor(k, dtype=torch.float32)
        extra[f"backbone.layers.{i}.mixer.v_scale"] = torch.tensor(v, dtype=torch.float32)
    fixed = _llm(_tiny(tmp_path / "with_scales", extra=extra), dtype="fp8", kv_scales="checkpoint")
    assert _scales(fixed) == scales
    assert _greedy(fixed) == first


# ---------------------------------------------------------------------------- the model's recorder


def _harness_model():
    from hyserve.model.nemotron_h.config import HybridModelConfig
    from hyserve.model.nemotron_h.model import NemotronHForCausalLM
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
    handles = [
        model.backbone.layers[i].mixer.register_forward_pre_hook(
            lambda _m, args, i=i: seen.__setitem__(i, args[0].detach().clone())
        )
        for i in ATTN
    ]
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
