"""The start-up check of the parallel settings: the world's sizes first, then every problem the model's
family finds with its numbers (its config's `sharding_problems`: each family's rules live in its folder,
built from the layer specs' own rules in `layer_specs.py`). docs/architecture.md, "Parallelism"."""

from __future__ import annotations

from hyserve.distributed import check_world
from hyserve.model.family import FamilyConfig
from hyserve.model.protocol import ModelSpec


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
    if not isinstance(cfg, FamilyConfig):
        raise TypeError(f"check_parallel: {type(cfg).__name__} is not a model family's config")
    problems = cfg.sharding_problems(tp_size=tp_size, ep_size=ep_size)
    if problems:
        name = f"{cfg.name} " if cfg.name else ""
        raise ValueError(
            f"model {name}does not split over tp_size {tp_size} / ep_size {ep_size}:\n  "
            + "\n  ".join(problems)
        )
