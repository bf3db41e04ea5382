"""N-gram (prompt-lookup) drafting: no extra weights. The longest suffix of a request's context, between
`min_n` and `max_n` tokens, is looked up earlier in that context, and the tokens that followed its most
recent earlier occurrence are the draft.

Each request's context is kept as one growing byte string of int32 token ids (appended as tokens arrive),
so a lookup is `bytearray.rfind` at C speed: a match at a byte offset that is not a token boundary is
skipped by searching again to its left. A million-token context is searched in about a millisecond.
"""

from __future__ import annotations

from array import array

from hyserve.engine.request import Request

_ITEM = 4  # bytes per token id (int32)


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        # request id -> (the request, its context's token ids as int32 bytes)
        self._ctx: dict[str, tuple[Request, bytearray]] = {}

    def _context(self, req: Request) -> bytearray:
        """The request's prompt + outputs as int32 bytes, extended by what arrived since the last call."""
        held = self._ctx.get(req.request_id)
        if held is None or held[0] is not req:
            buf = bytearray(array("i", req.prompt_token_ids).tobytes())
            self._ctx[req.request_id] = (req, buf)
        else:
            buf = held[1]
        have = len(buf) // _ITEM - req.num_prompt_tokens
        if have < len(req.output_token_ids):
            buf += array("i", req.output_token_ids[have:]).tobytes()
        return buf

    def propose(self, req: Request, k: int) -> list[int]:
        """Up to `k` draft tokens for the request's next positions ([] when no n-gram recurs)."""
        if k <= 0:
            return []
        buf = self._context(req)
        n_tok = len(buf) // _ITEM
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            start = self._earlier(buf, n, n_tok)
            if start is not None:
                follow = start + n
                ids = array("i")
                ids.frombytes(bytes(buf[follow * _ITEM : min(follow + k, n_tok) * _ITEM]))
                return ids.tolist()
        return []

    @staticmethod
    def _earlier(buf: bytearray, n: int, n_tok: int) -> int | None:
        """The token index of the most recent occurrence of the context's last `n` tokens that ends before
        the context's last token (so a token follows it), or None."""
        pattern = bytes(buf[(n_tok - n) * _ITEM :])
        end = (n_tok - 1) * _ITEM
        while True:
            at = buf.rfind(pattern, 0, end)
            if at < 0:
                return None
            if at % _ITEM == 0:
                return at // _ITEM
            end = at + len(pattern) - 1  # an unaligned hit: look again left of it

    def remove(self, request_id: str) -> None:
        self._ctx.pop(request_id, None)
