"""Verifying drafts. A speculative step gives each decoding sequence one sampling row per verified
position: row j samples the token that follows the input token and the first j draft tokens, with the
request's own sampling parameters and output index (so a seeded request draws the same noise it would draw
without speculation). The draft is accepted while it matches those samples; the first mismatch (or the row
after a fully accepted draft) gives the one token the target model chose itself.

For a draft that is one token per position (n-gram, and MTP drafting greedily), sampling the target and
comparing is rejection sampling: the draft token d is accepted with probability p(d), and on rejection the
token drawn is distributed as p without d, so every emitted token follows the target distribution p; a
greedy request emits exactly the tokens plain decoding would.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyserve.engine.outputs import TokenLogprob
from hyserve.engine.request import Request
from hyserve.engine.scheduler.scheduler import ScheduledBatch, ScheduledSeq


@dataclass(slots=True)
class SampledRun:
    """What one sequence produced in a step: its request when launched, the tokens to append in order
    (and their logprob entries), and for a speculative row how many draft tokens it carried and how many
    of them were accepted. Tuples, not lists: one of these is made per sequence every step, and the
    collector need not track tuples of ints."""

    req: Request | None
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob | None, ...]
    draft_len: int = 0
    accepted: int = 0


def verified_run(
    req: Request | None, draft: list[int], sampled: list[int], lps: list[TokenLogprob | None]
) -> SampledRun:
    """The run of a sequence whose rows sampled `sampled` (one per verified position; rows past the draft
    are padding): the accepted draft prefix, then the target's own token after it."""
    a = 0
    while a < len(draft) and sampled[a] == draft[a]:
        a += 1
    return SampledRun(req, tuple(sampled[: a + 1]), tuple(lps[: a + 1]), len(draft), a)


def sampling_rows(batch: ScheduledBatch) -> tuple[list[ScheduledSeq], list[tuple[ScheduledSeq, int]]]:
    """The batch's sampling sequences, and its sampling rows in logits order as (sequence, position): one
    row per sequence, or in a speculative step `spec_width` rows per decoding sequence."""
    sampling = [s for s in batch.seqs if s.sample]
    if batch.spec_width == 1:
        return sampling, [(s, 0) for s in sampling]
    decodes = {id(s) for s in batch.seqs[: batch.num_decodes]}
    rows = [(s, j) for s in sampling for j in range(batch.spec_width if id(s) in decodes else 1)]
    return sampling, rows
