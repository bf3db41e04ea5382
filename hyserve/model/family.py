"""What a model family provides, typed: its config (`FamilyConfig`), its model (`FamilyModel`) and the
entry that ties them to config.json names (`Family`). The registry holds one `Family` per folder under
`model/` (docs/architecture.md, "Adding a model family"); the engine sees each through `ModelFamily`, whose
methods take the engine's `ModelSpec` / `CausalLM` and check they are this family's before passing them on.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, Self, TypeVar, runtime_checkable

import torch
from torch import nn

from hyserve.kernels.ops import KernelOp
from hyserve.model.kv_scales import (
    KVScaledModel,
    apply_kv_scales,
    load_checkpoint_with_kv_scales,
    record_kv_amax,
    update_kv_scales,
)
from hyserve.model.layer_specs import CacheLayout
from hyserve.model.protocol import CausalLM, ModelSpec
from hyserve.model.quant_config import QuantConfig
from hyserve.model.random_init import init_random_weights


@runtime_checkable
class FamilyConfig(ModelSpec, Protocol):
    """A family's parsed config.json (a frozen dataclass): the engine's `ModelSpec` plus what the shared
    machinery asks of it."""

    @property
    def quant(self) -> QuantConfig | None: ...

    @property
    def time_step_min(self) -> float:
        """The smallest Mamba dt of random init."""
        ...

    def init_rule(self, name: str) -> tuple[str, float]:
        """(kind, std) of a parameter's random init (random_init.py)."""
        ...

    def cache_layout(self) -> CacheLayout:
        """What every attention and Mamba layer stores (at tp_size 1)."""
        ...

    def sharding_problems(self, *, tp_size: int, ep_size: int) -> list[str]: ...

    def with_quant(self, quant: QuantConfig | None) -> Self:
        """The same architecture with the projections in `quant`'s format (None: 16-bit)."""
        ...

    def with_cache_dtypes(
        self,
        *,
        ssm_cache_dtype: str | torch.dtype | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        ssm_stochastic_rounding: bool | None = None,
        ssm_philox_rounds: int | None = None,
        ssm_rounding_seed: int | None = None,
    ) -> Self:
        """The engine's cache options folded in (None keeps the current value)."""
        ...


@runtime_checkable
class FamilyModel(CausalLM, KVScaledModel, Protocol):
    """A family's model: a `CausalLM` whose attention layers and checkpoint names the loaders reach."""

    def finish_load(self) -> None:
        """Serving layouts once the weights are loaded on the device (packed q/k/v)."""
        ...


C = TypeVar("C", bound=FamilyConfig)
M = TypeVar("M", bound=FamilyModel)


class ModelFamily(Protocol):
    """One family as the engine uses it (the `Family` entries below)."""

    @property
    def name(self) -> str: ...

    @property
    def model_types(self) -> tuple[str, ...]: ...

    @property
    def architectures(self) -> tuple[str, ...]: ...

    @property
    def kernel_ops(self) -> tuple[KernelOp, ...]: ...

    def parse_config(self, raw: dict[str, object], name: str) -> ModelSpec: ...

    def build(self, cfg: ModelSpec, dtype: torch.dtype) -> CausalLM: ...

    def with_quant(self, cfg: ModelSpec, quant: QuantConfig | None) -> ModelSpec: ...

    def with_mtp(self, cfg: ModelSpec) -> ModelSpec: ...

    def with_cache_dtypes(
        self,
        cfg: ModelSpec,
        *,
        ssm_cache_dtype: str | torch.dtype | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        ssm_stochastic_rounding: bool | None = None,
        ssm_philox_rounds: int | None = None,
        ssm_rounding_seed: int | None = None,
    ) -> ModelSpec: ...

    def weight_bytes(self, cfg: ModelSpec, dtype: torch.dtype) -> int: ...

    def init_random(self, model: CausalLM, cfg: ModelSpec, seed: int, *, on_device: bool = False) -> None: ...

    def load_weights(self, model: CausalLM, model_dir: Path) -> dict[int, dict[str, float]]: ...

    def set_kv_scales(
        self,
        model: CausalLM,
        scales: dict[int, dict[str, float]],
        *,
        fp8: bool,
        dummy: bool = False,
        source: str = "auto",
    ) -> dict[int, tuple[str, ...]]: ...

    def update_kv_scales(self, model: CausalLM, scales: dict[int, dict[str, float]]) -> None: ...

    def record_kv_amax(self, model: CausalLM) -> AbstractContextManager[dict[int, torch.Tensor]]: ...

    def finish_load(self, model: CausalLM) -> None: ...


