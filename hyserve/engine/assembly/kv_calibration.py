"""Calibrate an fp8 KV cache's per-layer k_scale / v_scale at start-up, where the checkpoint gives none
(`kv_cache_config.kv_scales: calibrate`, or `auto` for the layers the checkpoint lacks):

    scale = HEADROOM * amax / 448    amax = max |K| (or |V|) the layer projects over the calibration
                                     prefill

one per tensor (the scale format of the checkpoints, the `Attention` buffers and the kernels; per-head scales
are not supported). `assembly.assemble` runs it right after the weights load: before the activation profile,
the pool allocation, the decode CUDA graphs (whose kernels read the scales from the device, so a later change
would still reach them, but nothing is captured against provisional values) and the warm-up.

The prefill runs eagerly through a `ModelRunner` over a scratch cache of its own whose KV is in the model's
dtype, not fp8: the scales describe the model's K and V before quantisation, and no layer sees K/V quantised
with the 1.0 the uncalibrated layers hold meanwhile. The model records its K/V magnitudes through the family's
`record_kv_amax` (forward hooks that read and return nothing, removed on exit), so the forward's results are
unchanged. Under tensor parallelism every rank runs the same prefill in step (the model's collectives need it)
and the ranks take the max over each other's heads, so a layer's scale is one number on every rank.

The calibration batch is fixed, so a restart on the same hardware gives the same scales:
  * `CALIBRATION_TEXT`, tokenized with the checkpoint's tokenizer (BOS first when it has one) when there is
    one: natural text, as serving sees, including the first position's outliers (attention sinks) that a
    request's leading tokens produce;
  * `SAMPLE_TOKENS` token ids drawn uniformly from the whole vocabulary with a fixed seed (always, and alone
    for a checkpoint without a tokenizer): every region of the embedding table, so tokens the text does not
    use but whose embeddings drive K/V high are seen.
A prompt unlike both (a much longer context, another language) can still exceed the calibrated amax, so
HEADROOM 2 puts the batch's amax at 224, not 448. That costs next to nothing: e4m3 keeps 3 mantissa bits over
its whole normal range, and only values below amax / ~14,000 (instead of amax / ~28,000) fall into its
subnormals. (vLLM's start-up scales, `calculate_kv_scales`, divide amax by 200 for K and 100 for V: headroom
2.24 and 4.48.) A value beyond the headroom saturates at +-448 * scale, as in any fp8 KV cache.
A layer whose K (V) is all zeros over the batch gets scale 1.0 (any scale stores zeros exactly).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hyserve.distributed import all_gather, parallel_info, tp_group
from hyserve.engine.runner.model_loader import LoadedModel
from hyserve.engine.runner.runner import ModelRunner
from hyserve.engine.sampling_params import SamplingParams
from hyserve.engine.scheduler.scheduler import standalone_prefill
from hyserve.kernels.attention import FP8_E4M3_MAX
from hyserve.model.cache_tensors import CacheTensors

HEADROOM = 2.0
SAMPLE_TOKENS = 512
SAMPLE_SEED = 448
TEXT_TOKENS = 512  # the most of CALIBRATION_TEXT's tokens used (a byte-level tokenizer makes many)
CALIBRATION_TEXT = """\
The committee met on Tuesday, 14 March, to review the third-quarter figures. Revenue rose 12.5% to $4.2 \
billion, while operating costs fell slightly; the board nevertheless asked for a revised forecast before \
the annual meeting in June. "We are cautiously optimistic," the chair said, "but the supply problems in \
Asia are not over."

In the lab, the samples were heated to 350 K for 20 minutes and cooled in liquid nitrogen. Each run was \
repeated three times, and the mean deviation stayed below 0.03 mm.

def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]

User: Can you summarise the plot of Hamlet in two sentences?
Assistant: Prince Hamlet feigns madness while seeking revenge on his uncle Claudius, who murdered his \
father to seize the throne of Denmark. His hesitation sets off a chain of deaths that ends with nearly \
the whole court, Hamlet included, lying dead.

