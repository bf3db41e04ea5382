"""Ceilings and rooflines for the benchmarks: the GPU's ceilings measured in the same run, the H200's
published peaks beside them, and the byte and FLOP counts of the model benchmarks (Nemotron Nano 9B v2; the
Nemotron 3 MoE models over their active parameters).

The ceilings are what this device reaches on the simplest kernels that hit each limit: a streaming read (a
sum over >= 4 GiB), a device copy, the best bf16 GEMV over a 1 GiB weight, and the bf16 matmul peak (8192^3
and a larger shape). A kernel is quoted against the measured ceiling of its limit (`ceiling_fields`) and
against the published peak, so a ratio above 1 of a hard-coded figure can no longer happen unnoticed.

    python3 -m benchmarks.roofline [--out ceilings.json]      # measure and print this GPU's ceilings
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

from hyserve.model.config import LAYER_MOE  # noqa: E402
from hyserve.model.nemotron_h.checkpoint import weight_bytes as model_weight_bytes  # noqa: E402
from hyserve.model.nemotron_h.config import HybridModelConfig  # noqa: E402

# NVIDIA's published H200 SXM figures: HBM3e bandwidth and dense (no sparsity) bf16 tensor-core throughput
PUBLISHED_BW = 4.8e12  # B/s
PUBLISHED_FLOPS = 989e12  # FLOP/s
GIB = 1 << 30


@dataclass(frozen=True)
class Ceilings:
    """One device's ceilings, measured in one run (medians over the timed repetitions)."""

    device: str
    stream_read_bw: float  # B/s read by a sum over `stream_read_bytes`
    copy_bw: float  # B/s read + written by a device copy
    gemv_bw: float  # B/s of weight read by the best bf16 GEMV over `gemv_bytes` (one token)
    gemv_best: str
    matmul_flops: float  # FLOP/s of the best bf16 matmul of the shapes timed
    matmul_best: str
    detail: dict[str, Any] = field(default_factory=dict)  # every timing, for the record

    @property
    def read_bw(self) -> float:
        """The bytes-read ceiling: the faster of the streaming read and the best GEMV."""
        return max(self.stream_read_bw, self.gemv_bw)

    def summary(self) -> str:
        return (
            f"ceilings on {self.device}, this run: streaming read {self.stream_read_bw / 1e12:.3f} TB/s, "
            f"copy {self.copy_bw / 1e12:.3f} TB/s, best GEMV {self.gemv_bw / 1e12:.3f} TB/s "
            f"({self.gemv_best}), bf16 matmul {self.matmul_flops / 1e12:.1f} TFLOP/s ({self.matmul_best}); "
            f"published H200 peaks {PUBLISHED_BW / 1e12:.1f} TB/s, {PUBLISHED_FLOPS / 1e12:.0f} TFLOP/s"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "read_bw": self.read_bw}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ceilings:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names})


# ---- measuring ------------------------------------------------------------------------------------------


def _median_seconds(fn: Callable[[], object], device: torch.device, reps: int) -> tuple[float, float]:
    """(median, min) seconds of one call of fn after a warm-up call; CUDA events on a GPU."""
    fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
    else:
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times), min(times)


