"""Rooflines of the Nemotron Nano 9B v2 benchmarks, from the ceilings measured on the H200 (DESIGN.md):
3.79 TB/s bf16 weight read (GEMV), 783 TFLOP/s bf16 dense matmul. One place for the byte and FLOP
counts that bench_model.py and sweep_roofline.py quote their ratios against."""

from __future__ import annotations

from hyserve.model.config import HybridModelConfig

BW = 3.79e12  # bf16 GEMV weight-read ceiling, B/s
FLOPS = 783e12  # bf16 dense matmul ceiling, FLOP/s


def matmul_params(cfg: HybridModelConfig) -> int:
    """Parameters read by every token's matmuls: all but the input embedding (a row gather)."""
    return cfg.num_parameters() - cfg.vocab_size * cfg.hidden_size


def weight_bytes(cfg: HybridModelConfig, bytes_per_param: int = 2) -> int:
    return matmul_params(cfg) * bytes_per_param


def decode_step_bytes(cfg: HybridModelConfig, batch: int, context: float) -> float:
    """Bytes one decode step must move: the weights once, each sequence's Mamba state read and written,
    and the K/V of `context` tokens per sequence read."""
    return weight_bytes(cfg) + batch * (2 * cfg.state_bytes_per_sequence + context * cfg.kv_bytes_per_token)


def decode_step_ms(cfg: HybridModelConfig, batch: int, context: float) -> float:
    return decode_step_bytes(cfg, batch, context) / BW * 1e3


def prefill_tokens_per_s(cfg: HybridModelConfig) -> float:
    return FLOPS / (2 * matmul_params(cfg))
