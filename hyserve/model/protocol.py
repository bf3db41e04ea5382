"""What the engine may know about a model: a small protocol every model family satisfies.

The engine sizes caches, validates requests and logs from a `ModelSpec`, and runs steps through a
`CausalLM`; it never names a family's classes (docs/architecture.md, "Adding a model family").
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from hyserve.model.cache_tensors import CacheTensors
from hyserve.model.forward_meta import ForwardMeta


class ModelSpec(Protocol):
    """The architecture facts the engine reads (a family's config dataclass provides them; read-only, so a
    frozen dataclass's fields satisfy them)."""

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def max_position_embeddings(self) -> int: ...

    @property
    def chunk_size(self) -> int:
        """Tokens per SSD chunk: snapshot boundaries inside a prefill chunk must fall on multiples of it."""
        ...

    @property
    def num_attention_heads(self) -> int:
        """Query heads of an attention layer (the step cost calibration times them)."""
        ...

    @property
    def kv_bytes_per_token(self) -> int: ...

    @property
    def state_bytes_per_sequence(self) -> int: ...

    @property
    def attention_flops_per_pair(self) -> int: ...

    @property
    def has_recurrent_state(self) -> bool: ...

    def num_parameters(self) -> int: ...

    def describe(self) -> str: ...


@runtime_checkable
class CausalLM(Protocol):
    """A model the runner can drive: packed tokens in, final hidden states out, logits on request."""

    @property
    def config(self) -> ModelSpec: ...

    @property
    def graph_capturable(self) -> bool:
        """Whether a pure decode step launches the same kernels every time with no host reads (CUDA
        graphs)."""
        ...

    def __call__(self, input_ids: torch.Tensor, meta: ForwardMeta, cache: CacheTensors) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def kernel_token_buckets(self, max_num_tokens: int) -> list[int]: ...

    def allocate_cache(
        self, *, num_blocks: int, tokens_per_block: int, num_slots: int, device: torch.device | str
    ) -> CacheTensors: ...
