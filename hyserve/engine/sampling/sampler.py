"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, and logprobs.

`Sampler.sample` works on the whole batch at once, on the logits' device, with no host sync until the
final `.tolist()` (one device->host copy for the tokens, one more when any row wants logprobs):

    greedy rows      argmax of the raw logits, nothing else
    sampled rows     gathered into x [m, V] float32, then
      temperature    x / t, t a per-row [m, 1] tensor (skipped when every t is 1)
      filters        each of top-k, min-p and top-p keeps a prefix of the row sorted by logit, so
                     together they reduce to one per-row threshold: tokens with x < thr are excluded
                       no top-p row:  top-k from one `topk` at the batch's largest k, each row's
                                      threshold gathered at its own k; min-p as x_max + log(min_p)
                                      (p_i / p_max = exp(x_i - x_max), so no softmax is needed)
                       any top-p row: one descending sort; top-k and min-p masked in sorted order,
                                      then softmax + cumsum give how many tokens each row keeps
      draw           exponential race (Gumbel-max in disguise): token = argmax(w / E) with
                     w = exp(x - x_max) masked to 0 where excluded and E ~ Exp(1) per token, which
                     picks token i with probability w_i / sum(w) -- no multinomial, no sync

Noise: rows without a seed draw E from one generator on the logits' device, seeded with the engine
seed (a fresh `Sampler` restarts that stream). A row with a seed draws its [V] noise, in vocabulary
order, from a generator on the same device re-seeded from (seed, output index), one small kernel per
seeded row; so its token depends only on its own logits, never on the other rows of the batch or
their order. The same seed gives the same tokens on the same kind of device (CPU and CUDA generators
produce different streams).

Penalties and logit bias edit a copy of the logits first (`logits_processing.py`), for the rows that ask;
a structured-outputs bitmask then sets the tokens a grammar forbids to -inf (`structured_output.py`).
Logprobs are reported from the model's raw distribution (log_softmax of the logits, before temperature
and filtering), as vLLM does by default, with the requested top alternatives sorted by logprob.
Host-side per-row parameters (and the sampled rows' indices) travel in one small pinned, non-blocking
copy; the logprob rows' indices in one more when only some rows want logprobs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hyserve.engine.host_tensors import to_device
from hyserve.engine.outputs import TokenLogprob
from hyserve.engine.sampling.logits_processing import History, process_logits
from hyserve.engine.sampling.structured_output import apply_token_bitmask
from hyserve.engine.sampling_params import SamplingParams

_SEED_MULT = 1_000_003
_SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF
# E == 0 would turn an excluded token's 0 / E into NaN, which argmax treats as the largest value
_MIN_NOISE = 1e-30


def _seed_key(seed: int, output_index: int) -> int:
    return (seed * _SEED_MULT + output_index) & _SEED_MASK


def _rows(idx: list[int], n: int, device: torch.device) -> torch.Tensor | None:
    """Row indices as a device tensor, or None when they are simply 0..n-1 (no gather needed)."""
    if len(idx) == n:
        return None
    return to_device(torch.tensor(idx, dtype=torch.long), device)


def logprob_table(logits: torch.Tensor, chosen: torch.Tensor, kmax: int) -> torch.Tensor:
    """log_softmax of `logits` [w, V] as one float64 table [w, 1 + 2 * kmax] on the device: each row's
    logprob of `chosen[r]`, then its top-`kmax` logprobs and their ids (sorted descending)."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [w, V]
    cols = [lp.gather(1, chosen.unsqueeze(1)).double()]  # [w, 1]
    if kmax > 0:
        vals, ids = torch.topk(lp, kmax, dim=-1)  # [w, kmax], sorted descending
        cols += [vals.double(), ids.double()]  # ids < 2**53: exact in float64
    return torch.cat(cols, dim=1)


def table_logprobs(
    table: list[list[float]], chosen_ids: list[int], ks: list[int], kmax: int
) -> list[TokenLogprob]:
    """`logprob_table`'s rows (read to the host) -> one TokenLogprob per row with its top `ks[r]`."""
    out = []
    for row, tok, k in zip(table, chosen_ids, ks):
        top = {int(row[1 + kmax + j]): row[1 + j] for j in range(min(k, kmax))}
        out.append(TokenLogprob(token_id=tok, logprob=row[0], top=top))
    return out


def token_logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, chosen_ids: list[int], ks: list[int]
) -> list[TokenLogprob]:
    """log_softmax of `logits` [w, V]: row r's logprob of `chosen[r]` (ids `chosen_ids[r]`) and its top
    `ks[r]` alternatives, in one device->host copy."""
    kmax = min(max(ks, default=0), logits.shape[1])
    return table_logprobs(logprob_table(logits, chosen, kmax).tolist(), chosen_ids, ks, kmax)


