"""The rows of a sequence verified in a speculative step (docs/architecture.md, "Speculative decoding"): its
input token and each draft token become one decode row, chained through scratch state slots.

    row j           0              1 .. q-2            q-1
    state src       live slot      scratch[j-1]        scratch[q-2]
    state dst       scratch[0]     scratch[j]          live slot

Rows past the draft (a shorter draft padded to the step's width) repeat its last position, write no KV,
and are never sampled from. Both the eager runner and the decode graphs lay rows out this way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from hyserve.engine.scheduler.scheduler import ScheduledSeq


class VerifyRow(NamedTuple):
    token: int
    position: int  # tokens in cache before this row's token
    src: int
    dst: int
    writes_kv: bool


def verify_rows(s: ScheduledSeq, width: int, scratch: Sequence[int]) -> list[VerifyRow]:
    """The `width` rows of decoding sequence `s`, whose scratch slots are `scratch` (width - 1 of them)."""
    if len(scratch) < width - 1:
        raise RuntimeError(
            f"a sequence verified over {width} positions needs {width - 1} scratch state slots, got "
            f"{len(scratch)}"
        )
    live_src = s.state_dst if s.state_src is None else s.state_src
    chain = [live_src, *scratch[: width - 1], s.state_dst]
    rows = []
    for j in range(width):
        k = min(j, len(s.draft))
        rows.append(VerifyRow(s.token_ids[k], s.start_pos + k, chain[j], chain[j + 1], j == k))
    return rows


def scratch_of(scratch: Sequence[int], i: int, width: int) -> Sequence[int]:
    """The scratch slots of a step's decoding sequence i at this width."""
    return scratch[i * (width - 1) : (i + 1) * (width - 1)]