def _gemv_candidates(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The GEMVs of one token over weight w [N, K]: cuBLAS on w and on its transpose's layout, and
    hyserve's Triton GEMV (the decode path's) where it runs."""
    wt = w.t().contiguous()  # [K, N]
    out = {
        "torch F.linear (weight [N, K])": lambda: torch.nn.functional.linear(x, w),
        "torch x @ W (weight [K, N])": lambda: x @ wt,
    }
    if x.is_cuda:
        try:
            from hyserve.kernels.triton_fused_linear import _gemv

            out["hyserve Triton GEMV (weight [N, K])"] = lambda: _gemv(x, w, None, relu2=False)
        except ImportError:  # pragma: no cover - an install without triton
            pass
    return out


def measure_ceilings(
    device: torch.device | str,
    *,
    stream_read_bytes: int = 4 * GIB,
    copy_bytes: int = 2 * GIB,
    gemv_bytes: int = GIB,
    matmul_shapes: tuple[tuple[int, int, int], ...] = ((8192, 8192, 8192), (16384, 16384, 16384)),
    reps: int = 20,
) -> Ceilings:
    """Measure the ceilings on `device` (sizes small enough for a CPU test when given). Every buffer is
    freed before returning."""
    device = torch.device(device)
    detail: dict[str, Any] = {}
    bf16 = torch.bfloat16

    x = torch.rand(max(1, stream_read_bytes // 4), device=device)  # float32
    med, best = _median_seconds(lambda x=x: x.sum(), device, reps)
    stream = x.numel() * 4 / med
    detail["stream_read"] = dict(bytes=x.numel() * 4, median_s=med, min_s=best)
    del x

    src = torch.rand(max(1, copy_bytes // 4), device=device)
    dst = torch.empty_like(src)
    med, best = _median_seconds(lambda d=dst, s=src: d.copy_(s), device, reps)
    copy = 2 * src.numel() * 4 / med  # read + write
    detail["copy"] = dict(bytes_each_way=src.numel() * 4, median_s=med, min_s=best)
    del src, dst

    k = 16384 if gemv_bytes >= GIB else max(16, int((gemv_bytes // 2) ** 0.5))
    n = max(1, gemv_bytes // (2 * k))
    w = torch.randn(n, k, device=device).to(bf16)
    xv = torch.randn(1, k, device=device).to(bf16)
    gemv: dict[str, float] = {}
    for name, fn in _gemv_candidates(xv, w).items():
        med, best = _median_seconds(fn, device, reps)
        gemv[name] = w.numel() * 2 / med
        detail[f"gemv {name}"] = dict(weight_bytes=w.numel() * 2, shape=[n, k], median_s=med, min_s=best)
    del w, xv
    gemv_best = max(gemv, key=lambda name: gemv[name])

    mm: dict[str, float] = {}
    for m_, n_, k_ in matmul_shapes:
        a = torch.randn(m_, k_, device=device).to(bf16)
        b = torch.randn(k_, n_, device=device).to(bf16)
        med, best = _median_seconds(lambda a=a, b=b: a @ b, device, max(3, reps // 4))
        label = f"bf16 {m_}x{n_}x{k_}"
        mm[label] = 2 * m_ * n_ * k_ / med
        detail[f"matmul {label}"] = dict(median_s=med, min_s=best)
        del a, b
    mm_best = max(mm, key=lambda name: mm[name])
    if device.type == "cuda":
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Ceilings(
        device=name,
        stream_read_bw=stream,
        copy_bw=copy,
        gemv_bw=gemv[gemv_best],
        gemv_best=gemv_best,
        matmul_flops=mm[mm_best],
        matmul_best=mm_best,
        detail=detail,
    )


# ---- quoting against them -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Peaks:
    """The three limits a roofline is drawn from (measured ones, or the published peaks)."""

    read_bw: float
    copy_bw: float
    matmul_flops: float


PUBLISHED = Peaks(read_bw=PUBLISHED_BW, copy_bw=PUBLISHED_BW, matmul_flops=PUBLISHED_FLOPS)
_LIMITS = {  # a record's limit -> the ceiling's description and the Peaks fields it uses
    "read": ("bytes-read ceiling (best of streaming read and GEMV), measured this run", ("read_bw",)),
    "copy": ("device copy ceiling (read + write), measured this run", ("copy_bw",)),
    "matmul": ("bf16 matmul ceiling, measured this run", ("matmul_flops",)),
    "copy+matmul": ("device copy and bf16 matmul ceilings, measured this run", ("copy_bw", "matmul_flops")),
}


def measured_peaks(c: Ceilings) -> Peaks:
    return Peaks(read_bw=c.read_bw, copy_bw=c.copy_bw, matmul_flops=c.matmul_flops)


def ceiling_fields(
    limit: str,
    ceilings: Ceilings | None,
    value: float,
    reference_at: Callable[[Peaks], float],
    *,
    time_like: bool = False,
) -> dict[str, Any]:
    """The fields of a record quoted against a roofline: the measured ceiling(s) of its `limit` (read,
    copy, matmul or copy+matmul), the reference there and the ratio, then the reference and ratio at the
    H200's published peaks. reference_at(peaks) is the roofline reference at those limits; time_like: the
    value is a time, so a ratio is reference / value (1.0 at the roofline). Without measured ceilings the
    reference and ratio are None and only the published ones are given."""
    what, keys = _LIMITS[limit]

    def ratio(ref: float | None) -> float | None:
        if ref is None or not value:
            return None
        return ref / value if time_like else value / ref

    ref = None
    measured: float | dict[str, float] | None = None
    if ceilings is not None:
        peaks = measured_peaks(ceilings)
        ref = reference_at(peaks)
        measured = getattr(peaks, keys[0]) if len(keys) == 1 else {k: getattr(peaks, k) for k in keys}
    published = reference_at(PUBLISHED)
    return dict(
        ceiling=what if ceilings is not None else "none measured",
        ceiling_value=measured,
        reference_value=ref,
        ratio=ratio(ref),
        published_peak=getattr(PUBLISHED, keys[0])
        if len(keys) == 1
        else {k: getattr(PUBLISHED, k) for k in keys},
        published_reference_value=published,
        ratio_to_published=ratio(published),
    )


def load_ceilings(path: Path) -> Ceilings:
    """Ceilings from `roofline.py --out` or from the "ceilings" block of a benchmark JSON."""
    d = json.loads(Path(path).read_text())
    return Ceilings.from_dict(d.get("ceilings", d))


# ---- Nemotron Nano 9B v2 byte and FLOP counts ----------------------------------------------------------


def matmul_params(cfg: HybridModelConfig) -> int:
    """Parameters read by every token's matmuls: all but the input embedding (a row gather)."""
    return cfg.num_parameters() - cfg.vocab_size * cfg.hidden_size


