"""Penalties and logit bias: the per-request edits of a row of logits before it is sampled (OpenAI and
vLLM semantics), for the rows whose `SamplingParams` ask for any.

    repetition_penalty r   tokens seen in the prompt or the output: logit / r where positive, * r
                           where negative (r > 1 discourages them; 1 = off)
    frequency_penalty f    logit -= f * (times the token appears in the output so far)
    presence_penalty p     logit -= p * (1 if it appears in the output so far)
    logit_bias             logit += bias, per listed token id

applied in that order. The histories come from the host each step as plain lists (O(prompt + output)
per penalised row per step; rows without penalties cost nothing), turned into one index tensor and
one `index_put_` per kind. With async scheduling a row's newest output token may still be on the device
(not yet read by the host): `pending` [n] holds it (-1 where none) and it is counted on the device. Logprobs
stay those of the raw model distribution (the sampler's choice, as vLLM's default), so only the choice of
token moves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hyserve.engine.host_tensors import to_device
from hyserve.engine.sampling_params import SamplingParams

History = tuple[Sequence[int], Sequence[int]]  # (prompt token ids, output token ids)


def _index(
    rows_tokens: Sequence[tuple[int, Sequence[int]]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index tensors for every token of every listed row."""
    rows = [torch.full((len(toks),), r, dtype=torch.long) for r, toks in rows_tokens]
    toks = [torch.as_tensor(list(toks), dtype=torch.long) for _, toks in rows_tokens]
    return to_device(torch.cat(rows), device), to_device(torch.cat(toks), device)


def _pending_index(
    pending: torch.Tensor | None, rows: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row j, token) device indices of the pending tokens of `rows` (row j = position in `rows`);
    rows without one (-1) point at a scratch column V (callers allocate V + 1 columns)."""
    if pending is None:
        return None
    sel = pending.index_select(0, to_device(torch.tensor(rows, dtype=torch.long), device))
    return torch.arange(len(rows), device=device), sel


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[History | None] | None,
    pending: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [n, V] -> the logits to sample from: a new float32 tensor with the penalised rows edited,
    or `logits` itself when no row asks for anything. `histories[i]` is needed for a row with a
    repetition, frequency or presence penalty; `pending` [n] (long, on the logits' device, -1 = none): each
    row's output token not yet in its history."""
    rows = [i for i, p in enumerate(params) if p.edits_logits]
    if not rows:
        return logits
    n, vocab = logits.shape
    dev = logits.device
    x = logits.float().clone()
    rep = [i for i in rows if params[i].repetition_penalty != 1.0]
    occ = [i for i in rows if params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0]
    for i in rep + occ:
        if histories is None or histories[i] is None:
            raise ValueError(f"row {i} has a penalty but no token history")
    if rep:
        seen = torch.zeros(len(rep), vocab + 1, dtype=torch.bool, device=dev)  # column V: scratch
        hist = [(j, [*histories[i][0], *histories[i][1]]) for j, i in enumerate(rep)]  # type: ignore[index]
        nonempty = [(j, t) for j, t in hist if t]
        if nonempty:
            r_idx, t_idx = _index(nonempty, dev)
            seen[r_idx, t_idx] = True
        pend = _pending_index(pending, rep, dev)
        if pend is not None:
            seen[pend[0], torch.where(pend[1] < 0, vocab, pend[1])] = True
        seen = seen[:, :vocab]
        pen = to_device(torch.tensor([params[i].repetition_penalty for i in rep], dtype=torch.float32), dev)[
            :, None
        ]
        rows_t = to_device(torch.tensor(rep, dtype=torch.long), dev)
        sub = x[rows_t]
        x[rows_t] = torch.where(seen, torch.where(sub > 0, sub / pen, sub * pen), sub)
    if occ:
        outs = [(j, histories[i][1]) for j, i in enumerate(occ) if len(histories[i][1])]  # type: ignore[index]
        pend = _pending_index(pending, occ, dev)
        if outs or pend is not None:
            counts = torch.zeros(len(occ), vocab + 1, dtype=torch.float32, device=dev)  # column V: scratch
            if outs:
                r_idx, t_idx = _index(outs, dev)
                counts.index_put_(
                    (r_idx, t_idx), torch.ones_like(r_idx, dtype=torch.float32), accumulate=True
                )
            if pend is not None:
                counts.index_put_(
                    (pend[0], torch.where(pend[1] < 0, vocab, pend[1])),
                    torch.ones_like(pend[0], dtype=torch.float32),
                    accumulate=True,
                )
            counts = counts[:, :vocab]
            coef = to_device(
                torch.tensor(
                    [[params[i].frequency_penalty, params[i].presence_penalty] for i in occ],
                    dtype=torch.float32,
                ),
                dev,
            )
            rows_t = to_device(torch.tensor(occ, dtype=torch.long), dev)
            x[rows_t] = x[rows_t] - coef[:, :1] * counts - coef[:, 1:] * (counts > 0).float()
    bias = [(i, params[i].logit_bias) for i in rows if params[i].logit_bias]
    if bias:
        r_list = [i for i, b in bias for _ in b]
        t_list = [t for _, b in bias for t, _ in b]
        v_list = [v for _, b in bias for _, v in b]
        x.index_put_(
            (
                to_device(torch.tensor(r_list, dtype=torch.long), dev),
                to_device(torch.tensor(t_list, dtype=torch.long), dev),
            ),
            to_device(torch.tensor(v_list, dtype=torch.float32), dev),
            accumulate=True,
        )
    assert x.shape == (n, vocab)
    return x


__all__ = ["History", "process_logits", "to_device"]
