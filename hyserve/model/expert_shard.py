"""Which routed experts, and which slice of each, a rank holds under expert / tensor parallelism: the `ep`
group splits the experts (rank r holds E / ep of them), the `moe_tp` group each expert's intermediate
dimension. Every rank routes every token; a (token, slot) pair on another rank's expert runs with weight 0
on a clamped local id, so shapes stay fixed and nothing reads the host. Shared by NemotronH's experts
(`moe.Experts`), Granite's stacked experts (`softmax_moe.StackedExperts`) and the FP8 expert loaders."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyserve.distributed import Group


@dataclass(frozen=True)
class ExpertShard:
    num_experts: int
    num_local: int
    first_expert: int
    inter_local: int
    inter_start: int

    @classmethod
    def of(
        cls,
        num: int,
        inter: int,
        ep: Group,
        moe_tp: Group,
        names: tuple[str, str] = ("experts", "intermediate"),
    ) -> ExpertShard:
        """This rank's share of `num` experts of intermediate size `inter`; ValueError (naming the config keys
        `names`) where a group does not divide them."""
        for what, n, g in ((names[0], num, ep), (names[1], inter, moe_tp)):
            if n % g.size:
                raise ValueError(f"{what} ({n}) is not divisible by the {g.name} group size ({g.size})")
        num_local, inter_local = num // ep.size, inter // moe_tp.size
        return cls(num, num_local, ep.rank * num_local, inter_local, moe_tp.rank * inter_local)

    @property
    def whole(self) -> bool:
        """Whether this rank holds every expert."""
        return self.num_local == self.num_experts

    def local(self, expert: int | None) -> list[tuple[int, int]]:
        """(checkpoint expert, local index) pairs a load fills: all of this rank's for a stacked tensor
        (expert None), one for expert `expert`'s matrix if this rank holds it, else none."""
        if expert is None:
            return [(self.first_expert + i, i) for i in range(self.num_local)]
        if self.first_expert <= expert < self.first_expert + self.num_local:
            return [(expert, expert - self.first_expert)]
        return []

    def to_local(self, w: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights [T, k] and expert ids [T, k] -> this rank's: another rank's expert gets weight 0
        on a clamped local id."""
        if self.whole:
            return w, ids
        local = ids - self.first_expert
        mine = (local >= 0) & (local < self.num_local)
        return torch.where(mine, w, 0.0), local.clamp(0, self.num_local - 1).to(ids.dtype)