Die Sonne geht im Osten auf. La lune brille la nuit. 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144.
"""

_ONE = SamplingParams(max_tokens=1)
_F32_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class KvCalibration:
    """The calibrated scales {layer: {"k": s, "v": s}} (only those that were to be calibrated) and how."""

    scales: dict[int, dict[str, float]]
    num_attention_layers: int
    num_tokens: int
    batch: str  # what the prefill read
    seconds: float

    def describe(self) -> str:
        def span(kind: str) -> str:
            vals = [s[kind] for s in self.scales.values() if kind in s]
            if not vals:
                return f"{kind}_scale from the checkpoint"
            lo, hi = min(vals), max(vals)
            return f"{kind}_scale {lo:.4g}" + (f"..{hi:.4g}" if hi != lo else "")

        n = len(self.scales)
        rest = (
            ""
            if n == self.num_attention_layers
            else f"; the other {self.num_attention_layers - n} from the checkpoint"
        )
        return (
            f"fp8 KV cache: k_scale / v_scale calibrated in {n} of {self.num_attention_layers} attention "
            f"layers{rest} (amax / {FP8_E4M3_MAX:g} x {HEADROOM:g} headroom, per tensor; a "
            f"{self.num_tokens:,}-token prefill of {self.batch}): {span('k')}, {span('v')} "
            f"({self.seconds:.1f}s)"
        )


def calibration_batch(lm: LoadedModel, max_seq_len: int) -> tuple[list[list[int]], str]:
    """The prompts of the calibration prefill (see the module docstring) and a few words on what they are."""
    vocab = lm.config.vocab_size
    n = min(SAMPLE_TOKENS, max_seq_len)
    sample = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(SAMPLE_SEED)).tolist()
    if lm.tokenizer is None:
        return [sample], "a vocabulary sample (no tokenizer)"
    bos = lm.tokenizer.bos_token_id
    text = ([bos] if bos is not None else []) + lm.tokenizer.encode(CALIBRATION_TEXT)
    text = [t for t in text if 0 <= t < vocab][: min(TEXT_TOKENS, max_seq_len)]
    return ([text] if text else []) + [sample], "the built-in text and a vocabulary sample"


def _scratch_cache(lm: LoadedModel, lengths: list[int], tokens_per_block: int) -> CacheTensors:
    """Blocks for the sequences and a state slot each, in this rank's shapes, with KV in the model's dtype."""
    blocks = sum(-(-n // tokens_per_block) for n in lengths)
    shapes = lm.model.allocate_cache(
        num_blocks=blocks, tokens_per_block=tokens_per_block, num_slots=len(lengths), device="meta"
    )

    def zeros(d: dict[int, torch.Tensor], dtype: torch.dtype | None = None) -> dict[int, torch.Tensor]:
        # the serving cache's strides too (its conv pools are tap-major), so the kernels run as they serve
        return {
            i: torch.empty_strided(t.shape, t.stride(), dtype=dtype or t.dtype, device=lm.device).zero_()
            for i, t in d.items()
        }

    return CacheTensors(
        k=zeros(shapes.k, lm.dtype),
        v=zeros(shapes.v, lm.dtype),
        conv=zeros(shapes.conv),
        ssm=zeros(shapes.ssm),
        tokens_per_block=tokens_per_block,
    )


def measure_kv_amax(
    lm: LoadedModel, prompts: list[list[int]], tokens_per_block: int
) -> dict[int, tuple[float, float]]:
    """{attention layer: (max |K|, max |V|)} over one eager prefill of `prompts` and every rank's heads (one
    host read at the end). The model's outputs are unused."""
    cache = _scratch_cache(lm, [len(p) for p in prompts], tokens_per_block)
    runner = ModelRunner(lm.model, cache, lm.device)
    with lm.family.record_kv_amax(lm.model) as amax:
        runner.execute(
            standalone_prefill(
                prompts,
                tokens_per_block=tokens_per_block,
                request_id="kv-calibration",
                slots=list(range(len(prompts))),
                params=_ONE,
            )
        )
    layers = sorted(amax)
    per_layer = torch.stack([amax[i] for i in layers])  # [layers, 2]
    if parallel_info().tp_size > 1:
        per_layer = all_gather(per_layer[None], tp_group()).amax(dim=0)
    return {i: (k, v) for i, (k, v) in zip(layers, per_layer.tolist())}


def calibrate_kv_scales(lm: LoadedModel, *, tokens_per_block: int, max_seq_len: int) -> KvCalibration | None:
    """Calibrate and set the scales `lm.kv_scales_to_calibrate` names (None when it names none)."""
    todo = lm.kv_scales_to_calibrate
    if not todo:
        return None
    t0 = time.monotonic()
    prompts, what = calibration_batch(lm, max_seq_len)
    amax = measure_kv_amax(lm, prompts, tokens_per_block)
    scales: dict[int, dict[str, float]] = {}
    for i in sorted(todo):
        for kind in todo[i]:
            a = amax[i][0 if kind == "k" else 1]
            if not (a < float("inf")):  # inf or NaN
                raise ValueError(
                    f"fp8 KV calibration: attention layer {i}'s {kind.upper()} is not finite over the "
                    f"calibration prefill (max |{kind.upper()}| = {a}: non-finite weights, or an overflow in "
                    f"{str(lm.dtype).removeprefix('torch.')}), so no scale can hold it. Set "
                    "kv_cache_config.kv_scales to 'checkpoint' (with a checkpoint that has KV scales) or "
                    "'unit'"
                )
            # a float32 scale: at least float32's smallest normal, so the buffer never holds 0
            scales.setdefault(i, {})[kind] = max(a * HEADROOM / FP8_E4M3_MAX, _F32_TINY) if a > 0 else 1.0
    lm.family.update_kv_scales(lm.model, scales)
    return KvCalibration(
        scales=scales,
        num_attention_layers=len(amax),
        num_tokens=sum(map(len, prompts)),
        batch=what,
        seconds=time.monotonic() - t0,
    )
