"""Streaming detokenizers: a stream of token ids in, text deltas out, never half a UTF-8 character.

Both keep the invariant "".join(feed(i) for i in ids) + flush() == tokenizer.decode(ids):

- `ByteLevelDetokenizer`, for byte-level BPE tokenizers (GPT-2 style, the Nemotron family's): a token is a
  fixed byte string, so the stream is those bytes through Python's incremental UTF-8 decoder (C code, which
  holds an incomplete character back). No tokenizer call per token.
- `IncrementalDetokenizer`, for any other (sentencepiece-style leading spaces): it decodes a short window
  of ids and emits the text past what the window's older part decodes to.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5


class _Decodes(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class ByteLevelDetokenizer:
    """Token bytes (`table[id]`, Tokenizer.stream_bytes) through an incremental UTF-8 decoder; special
    tokens (`special`) are left out when skip_special_tokens. Bytes that cannot start or continue a
    character decode as U+FFFD, as the tokenizers library's lossy decode does."""

    def __init__(self, table: Sequence[bytes], special: frozenset[int], *, skip_special_tokens: bool) -> None:
        self._table = table
        self._skip = special if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # everything emitted so far

    def feed(self, token_id: int) -> str:
        """Add one token; return the newly completed text ('' while a character is incomplete)."""
        if token_id in self._skip:
            return ""
        delta = self._utf8.decode(self._table[token_id] if 0 <= token_id < len(self._table) else b"")
        if delta:
            self.text += delta
        return delta

    def feed_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.feed(t) for t in token_ids)

    def flush(self) -> str:
        """End of stream: return held-back bytes (an incomplete character decodes as U+FFFD)."""
        delta = self._utf8.decode(b"", final=True)
        self.text += delta
        return delta


class IncrementalDetokenizer:
    """Decodes a short window of ids and emits the text past what the window's older part decodes to, only
    when that text does not end in U+FFFD (an incomplete multi-byte character). The window keeps the previous
    emission as context, which also gets sentencepiece-style leading spaces right:

        ids:   ... | prefix (already emitted) | read (pending) |
                     ^prefix_offset            ^read_offset
        delta = decode(prefix + pending)[len(decode(prefix)):]
    """

    def __init__(
        self, tokenizer: _Decodes, *, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:]) if prompt_ids else []
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def feed(self, token_id: int) -> str:
        """Add one token; return the newly completed text ('' while a character is incomplete)."""
        self._ids.append(int(token_id))
        return self._emit(final=False)

    def feed_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.feed(t) for t in token_ids)

    def flush(self) -> str:
        """End of stream: return held-back text (an incomplete character decodes as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        if self._read >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) and not final:
            return ""
        if new_text.endswith(_REPLACEMENT) and not final:
            return ""
        delta = new_text[len(prefix_text) :]
        # keep the tokens just emitted as context for the next window; drop older ones
        del self._ids[: self._read]
        self._prefix = 0
        self._read = len(self._ids)
        self.text += delta
        return delta


Detokenizer = ByteLevelDetokenizer | IncrementalDetokenizer
