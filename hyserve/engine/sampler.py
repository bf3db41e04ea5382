"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, and logprobs.

Logprobs are reported from the model's raw distribution (log_softmax of the logits, before temperature
and filtering), as vLLM does by default. A request with a seed draws from its own generator keyed by
(seed, output index), so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from hyserve.engine.outputs import TokenLogprob
from hyserve.engine.sampling_params import SamplingParams


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits: [V] float32 -> temperature-scaled, filtered logits (-inf where excluded)."""
    x = logits / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_x, dim=-1) >= p.top_p  # keep the smallest set reaching top_p
        drop[0] = False
        x = x.scatter(0, idx, sorted_x.masked_fill(drop, float("-inf")))
    return x


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._gen = torch.Generator(device="cpu")
        self._gen.manual_seed(seed)

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [n, V] float32 (any device) -> n token ids and, where requested, their logprobs."""
        n = logits.shape[0]
        if n == 0:
            return [], []
        tokens: list[int] = [0] * n
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            am = logits[greedy].argmax(dim=-1).tolist()
            for i, t in zip(greedy, am):
                tokens[i] = int(t)
        rest = [i for i, p in enumerate(params) if not p.greedy]
        if rest:
            cpu = logits[rest].float().cpu()
            for j, i in enumerate(rest):
                p = params[i]
                probs = torch.softmax(_filter(cpu[j], p), dim=-1)
                if p.seed is not None:
                    g = torch.Generator(device="cpu")
                    g.manual_seed((p.seed * 1_000_003 + output_index[i]) & 0x7FFF_FFFF_FFFF_FFFF)
                else:
                    g = self._gen
                tokens[i] = int(torch.multinomial(probs, 1, generator=g).item())
        lps: list[TokenLogprob | None] = [None] * n
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            lp = torch.log_softmax(logits[want].float(), dim=-1).cpu()
            for j, i in enumerate(want):
                k = params[i].logprobs or 0
                top: dict[int, float] = {}
                if k > 0:
                    v, ids = torch.topk(lp[j], k)
                    top = {int(t): float(x) for t, x in zip(ids.tolist(), v.tolist())}
                lps[i] = TokenLogprob(token_id=tokens[i], logprob=float(lp[j, tokens[i]]), top=top)
        return tokens, lps
