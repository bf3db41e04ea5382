"""From sampled tokens to what a caller sees: incremental detokenizing, stop tokens / EOS / stop strings
(held back while they might still match), max_tokens and max_seq_len, logprob and prompt-logprob
assembly, and the `StreamDelta` of each request that progressed."""

from __future__ import annotations

from dataclasses import dataclass

from hyserve.engine.outputs import StreamDelta, TokenLogprob
from hyserve.engine.request import Request
from hyserve.engine.runner.runner import ModelRunner
from hyserve.engine.sampling_params import SamplingParams
from hyserve.engine.scheduler.scheduler import ScheduledBatch
from hyserve.model.detokenizer import Detokenizer
from hyserve.model.tokenizer import Tokenizer


@dataclass
class _OutputState:
    """Per-request text state: incremental detokenizer and the stop-string hold-back."""

    detok: Detokenizer | None
    text: str = ""  # all text so far (stop strings trimmed at finish)
    emitted: int = 0  # characters of `text` already handed out
    tokens_emitted: int = 0
    logprobs_emitted: int = 0
    prompt_logprobs_emitted: bool = False


@dataclass(frozen=True)
class Finish:
    reason: str  # "stop" | "length"
    stop_reason: int | str | None = None


class OutputProcessor:
    def __init__(
        self, *, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...], max_seq_len: int
    ) -> None:
        self.tokenizer = tokenizer
        if tokenizer is not None:
            tokenizer.stream_bytes  # noqa: B018 - the byte table is built now, not on the first request
        self.eos = tokenizer.eos_token_ids if tokenizer is not None else eos_token_ids
        self.max_seq_len = max_seq_len
        self._states: dict[str, _OutputState] = {}

    def add(self, req: Request) -> None:
        p = req.params
        detok = (
            self.tokenizer.incremental_detokenizer(
                prompt_ids=req.prompt_token_ids, skip_special_tokens=p.skip_special_tokens
            )
            if self.tokenizer is not None
            else None
        )
        self._states[req.request_id] = _OutputState(detok=detok)
        if p.prompt_logprobs is not None:
            req.prompt_logprobs = [None]  # the first prompt token has no context to be predicted from

    def append_token(
        self, req: Request, tok: int, lp: TokenLogprob | None, *, grammar_done: bool = False
    ) -> Finish | None:
        """Record one output token; returns why the request finishes with it, or None. `grammar_done`: the
        request's structured-outputs grammar ended with this (stop) token, which then stops the request
        whatever `ignore_eos` says (nothing after it could satisfy the grammar)."""
        p = req.params
        st = self._states[req.request_id]
        req.output_token_ids.append(tok)
        if lp is not None:
            req.output_logprobs.append(lp)
        finish: Finish | None = None
        if grammar_done or tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos):
            finish = Finish("stop", tok)
        else:
            if st.detok is not None:
                st.text += st.detok.feed(tok)
            hit = self._find_stop(st.text, st.emitted, p)
            if hit is not None:
                idx, s = hit
                st.text = st.text[: idx + (len(s) if p.include_stop_str_in_output else 0)]
                finish = Finish("stop", s)
        if finish is None and (
            len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_seq_len
        ):
            finish = Finish("length")
        if finish is not None and not isinstance(finish.stop_reason, str) and st.detok is not None:
            st.text += st.detok.flush()  # a held-back partial character
        return finish

    @staticmethod
    def _find_stop(text: str, emitted: int, p: SamplingParams) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in p.stop:
            i = text.find(s, max(0, emitted - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def delta(self, req: Request, *, finished: bool) -> StreamDelta:
        """What the request produced since its last delta; a finished request's state is dropped."""
        st = self._states[req.request_id]
        p = req.params
        if finished:
            upto = len(st.text)
        else:
            # hold back a possible stop-string prefix so it never reaches the client
            hold = max((len(s) - 1 for s in p.stop), default=0)
            upto = max(st.emitted, len(st.text) - hold)
        text = st.text[st.emitted : upto]
        st.emitted = upto
        toks = req.output_token_ids[st.tokens_emitted :]
        st.tokens_emitted = len(req.output_token_ids)
        lps = None
        if p.logprobs is not None:
            lps = req.output_logprobs[st.logprobs_emitted :]
            st.logprobs_emitted = len(req.output_logprobs)
        plps = None
        if (
            p.prompt_logprobs is not None
            and not st.prompt_logprobs_emitted
            and len(req.prompt_logprobs) == req.num_prompt_tokens
        ):
            plps = list(req.prompt_logprobs)
            st.prompt_logprobs_emitted = True
        if finished:
            self._states.pop(req.request_id, None)
        return StreamDelta(
            request_id=req.request_id,
            token_ids=toks,
            text=text,
            logprobs=lps,
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_output_tokens=len(req.output_token_ids),
            stop_reason=req.stop_reason if finished else None,
            error=req.error if finished else None,
            prompt_logprobs=plps,
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
        )

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)


def record_prompt_logprobs(runner: ModelRunner, batch: ScheduledBatch, requests: dict[str, Request]) -> None:
    """For each prefill chunk of the step just run that wants prompt logprobs: the logprob of every prompt
    token its positions predict (position p predicts token p + 1), skipping those already recorded (a chunk
    recomputed after a preemption)."""
    for row, seq in enumerate(batch.seqs):
        if row < batch.num_decodes or seq.params.prompt_logprobs is None:
            continue
        req = requests.get(seq.request_id)
        if req is None:
            continue
        rec = req.prompt_logprobs
        first = max(len(rec), seq.start_pos + 1)  # first prompt position to fill
        last = min(seq.start_pos + len(seq.token_ids), req.num_prompt_tokens - 1)  # inclusive
        if last < first:
            continue
        targets = req.prompt_token_ids[first : last + 1]
        rec.extend(
            runner.prompt_logprobs(row, first - 1 - seq.start_pos, targets, seq.params.prompt_logprobs)
        )
