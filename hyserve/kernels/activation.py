"""relu^2, NemotronH's MLP activation (plain-torch reference): square(relu(x)) in x.dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def relu2_ref(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))