@dataclass(frozen=True, kw_only=True)
class Family(Generic[C, M]):
    """A family's entry: the config.json names it answers to, its config and model classes, how to parse
    and build them, the weight bytes of a config (the pre-load check) and the kernel ops its layers call (on
    CUDA, start-up fails naming any of them without a CUDA implementation)."""

    name: str
    model_types: tuple[str, ...]  # config.json "model_type" values
    architectures: tuple[str, ...]  # config.json "architectures" entries
    config_type: type[C]
    model_type: type[M]
    parse: Callable[[dict[str, object], str], C]  # (raw config.json, checkpoint name)
    build_model: Callable[[C, torch.dtype], M]  # call under a device context (meta for the loader)
    weight_bytes_of: Callable[[C, torch.dtype], int]  # bytes of the weights at tp_size 1 in that dtype
    kernel_ops: tuple[KernelOp, ...]

    def config(self, cfg: ModelSpec) -> C:
        if not isinstance(cfg, self.config_type):
            raise TypeError(f"model family {self.name!r}: {type(cfg).__name__} is not its config")
        return cfg

    def model(self, model: CausalLM) -> M:
        if not isinstance(model, self.model_type):
            raise TypeError(f"model family {self.name!r}: {type(model).__name__} is not its model")
        return model

    def parse_config(self, raw: dict[str, object], name: str) -> C:
        return self.parse(raw, name)

    def build(self, cfg: ModelSpec, dtype: torch.dtype) -> M:
        return self.build_model(self.config(cfg), dtype)

    def with_quant(self, cfg: ModelSpec, quant: QuantConfig | None) -> C:
        return self.config(cfg).with_quant(quant)

    def with_mtp(self, cfg: ModelSpec) -> C:
        """The config with its multi-token-prediction block built (speculative_config.method 'mtp');
        ValueError where the family or the checkpoint has none."""
        c = self.config(cfg)
        fold = getattr(c, "with_mtp", None)
        if fold is None:
            raise ValueError(
                f"speculative_config.method 'mtp': {self.name} models have no multi-token-prediction layer; "
                "use method 'ngram'"
            )
        return fold()

    def with_cache_dtypes(
        self,
        cfg: ModelSpec,
        *,
        ssm_cache_dtype: str | torch.dtype | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        ssm_stochastic_rounding: bool | None = None,
        ssm_philox_rounds: int | None = None,
        ssm_rounding_seed: int | None = None,
    ) -> C:
        return self.config(cfg).with_cache_dtypes(
            ssm_cache_dtype=ssm_cache_dtype,
            kv_cache_dtype=kv_cache_dtype,
            ssm_stochastic_rounding=ssm_stochastic_rounding,
            ssm_philox_rounds=ssm_philox_rounds,
            ssm_rounding_seed=ssm_rounding_seed,
        )

    def weight_bytes(self, cfg: ModelSpec, dtype: torch.dtype) -> int:
        return self.weight_bytes_of(self.config(cfg), dtype)

    def init_random(self, model: CausalLM, cfg: ModelSpec, seed: int, *, on_device: bool = False) -> None:
        """on_device: a CUDA model's normal weights drawn by its GPU (random_init.init_random_weights)."""
        m = self.model(model)
        if not isinstance(m, nn.Module):
            raise TypeError(f"{type(m).__name__} is not a torch module")
        init_random_weights(m, self.config(cfg), seed=seed, on_device=on_device)

    def load_weights(self, model: CausalLM, model_dir: Path) -> dict[int, dict[str, float]]:
        return load_checkpoint_with_kv_scales(self.model(model), model_dir)

    def set_kv_scales(
        self,
        model: CausalLM,
        scales: dict[int, dict[str, float]],
        *,
        fp8: bool,
        dummy: bool = False,
        source: str = "auto",
    ) -> dict[int, tuple[str, ...]]:
        return apply_kv_scales(self.model(model), scales, fp8=fp8, dummy=dummy, source=source)

    def update_kv_scales(self, model: CausalLM, scales: dict[int, dict[str, float]]) -> None:
        update_kv_scales(self.model(model), scales)

    def record_kv_amax(self, model: CausalLM) -> AbstractContextManager[dict[int, torch.Tensor]]:
        return record_kv_amax(self.model(model))

    def finish_load(self, model: CausalLM) -> None:
        self.model(model).finish_load()
