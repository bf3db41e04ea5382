"""Structured outputs: constrained decoding with xgrammar grammars (JSON schema, any JSON object, regex,
a choice of strings, an EBNF grammar), as vLLM, SGLang and TensorRT-LLM serve them.

The pieces, and who calls them (docs/architecture.md, "Structured outputs"):

    GrammarCompiler   one per tokenizer (`compiler_for`): the vocabulary's bytes for xgrammar, and compiled
                      grammars cached by their spec. The server compiles a request's grammar on a worker
                      thread before admitting it (a spec that cannot compile is a 400 naming the problem);
                      the engine then finds it in the cache.
    GrammarState      one per request (each of n choices its own): xgrammar's matcher, plus the thinking
                      section it waits out (`start_after`, e.g. "</think>", when a reasoning parser is on).
    StructuredOutputs the engine's table of states by request id:
                        add(request_id, params)        when a request enters
                        fill_bitmask(request_ids)      before a step is sampled: [rows, ceil(V / 32)] int32 on
                                                       the host (bit t of row r: token t allowed), or None
                                                       when no row is constrained now
                        accept(request_id, token)      when a sampled token reaches the host
                        remove(request_id)             when the request ends
    apply_token_bitmask  the sampler's masked fill on the logits' device (the `apply_token_bitmask` op).

A constrained row's matcher must have seen its previous token before its next bitmask is filled: with
async scheduling, the engine reads the in-flight step first when a constrained row is in the next one
(`StructuredOutputs.constrains`).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from hyserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from hyserve.kernels import ops
from hyserve.kernels.token_bitmask import bitmask_width

_CACHE_ENTRIES = 512
# threads that fill a step's bitmask rows (the work runs while the GPU computes the step's forward)
_FILL_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))
# xgrammar 0.2's JSON-string character classes admit UTF-8 encodings of surrogates (not Unicode: decoders
# turn them into U+FFFD) and, in strings with a length bound, raw control characters (refused by strict JSON
# parsers): both are replaced by the class of what JSON allows unescaped, kept negated (an explicit class of
# ranges measured 12x slower to fill a mask over a 131k vocabulary)
_LOOSE_STRING_CHARS = (r"[^\0-\x1f\"\\\r\n]", r"[^\"\\\r\n]")
_STRICT_STRING_CHAR = r"[^\0-\x1f\"\\\ud800-\udfff]"
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] [^ ]+\.cc:[0-9]+: ")  # "[21:25:21] /project/cpp/x.cc:94: "


class GrammarError(ValueError):
    """A structured-outputs spec that cannot compile; the message names the problem."""


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise GrammarError(
            "structured outputs need the xgrammar package: install it with  pip install 'hyserve[server]'"
        ) from None
    return xgrammar


def _clean(e: Exception) -> str:
    lines = [_XGR_PREFIX.sub("", ln).strip() for ln in str(e).strip().splitlines()]
    return "; ".join(ln for ln in lines if ln) or type(e).__name__


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [n, V] float, bitmask [n, ceil(V / 32)] int32 on the same device (bit t % 32 of word t // 32
    set: token t allowed) -> a new tensor with the disallowed logits at -inf. Rows of all ones are unchanged.
    The `apply_token_bitmask` op: one Triton kernel on CUDA (kernels/triton_token_bitmask.py)."""
    return ops.apply_token_bitmask.get(logits.is_cuda)(logits, bitmask)


@dataclass(frozen=True)
class _Key:
    kind: str
    spec: str


def _spec_key(so: StructuredOutputsParams) -> _Key:
    if so.json is not None:
        return _Key("json", str(so.json))
    if so.json_object:
        return _Key("json_object", "")
    if so.regex is not None:
        return _Key("regex", so.regex)
    if so.choice is not None:
        return _Key("choice", json.dumps(list(so.choice)))
    assert so.grammar is not None
    return _Key("grammar", so.grammar)


