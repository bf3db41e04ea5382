"""How a NemotronH model splits over tp_size / ep_size ranks: the start-up checks (every problem with the
numbers and the knob) and the per-rank sizes the cache needs (docs/architecture.md, "Parallelism").

    attention   query heads split (num_attention_heads % tp == 0); KV heads split, or replicated when
                fewer than the ranks (tp % num_key_value_heads == 0)
    mamba2      heads split (mamba_num_heads % tp == 0); B/C groups split, or replicated when fewer than
                the ranks (tp % n_groups == 0); conv channels and states follow the heads and groups
    mlp         intermediate_size split
    moe         experts over ep_size (n_routed_experts % ep == 0), each expert's intermediate over
                tp / ep ranks; the shared expert over tp
    vocab       padded to a multiple of tp (no constraint)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hyserve.distributed import check_world
from hyserve.model.config import LAYER_ATTENTION, LAYER_MAMBA, LAYER_MLP, LAYER_MOE, HybridModelConfig
from hyserve.model.protocol import ModelSpec


def sharding_problems(cfg: HybridModelConfig, *, tp_size: int, ep_size: int) -> list[str]:
    """Every reason `cfg` cannot run at tp_size / ep_size (empty when it can)."""
    kinds = set(cfg.layer_types)
    tp, ep = tp_size, ep_size
    out: list[str] = []

    def divides(field: str, value: int, knob: str, n: int, what: str) -> None:
        if value % n:
            out.append(
                f"{field} ({value}) is not divisible by {knob} ({n}): the {what} are split over the ranks"
            )

    def splits_or_replicates(field: str, value: int, what: str) -> None:
        if value % tp and tp % value:
            out.append(
                f"{field} ({value}) and tp_size ({tp}) do not fit: {what} are split when tp_size divides "
                "them and replicated when they divide tp_size"
            )

    if LAYER_ATTENTION in kinds:
        divides("num_attention_heads", cfg.num_attention_heads, "tp_size", tp, "query heads")
        splits_or_replicates("num_key_value_heads", cfg.num_key_value_heads, "KV heads")
    if LAYER_MAMBA in kinds:
        divides("mamba_num_heads", cfg.mamba_num_heads, "tp_size", tp, "Mamba heads")
        splits_or_replicates("n_groups", cfg.n_groups, "Mamba B/C groups")
    if LAYER_MLP in kinds:
        divides("intermediate_size", cfg.intermediate_size, "tp_size", tp, "MLP columns")
    if LAYER_MOE in kinds and ep >= 1 and tp % ep == 0:
        divides("n_routed_experts", cfg.n_routed_experts, "ep_size", ep, "routed experts")
        if cfg.n_routed_experts // ep < cfg.num_experts_per_tok:
            out.append(
                f"n_routed_experts / ep_size ({cfg.n_routed_experts} / {ep}) is fewer than "
                f"num_experts_per_tok ({cfg.num_experts_per_tok}): each rank's experts must be able to take "
                "a token's top-k"
            )
        divides(
            "moe_intermediate_size",
            cfg.moe_intermediate_size,
            "tp_size / ep_size",
            tp // ep,
            "expert columns (each expert is tensor-parallel over tp_size / ep_size ranks)",
        )
        divides(
            "moe_shared_expert_intermediate_size",
            cfg.moe_shared_expert_intermediate_size,
            "tp_size",
            tp,
            "shared-expert columns",
        )
    return out


def check_parallel(
    cfg: ModelSpec,
    *,
    tp_size: int,
    ep_size: int,
    world_size: int,
    device: str,
    local_world_size: int | None = None,
    visible_gpus: int | None = None,
) -> None:
    """Start-up check of the parallel settings against the world and the model; raises ValueError listing
    every problem (the world's first: sizes that do not fit the ranks make the model checks moot)."""
    check_world(
        tp_size=tp_size,
        ep_size=ep_size,
        world_size=world_size,
        device=device,
        local_world_size=local_world_size,
        visible_gpus=visible_gpus,
    )
    # the engine passes the family's spec; these sharding rules are NemotronH's (the one family)
    assert isinstance(cfg, HybridModelConfig), type(cfg).__name__
    problems = sharding_problems(cfg, tp_size=tp_size, ep_size=ep_size)
    if problems:
        name = f"{cfg.name} " if cfg.name else ""
        raise ValueError(
            f"model {name}does not split over tp_size {tp_size} / ep_size {ep_size}:\n  "
            + "\n  ".join(problems)
        )


def local_units(units: int, tp: int) -> int:
    """Heads / groups one rank holds: units / tp, or 1 when replicated (tp % units == 0)."""
    return units // tp if units % tp == 0 else 1


def rank_cache_config(cfg: HybridModelConfig, tp_size: int) -> HybridModelConfig:
    """`cfg` with the head and group counts of one rank, for sizing that rank's cache only (its
    `attention_cache_spec`, `mamba_cache_spec`, `kv_bytes_per_token`, `state_bytes_per_sequence` are
    per-rank); never build a model from it. tp_size 1 returns `cfg` itself."""
    if tp_size == 1:
        return cfg
    problems = sharding_problems(cfg, tp_size=tp_size, ep_size=1)
    if problems:
        raise ValueError("rank_cache_config: " + "; ".join(problems))
    kinds = set(cfg.layer_types)
    changes: dict[str, Any] = {}  # field -> its per-rank value
    if LAYER_ATTENTION in kinds:
        changes["num_attention_heads"] = cfg.num_attention_heads // tp_size
        changes["num_key_value_heads"] = local_units(cfg.num_key_value_heads, tp_size)
    if LAYER_MAMBA in kinds:
        changes["mamba_num_heads"] = cfg.mamba_num_heads // tp_size
        changes["n_groups"] = local_units(cfg.n_groups, tp_size)
    return dataclasses.replace(cfg, **changes)