def weight_bytes(cfg: HybridModelConfig, bytes_per_param: int = 2) -> int:
    """Bytes of the matmul parameters; with FP8 projections (cfg.quant) the model's own count of its
    weights (e4m3 projections + float32 scales, the float32 router, the rest in bf16) less the embedding."""
    if cfg.quant is not None:
        return model_weight_bytes(cfg, torch.bfloat16) - cfg.vocab_size * cfg.hidden_size * 2
    return matmul_params(cfg) * bytes_per_param


def decode_step_bytes(cfg: HybridModelConfig, batch: int, context: float) -> float:
    """Bytes one decode step must move: the weights once, each sequence's Mamba state read and written,
    and the K/V of `context` tokens per sequence read."""
    return weight_bytes(cfg) + batch * (2 * cfg.state_bytes_per_sequence + context * cfg.kv_bytes_per_token)


def decode_step_ms(cfg: HybridModelConfig, batch: int, context: float, bw: float) -> float:
    """The decode step's time at `bw` bytes per second."""
    return decode_step_bytes(cfg, batch, context) / bw * 1e3


def prefill_tokens_per_s(cfg: HybridModelConfig, flops: float) -> float:
    """Prefill tokens per second at `flops` (2 FLOPs per matmul parameter per token)."""
    return flops / (2 * matmul_params(cfg))


# ---- MoE models (Nemotron 3): active parameters -----------------------------------------------------------
# A MoE layer's routed experts are read only where the routing sends tokens: one token reads its top-k
# experts, a batch of B tokens the distinct experts they touch. With uniform random routing (k distinct
# experts of E per token, independently per token and per layer) an expert is missed by all B tokens with
# probability (1 - k/E)^B, so a layer reads E * (1 - (1 - k/E)^B) experts on average. The router weight and
# its score-correction bias stay float32 (hyserve/model/weights.py), everything else is counted in bf16.