class GrammarCompiler:
    """xgrammar's compiler over one tokenizer's vocabulary, with compiled grammars cached by spec."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, max_threads: int = 8) -> None:
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        n = min(int(tokenizer.vocab_size), vocab_size)
        # special tokens as b"": xgrammar treats empty tokens as special and never allows them inside a
        # grammar (their text, e.g. "<|im_end|>", is not output text); the stop tokens end a complete one
        encoded = [b"" if tokenizer.is_special(i) else tokenizer.token_bytes(i) for i in range(n)]
        self.stop_token_ids = [int(t) for t in tokenizer.eos_token_ids if int(t) < vocab_size]
        info = xgr.TokenizerInfo(
            encoded, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids or None
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=True)
        self._token_bytes = tokenizer.token_bytes
        self._cache: OrderedDict[_Key, Any] = OrderedDict()
        self._lock = threading.Lock()

    def token_bytes(self, token_id: int) -> bytes:
        try:
            return bytes(self._token_bytes(token_id))
        except Exception:
            return b""

    def compile(self, so: StructuredOutputsParams) -> Any:
        """The compiled grammar of `so` (cached). Raises GrammarError naming the problem."""
        key = _spec_key(so)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            compiled = self._compile(key)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with the parser's message
            raise GrammarError(f"the {key.kind} constraint cannot be compiled: {_clean(e)}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, key: _Key) -> Any:
        c = self._compiler
        if key.kind in ("json", "json_object"):
            spec = key.spec if key.kind == "json" else '{"type": "object"}'  # an object, not any JSON value
            try:
                json.loads(spec)
            except ValueError as e:
                raise GrammarError(f"the json schema is not valid JSON: {e}") from None
            ebnf = str(_xgrammar().Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True))
            for loose in _LOOSE_STRING_CHARS:
                ebnf = ebnf.replace(loose, _STRICT_STRING_CHAR)
            return c.compile_grammar(ebnf)
        if key.kind == "regex":
            return c.compile_regex(key.spec)
        if key.kind == "choice":
            choices = json.loads(key.spec)
            alts = " | ".join(json.dumps(ch) for ch in choices)  # EBNF string literals use JSON escapes
            return c.compile_grammar(f"root ::= {alts}")
        return c.compile_grammar(key.spec)


_COMPILERS: dict[int, tuple[Any, GrammarCompiler]] = {}
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int) -> GrammarCompiler:
    """The one GrammarCompiler of `tokenizer` (the server and the engine share the tokenizer object, so they
    share the compiled-grammar cache). Building it reads the whole vocabulary once."""
    with _COMPILERS_LOCK:
        hit = _COMPILERS.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer and hit[1].vocab_size == vocab_size:
            return hit[1]
        comp = GrammarCompiler(tokenizer, vocab_size)
        _COMPILERS[id(tokenizer)] = (tokenizer, comp)
        return comp


class GrammarState:
    """One request's matcher. Until `start_after` has appeared in the output (the end of the thinking
    section) it only watches the tokens' bytes; from then on the grammar constrains every token."""

    def __init__(self, compiler: GrammarCompiler, so: StructuredOutputsParams) -> None:
        xgr = _xgrammar()
        self._compiler = compiler
        self.matcher = xgr.GrammarMatcher(
            compiler.compile(so), override_stop_tokens=compiler.stop_token_ids or None
        )
        self._wait = so.start_after.encode("utf-8") if so.start_after else None
        self._seen = b""  # output bytes while waiting (only the tail that may still hold the marker)
        self.failed = False  # a token the grammar refused reached the host (cannot happen under the mask)
        self.num_accepted = 0

    @property
    def active(self) -> bool:
        """The next token is constrained."""
        return self._wait is None and not self.failed and not self.matcher.is_terminated()

    @property
    def done(self) -> bool:
        """The grammar is complete and has taken its stop token."""
        return not self.failed and self.matcher.is_terminated()

    def accept(self, token_id: int) -> None:
        if self.failed or self.matcher.is_terminated():
            return
        if self._wait is not None:
            buf = self._seen + self._compiler.token_bytes(token_id)
            k = buf.find(self._wait)
            if k < 0:
                self._seen = buf[-(len(self._wait) - 1) :] if len(self._wait) > 1 else b""
                return
            rest = buf[k + len(self._wait) :]
            self._wait, self._seen = None, b""
            # whitespace right after the marker is the template's framing, not output the grammar sees
            rest = rest.lstrip()
            if rest and not self.matcher.accept_string(rest.decode("utf-8", errors="replace")):
                self.failed = True
            return
        if self.matcher.accept_token(int(token_id)):
            self.num_accepted += 1
        else:
            self.failed = True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (a row dropped after it was accepted)."""
        n = min(num_tokens, self.num_accepted)
        if n:
            self.matcher.rollback(n)
            self.num_accepted -= n

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_after(self, bitmask: torch.Tensor, row: int, draft: list[int]) -> None:
        """Fill `row` with the mask of the position after `draft` (a speculative step's draft tokens), then
        undo them: the matcher and the thinking-section watch end as they began. A draft token the grammar
        refuses leaves the row all ones: the row before it cannot sample that token, so this row's sample
        is never used."""
        saved = (self._wait, self._seen, self.failed, self.num_accepted)
        try:
            for t in draft:
                self.accept(t)
                if self.failed:
                    return
            if self.active:
                self.fill(bitmask, row)
        finally:
            taken = self.num_accepted - saved[3]
            if taken:
                self.matcher.rollback(taken)
            self._wait, self._seen, self.failed, self.num_accepted = saved


class StructuredOutputs:
    """The engine's grammar states, by request id (see the module docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._states: dict[str, GrammarState] = {}
        self._compiler: GrammarCompiler | None = None
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher, made at the first batch of constrained rows

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            if self._tokenizer is None:
                raise GrammarError("structured outputs need the model's tokenizer (this model has none)")
            self._compiler = compiler_for(self._tokenizer, self.vocab_size)
        return self._compiler

    def validate(self, params: SamplingParams) -> None:
        """Compile (or find) the request's grammar; GrammarError if it cannot be."""
        if params.structured_outputs is not None:
            self.compiler.compile(params.structured_outputs)

    def add(self, request_id: str, params: SamplingParams) -> None:
        if params.structured_outputs is not None:
            self._states[request_id] = GrammarState(self.compiler, params.structured_outputs)

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def constrains(self, request_ids: list[str]) -> bool:
        """Whether any of these requests has a grammar (its previous token must be on the host before its
        next bitmask: even a state still waiting out the thinking section may start with that token)."""
        return bool(self._states) and any(r in self._states for r in request_ids)

    def accept(self, request_id: str, token_id: int) -> None:
        st = self._states.get(request_id)
        if st is not None:
            st.accept(token_id)

    def done(self, request_id: str) -> bool:
        """Whether the request's grammar has ended (its matcher took a stop token): the request must stop
        there, `ignore_eos` or not, since no further token is constrained."""
        st = self._states.get(request_id)
        return st is not None and st.done

    def fill_bitmask(
        self, request_ids: list[str], drafts: list[list[int]] | None = None
    ) -> torch.Tensor | None:
        """[len(request_ids), ceil(V / 32)] int32 host tensor for the rows about to be sampled (all ones for
        unconstrained rows), or None when no row is constrained now. `drafts[i]`: the draft tokens row i
        follows (a speculative step's later positions), taken into its grammar for its mask and undone."""
        if not self._states:
            return None
        drafted = drafts or [[]] * len(request_ids)
        states = [(i, d, self._states.get(r)) for i, (r, d) in enumerate(zip(request_ids, drafted))]
        later = [(i, d, st) for i, d, st in states if d and st is not None]
        rows = [(i, st) for i, d, st in states if not d and st is not None and st.active]
        if not later and not rows:
            return None
        mask = torch.full((len(request_ids), bitmask_width(self.vocab_size)), -1, dtype=torch.int32)
        for i, d, st in later:
            st.fill_after(mask, i, d)
        if not rows:
            return mask
        if len(rows) == 1:
            rows[0][1].fill(mask, rows[0][0])
        else:  # xgrammar fills the rows on its own threads, without the GIL
            if self._batch is None:
                self._batch = _xgrammar().BatchGrammarMatcher(max_threads=_FILL_THREADS)
            self._batch.batch_fill_next_token_bitmask(
                [st.matcher for _, st in rows], mask, indices=[i for i, _ in rows]
            )
        return mask


__all__ = [
    "GrammarCompiler",
    "GrammarError",
    "GrammarState",
    "StructuredOutputs",
    "apply_token_bitmask",
    "bitmask_width",
    "compiler_for",
]
