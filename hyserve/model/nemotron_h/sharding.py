"""How a NemotronH model splits over tp_size / ep_size ranks: every problem with the numbers, naming the
config field and the knob (docs/architecture.md, "Parallelism").

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

from typing import Protocol

from hyserve.model.config import LAYER_ATTENTION, LAYER_MAMBA, LAYER_MLP, LAYER_MOE


class _Shape(Protocol):
    """The fields the rules read (HybridModelConfig's)."""

    @property
    def layer_types(self) -> tuple[str, ...]: ...

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def num_key_value_heads(self) -> int: ...

    @property
    def mamba_num_heads(self) -> int: ...

    @property
    def n_groups(self) -> int: ...

    @property
    def intermediate_size(self) -> int: ...

    @property
    def n_routed_experts(self) -> int: ...

    @property
    def num_experts_per_tok(self) -> int: ...

    @property
    def moe_intermediate_size(self) -> int: ...

    @property
    def moe_shared_expert_intermediate_size(self) -> int: ...


def sharding_problems(cfg: _Shape, *, tp_size: int, ep_size: int) -> list[str]:
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
