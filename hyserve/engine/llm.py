"""`LLM`: the offline API. All prompts of one `generate` call run concurrently through the engine loop.

llm = LLM()                                  # built-in tiny model
outs = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))

with LLM(model_dir, tp_size=2) as llm:       # one model over 2 ranks of this host (GPUs, or CPU gloo)
    ...                                      # leaving the block stops the other ranks
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from hyserve.config import build_engine_config
from hyserve.engine.gc_tuning import serving_gc
from hyserve.engine.lifecycle.startup import start_engine
from hyserve.engine.outputs import RequestOutput, TokenLogprob
from hyserve.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        load_format: str = "auto",
        log: Any = None,
        **options: Any,
    ) -> None:
        """`options` take the server YAML's names: max_batch_size, max_num_tokens, max_seq_len,
        enable_chunked_prefill, scheduling_policy, kv_cache_config={...}, cuda_graph_config={...}, seed,
        tp_size, ep_size, ...
        With tp_size > 1 this process is rank 0 and starts the other ranks itself (`close()` stops them)."""
        self.config = build_engine_config(
            options, model=model, dtype=dtype, device=device, load_format=load_format
        )
        self.engine = start_engine(self.config, log=log)
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # noqa: ANN201 - Tokenizer | None
        return self.engine.tokenizer

    def _encode(self, prompt: Prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise ValueError(
                    "this model directory has no tokenizer (load_format='dummy' on a config-only model): "
                    "pass prompts as lists of token ids"
                )
            # the tokenizer's post-processor adds BOS where the checkpoint wants one
            return self.engine.tokenizer.encode(prompt, add_special_tokens=True), prompt
        return [int(t) for t in prompt], None

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; returns one RequestOutput per prompt, in order. Any invalid
        prompt raises (RequestRejected / ValueError) before anything runs. `priority` (vLLM's): one per
        prompt, lower first, with scheduling_policy="priority" (under "fcfs" only zeros are accepted)."""
        plist: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            plist = [prompts]  # type: ignore[list-item]  # one prompt (text or token ids)
        else:
            plist = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        plist_params = [params] * len(plist) if isinstance(params, SamplingParams) else list(params)
        if len(plist_params) != len(plist):
            raise ValueError(f"got {len(plist)} prompts but {len(plist_params)} SamplingParams")
        priorities = [0] * len(plist) if priority is None else list(priority)
        if len(priorities) != len(plist):
            raise ValueError(f"got {len(plist)} prompts but {len(priorities)} priorities")
        encoded = [self._encode(p) for p in plist]
        for (ids, _), sp, prio in zip(encoded, plist_params, priorities):
            self.engine.validate_request(ids, sp, prio)
        eng = self.engine
        order: list[str] = []
        texts: dict[str, list[str]] = {}
        tokens: dict[str, list[int]] = {}
        lps: dict[str, list[TokenLogprob]] = {}
        final: dict[str, Any] = {}
        t0 = time.monotonic()
        first_token: dict[str, float] = {}
        plps: dict[str, list[TokenLogprob | None]] = {}
        finished_at: dict[str, float] = {}
        for (ids, text), sp, prio in zip(encoded, plist_params, priorities):
            rid = f"llm-{next(self._ids)}"
            eng.add_request(rid, ids, sp, prompt=text, priority=prio)
            order.append(rid)
            texts[rid], tokens[rid], lps[rid] = [], [], []
        pending = set(order)
        with serving_gc():  # the collector's serving thresholds while the steps run (engine/gc_tuning.py)
            while pending:
                for d in eng.step():
                    if d.request_id not in pending:
                        continue
                    texts[d.request_id].append(d.text)
                    tokens[d.request_id].extend(d.token_ids)
                    if d.logprobs:
                        lps[d.request_id].extend(d.logprobs)
                    if d.prompt_logprobs is not None:
                        plps[d.request_id] = d.prompt_logprobs
                    if d.token_ids and d.request_id not in first_token:
                        first_token[d.request_id] = time.monotonic()
                    if d.finished:
                        finished_at[d.request_id] = time.monotonic()
                        final[d.request_id] = d
                        pending.discard(d.request_id)
        outs = []
        for rid, (ids, text), sp in zip(order, encoded, plist_params):
            d = final[rid]
            if d.finish_reason == "error":
                raise RuntimeError(d.error or "request failed")
            outs.append(
                RequestOutput(
                    request_id=rid,
                    prompt=text,
                    prompt_token_ids=ids,
                    token_ids=tokens[rid],
                    text="".join(texts[rid]),
                    finish_reason=d.finish_reason,
                    logprobs=lps[rid] if sp.logprobs is not None else None,
                    num_cached_tokens=d.num_cached_tokens,
                    stop_reason=d.stop_reason,
                    prompt_logprobs=plps.get(rid),
                    metrics={
                        "time_to_first_token_s": first_token.get(rid, finished_at[rid]) - t0,
                        "e2e_latency_s": finished_at[rid] - t0,
                    },
                )
            )
        return outs

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine and leave its process group (nothing for one
        rank). The engine cannot run steps afterwards."""
        self.engine.drain()
        self.engine.runner.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def cache_usage(self) -> dict[str, int]:
        return self.engine.cache_usage()

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()

    def stats(self) -> dict[str, float]:
        return self.engine.stats()