@dataclass
class PendingLogprobs:
    """The logprob rows of a step whose tokens are still on the device (async scheduling)."""

    table: torch.Tensor  # logprob_table of the rows `want`
    want: list[int]  # the batch rows that asked for logprobs
    ks: list[int]
    kmax: int

    def entries(self, token_list: list[int], table: list[list[float]]) -> list[TokenLogprob | None]:
        """Per batch row (of `token_list`): its TokenLogprob from `table` (this table read to the host),
        None for rows that did not ask."""
        out: list[TokenLogprob | None] = [None] * len(token_list)
        for i, e in zip(
            self.want, table_logprobs(table, [token_list[i] for i in self.want], self.ks, self.kmax)
        ):
            out[i] = e
        return out


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._gens: dict[torch.device, torch.Generator] = {}  # unseeded rows: one stream per device
        self._seeded: dict[torch.device, torch.Generator] = {}  # re-seeded for every seeded row

    def _generator(self, device: torch.device) -> torch.Generator:
        g = self._gens.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self._seed)
            self._gens[device] = g
        return g

    def _seeded_generator(self, device: torch.device) -> torch.Generator:
        # Reusing one generator is safe: a launch takes the generator's (seed, offset) by value.
        g = self._seeded.get(device)
        if g is None:
            g = self._seeded[device] = torch.Generator(device=device)
        return g

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        output_index: list[int],
        histories: Sequence[History | None] | None = None,
        bitmask: torch.Tensor | None = None,
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [n, V] float32 (any device) -> n token ids and, where requested, their logprobs.

        `params[i]` and `output_index[i]` (how many tokens row i's request has already produced) belong to
        row i; `histories[i]` (prompt ids, output ids) to a row with a repetition, frequency or presence
        penalty (logits_processing.py). `logits` is not modified; logprobs come from it (the raw model).
        """
        n = logits.shape[0]
        if n == 0:
            return [], []
        tokens = self.sample_tokens(logits, params, output_index, histories, bitmask=bitmask)
        token_list = [int(t) for t in tokens.tolist()]
        pending = self.pending_logprobs(logits, tokens, params)
        if pending is None:
            return token_list, [None] * n
        return token_list, pending.entries(token_list, pending.table.tolist())

    def sample_tokens(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        output_index: list[int],
        histories: Sequence[History | None] | None = None,
        pending: torch.Tensor | None = None,
        bitmask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The token ids [n] (long, on the logits' device) of `sample`, without reading them to the host:
        nothing here waits for the device. `pending`: each row's output token still on the device (-1:
        none), counted in its penalty history (`process_logits`). `bitmask` [n, ceil(V / 32)] int32 (host or
        device): the tokens each row may take (structured outputs; structured_output.py), applied on the
        device after the penalties, so every filter and the draw see only allowed tokens."""
        x = process_logits(logits, params, histories, pending)
        if bitmask is not None:
            x = apply_token_bitmask(
                x, bitmask if bitmask.device == x.device else to_device(bitmask, x.device)
            )
        rest = [i for i, p in enumerate(params) if not p.greedy]
        if not rest:
            return x.argmax(dim=-1)  # [n]
        sampled, rows = self._sample_rows(x, params, output_index, rest)
        if rows is None:
            return sampled
        tokens = x.argmax(dim=-1)  # greedy rows: a pure argmax; the sampled rows are overwritten
        tokens[rows] = sampled
        return tokens

    def _sample_rows(
        self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int], rest: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The non-greedy rows `rest` -> their sampled token ids [m] (long, on the logits' device) and
        their row indices there (None when `rest` is every row)."""
        n, vocab = logits.shape
        dev = logits.device
        m = len(rest)
        ps = [params[i] for i in rest]
        # top_k >= vocab keeps everything, so it counts as off (k = vocab below)
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in ps]
        any_temp = any(p.temperature != 1.0 for p in ps)
        any_top_k = any(k < vocab for k in ks)
        any_min_p = any(p.min_p > 0.0 for p in ps)
        any_top_p = any(p.top_p < 1.0 for p in ps)

        # one host->device copy of the per-row parameters: [5, m] = row, temperature, k, top_p, min_p
        host = torch.tensor(
            [
                [float(i) for i in rest],
                [p.temperature for p in ps],
                [float(k) for k in ks],
                [p.top_p if p.top_p < 1.0 else math.inf for p in ps],  # inf: top-p off for that row
                [p.min_p for p in ps],
            ],
            dtype=torch.float32,
        )
        prm = to_device(host, dev)

        rows = prm[0].long() if m < n else None
        x = (logits if rows is None else logits[rows]).float()  # [m, V]
        if any_temp:
            x = x / prm[1].unsqueeze(1)  # temperatures are > 0 for sampled rows
        k = prm[2].long().unsqueeze(1)  # [m, 1]
        top_p = prm[3].unsqueeze(1)  # [m, 1]
        log_min_p = prm[4].log().unsqueeze(1)  # [m, 1]; log(0) = -inf keeps everything

        x_max: torch.Tensor | None = None  # [m, 1]
        thr: torch.Tensor | None = None  # [m, 1]; tokens with x < thr are excluded
        if any_top_p:
            s = torch.sort(x, dim=-1, descending=True).values  # [m, V]
            x_max = s[:, :1]
            if any_top_k:
                pos = torch.arange(vocab, device=dev).unsqueeze(0)  # [1, V]
                s = s.masked_fill(pos >= k, float("-inf"))
            if any_min_p:
                s = s.masked_fill(s < x_max + log_min_p, float("-inf"))
            probs = torch.softmax(s, dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass strictly before each sorted position
            # keep the smallest prefix whose mass reaches top_p (and nothing already excluded)
            keep = (before < top_p) & (s > float("-inf"))
            kept = keep.sum(dim=-1, keepdim=True).clamp_min(1)  # [m, 1]
            thr = s.gather(1, kept - 1)
        else:
            if any_top_k:
                kmax = max(kk for kk in ks if kk < vocab)
                top = torch.topk(x, kmax, dim=-1).values  # [m, kmax], descending
                x_max = top[:, :1]
                kth = top.gather(1, (k.clamp_max(kmax) - 1))
                thr = torch.where(k < vocab, kth, float("-inf"))
            if any_min_p:
                if x_max is None:
                    x_max = x.amax(dim=-1, keepdim=True)
                mp = x_max + log_min_p
                thr = mp if thr is None else torch.maximum(thr, mp)
        if x_max is None:
            x_max = x.amax(dim=-1, keepdim=True)

        w = (x - x_max).exp_()  # [m, V]: unnormalised probabilities (normalising does not move argmax)
        if thr is not None:
            w.masked_fill_(x < thr, 0.0)
        w.div_(self._noise(m, vocab, dev, ps, [output_index[i] for i in rest]))
        return w.argmax(dim=-1), rows

    def _noise(
        self, m: int, vocab: int, dev: torch.device, ps: list[SamplingParams], out_idx: list[int]
    ) -> torch.Tensor:
        """Exp(1) noise [m, V]: unseeded rows from the engine's stream, seeded rows from their own key."""
        q = torch.empty(m, vocab, dtype=torch.float32, device=dev)
        seeded = [j for j, p in enumerate(ps) if p.seed is not None]
        if len(seeded) < m:  # one kernel for every row; the seeded rows are then overwritten
            q.exponential_(generator=self._generator(dev))
        if seeded:
            g = self._seeded_generator(dev)
            for j in seeded:
                g.manual_seed(_seed_key(ps[j].seed or 0, out_idx[j]))
                q[j].exponential_(generator=g)  # a contiguous [V] row: same values as a fresh tensor
        return q.clamp_min_(_MIN_NOISE)

    def pending_logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
    ) -> PendingLogprobs | None:
        """The logprob table of the rows that want logprobs, left on the device (no host read): for a step
        whose tokens are read later. None when no row wants logprobs."""
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not want:
            return None
        rows = _rows(want, logits.shape[0], logits.device)
        raw = logits if rows is None else logits[rows]
        chosen = tokens if rows is None else tokens[rows]
        ks = [params[i].logprobs or 0 for i in want]
        kmax = min(max(ks), logits.shape[1])
        return PendingLogprobs(logprob_table(raw, chosen, kmax), want, ks, kmax)