def expected_distinct_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts B tokens touch under uniform random top-k routing."""
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k}")
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def num_moe_layers(cfg: HybridModelConfig) -> int:
    return sum(t == LAYER_MOE for t in cfg.layer_types)


def expert_params(cfg: HybridModelConfig) -> int:
    """Parameters of one routed expert (up [I, d] + down [d, I]; d is the latent size where there is one)."""
    return 2 * (cfg.moe_latent_size or cfg.hidden_size) * cfg.moe_intermediate_size


def router_params(cfg: HybridModelConfig) -> int:
    """Router weight [E, h] and score-correction bias [E] over every MoE layer (float32 in the model)."""
    return num_moe_layers(cfg) * cfg.n_routed_experts * (cfg.hidden_size + 1)


def active_matmul_params(cfg: HybridModelConfig, experts_per_layer: float | None = None) -> float:
    """Matmul parameters a step reads when each MoE layer touches `experts_per_layer` routed experts
    (default: the top-k of one token); every other parameter but the input embedding is read whole. A
    model without MoE layers gives `matmul_params`."""
    if experts_per_layer is None:
        experts_per_layer = cfg.num_experts_per_tok
    n_moe = num_moe_layers(cfg)
    if n_moe and not 0 <= experts_per_layer <= cfg.n_routed_experts:
        raise ValueError(f"experts_per_layer must be in [0, {cfg.n_routed_experts}], got {experts_per_layer}")
    unrouted = matmul_params(cfg) - n_moe * cfg.n_routed_experts * expert_params(cfg)
    return unrouted + n_moe * experts_per_layer * expert_params(cfg)


def active_weight_bytes(
    cfg: HybridModelConfig, experts_per_layer: float | None = None, bytes_per_param: int = 2
) -> float:
    """Weight bytes of `active_matmul_params`, the float32 router counted at 4 bytes a parameter. With FP8
    weights (cfg.quant) the model's own byte count less the embedding and the experts a step does not read
    (an FP8 expert: 1 byte a weight + a float32 scale per output row of up and down)."""
    if experts_per_layer is None:
        experts_per_layer = cfg.num_experts_per_tok
    if cfg.quant is not None:
        per_expert = expert_params(cfg)
        if cfg.quant.scheme != "block":  # FP8 experts (block-scaled configs leave them bf16)
            per_expert += 4 * (cfg.moe_intermediate_size + (cfg.moe_latent_size or cfg.hidden_size))
        else:
            per_expert *= 2
        idle = num_moe_layers(cfg) * (cfg.n_routed_experts - experts_per_layer) * per_expert
        return weight_bytes(cfg) - idle
    router = router_params(cfg)
    return (active_matmul_params(cfg, experts_per_layer) - router) * bytes_per_param + router * 4


def batch_experts(cfg: HybridModelConfig, batch: int) -> float:
    """Routed experts one MoE layer reads in a decode step of `batch` sequences (uniform routing)."""
    if not num_moe_layers(cfg):
        return 0.0
    return expected_distinct_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, batch)


def active_decode_step_bytes(cfg: HybridModelConfig, batch: int, context: float) -> float:
    """`decode_step_bytes` over active parameters: the experts the batch touches, the rest of the weights,
    each sequence's Mamba state read and written, and the K/V of `context` tokens per sequence read."""
    weights = active_weight_bytes(cfg, batch_experts(cfg, batch))
    return weights + batch * (2 * cfg.state_bytes_per_sequence + context * cfg.kv_bytes_per_token)


def active_decode_step_ms(cfg: HybridModelConfig, batch: int, context: float, bw: float) -> float:
    return active_decode_step_bytes(cfg, batch, context) / bw * 1e3


def active_decode_tokens_per_s(cfg: HybridModelConfig, bw: float) -> float:
    """Batch-1 decode tok/s when the active weights (top-k experts + the rest) stream at `bw`."""
    return bw / active_weight_bytes(cfg)


def active_prefill_tokens_per_s(cfg: HybridModelConfig, flops: float) -> float:
    """Prefill tokens per second at `flops`: 2 FLOPs per active matmul parameter per token (the top-k
    experts of each token, not the experts the whole prompt touches)."""
    return flops / (2 * active_matmul_params(cfg))


def main() -> None:
    ap = argparse.ArgumentParser(description="measure this GPU's ceilings")
    ap.add_argument(
        "--out", type=Path, default=None, help="write them as JSON (sweep_roofline.py --ceilings)"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("roofline.py: needs a CUDA device")
    c = measure_ceilings("cuda")
    print(c.summary())
    if args.out:
        args.out.write_text(json.dumps(c.to_dict(), indent=2) + "\n")


if __name__ == "__main__":
    main()
