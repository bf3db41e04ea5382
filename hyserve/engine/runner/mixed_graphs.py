"""Prefill and mixed steps replayed from piecewise CUDA graphs, one set per padded token count.

A step that prefills cannot replay a decode graph: its sequences' lengths size the scan and attention
grids. Run eagerly, its host launches a thousand kernels one by one, which costs more than the device work
of a few prompts beside a large decode batch. But only the mixer cores read the step's sequences
(`ForwardMeta.run_core`): embeddings, norms, projections, MoE and the residual stream depend on the token
count alone. So for each token count Tp the forward is captured in pieces cut at its cores:

    piece 0 (graph) | core 0 (eager) | piece 1 (graph) | core 1 (eager) | ... | last piece (graph)

A step of T <= Tp tokens copies its ids into the first T rows of a static buffer, replays piece 0, runs
core 0 with the step's own `ForwardMeta` on the first T rows of its inputs, copies its result into the
first T rows of the core's output buffer, replays piece 1, and so on; the last piece leaves the final
hidden states. Rows T..Tp-1 are padding: whatever they held flows through the pieces, whose every
operation treats rows independently, and nothing reads them.

Buffers (allocated once, by the first warm-up forward at the largest size, outside the graphs' pool):
- each core's inputs are copied, as the last operations of the piece before it, into input buffers shared
  by every core (one per input position, dtype and row shape): a core reads them before the next piece
  runs;
- each core's output goes into an output buffer per (dtype, row shape), shared too: a mixer reads its
  core's output (its output projection) before the next core runs, as every mixer here does (Falcon-H1's
  Mamba2 mixer finishes before its attention core runs).

The graphs share the decode graphs' memory pool (a step replays one size at a time), largest first. On the
CPU (`capture=False`) a step runs the same padded forward through the same buffers eagerly, which is what
the tests exercise without a GPU.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hyserve.engine.runner.cuda_graphs import capture_cost
from hyserve.model.cache_tensors import CacheTensors
from hyserve.model.forward_meta import CoreFn, ForwardMeta
from hyserve.model.protocol import CausalLM

# the largest token count captured by default: a step of more tokens is bound by its device work (30B-A3B FP8,
# 512 decodes and 8,000 prompt tokens: 141 ms on an H100's device, 115 ms of eager launches), so it runs
# eagerly, and the static buffers (a few hundred MiB at 8,192 rows) do not grow with max_num_tokens
DEFAULT_MAX_TOKENS = 8192


def default_token_sizes(max_num_tokens: int) -> list[int]:
    """64, 128, every multiple of 256 up to 2,048, of 512 up to 4,096, of 1,024 up to 8,192, and
    max_num_tokens itself when smaller: padding adds fewer than 256 rows up to 2,048 tokens and at most a
    quarter of a step's rows above 1,024."""
    top = min(max_num_tokens, DEFAULT_MAX_TOKENS)
    sizes = [64, 128, *range(256, 2049, 256), *range(2560, 4097, 512), *range(5120, 8193, 1024)]
    return sorted({s for s in sizes if s < top} | {top})


@dataclass(frozen=True)
class _Core:
    fn: CoreFn
    inputs: tuple[torch.Tensor, ...]  # [Tp, ...] views of the input buffers
    out: torch.Tensor  # [Tp, ...] view of an output buffer

    def run(self, meta: ForwardMeta, cache: CacheTensors, tokens: int) -> None:
        result = self.fn(meta, cache, *(t[:tokens] for t in self.inputs))
        self.out[:tokens].copy_(result)


class _Buffers:
    """The cores' input and output buffers, [rows, ...] each, by role (module docstring)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.rows = rows
        self.device = device
        self._bufs: dict[tuple[Any, ...], torch.Tensor] = {}
        self.frozen = False  # set once the first forward allocated them: capturing must not allocate

    def get(self, key: tuple[Any, ...], like: torch.Tensor) -> torch.Tensor:
        full = (*key, like.dtype, tuple(like.shape[1:]))
        buf = self._bufs.get(full)
        if buf is None:
            if self.frozen:
                raise RuntimeError(f"piecewise graphs: a core buffer {full} appeared after the first forward")
            buf = torch.zeros(self.rows, *like.shape[1:], dtype=like.dtype, device=self.device)
            self._bufs[full] = buf
        return buf

    @torch.inference_mode()
    def clear_outputs(self) -> None:
        """Zero the output buffers: rows a capture left behind are never read as padding."""
        for key, buf in self._bufs.items():
            if key[0] == "out":
                buf.zero_()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


class _Pieces:
    """The `CoreCalls` of one padded forward: copies each core's inputs into the buffers, runs the core on
    the first `tokens` rows and puts its result in an output buffer; while capturing, also ends the graph
    before each core and begins the next after it, collecting the plan."""

    def __init__(self, bufs: _Buffers, rows: int, tokens: int, pool: Any = None, capture: bool = False):
        self.bufs, self.rows, self.tokens = bufs, rows, tokens
        self.pool, self.capture = pool, capture
        self.plan: list[torch.cuda.CUDAGraph | _Core] = []
        self._graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        if self.capture:
            self._graph = torch.cuda.CUDAGraph()
            self._graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        if self.capture:
            assert self._graph is not None
            with warnings.catch_warnings():  # two cores in a row leave an empty piece between them
                warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
                self._graph.capture_end()
            self.plan.append(self._graph)
            self._graph = None

    def __call__(
        self, fn: CoreFn, meta: ForwardMeta, cache: CacheTensors, inputs: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        rows = self.rows
        ins = tuple(self.bufs.get(("in", i), t)[:rows].copy_(t) for i, t in enumerate(inputs))
        self.end()
        result = fn(meta, cache, *(t[: self.tokens] for t in ins))
        out = self.bufs.get(("out",), result)[:rows]
        out[: self.tokens].copy_(result)
        self.plan.append(_Core(fn, ins, out))
        self.begin()
        return out


class MixedGraphs:
    """Piecewise graphs of prefill and mixed steps for each padded token count in `sizes`."""

    def __init__(
        self,
        model: CausalLM,
        cache: CacheTensors,
        device: torch.device,
        *,
        sizes: Sequence[int],
        pad_slot: int,
        capture: bool = True,
        pool: Any = None,
    ) -> None:
        if not sizes:
            raise ValueError("piecewise CUDA graphs: no token counts to capture")
        self.model = model
        self.cache = cache
        self.device = device
        self.sizes = sorted(set(sizes))
        self.pad_slot = pad_slot
        rmax = self.sizes[-1]
        self._ids = torch.zeros(rmax, dtype=torch.long, device=device)
        self._bufs = _Buffers(rmax, device)
        # every size's final hidden states, copied by its last piece (outside the pool, so a size's own
        # output does not hold pool memory)
        self._hidden: torch.Tensor | None = None
        self._plans: dict[int, list[torch.cuda.CUDAGraph | _Core]] = {}
        self.capture_seconds = 0.0
        self.graph_bytes = 0
        self.num_pieces = 0
        self.captured = capture
        # the first forward, at the largest size, allocates every core buffer
        self._forward(rmax, self._capture_meta(rmax), rmax)
        self._bufs.frozen = True
        if capture:
            self._capture_all(pool)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the static buffers outside the pool (the cores' inputs and outputs, ids, hidden)."""
        extra = [t for t in (self._ids, self._hidden) if t is not None]
        return self._bufs.nbytes + sum(t.numel() * t.element_size() for t in extra)

    def size_for(self, tokens: int) -> int | None:
        """The captured token count a step of `tokens` runs in, or None (run it eagerly)."""
        for s in self.sizes:
            if s >= tokens:
                return s
        return None

    # ---- capture ----------------------------------------------------------------------------------
    def _capture_meta(self, n: int) -> ForwardMeta:
        """One fresh sequence of n tokens that writes no KV and only the pad state slot: what the cores of a
        warm-up or capture forward run on (their results are discarded). Its block table points every
        position at block 0 (zero-initialised, or a real block: finite either way). One sequence, not n
        decode rows: n decode rows would each read and write a whole state per Mamba layer."""
        dev = self.device
        i32, i64 = torch.int32, torch.int64
        blocks = -(-n // self.cache.tokens_per_block)
        return ForwardMeta(
            num_decodes=0,
            cu_seqlens=[0, n],
            seq_lens=[n],
            cu_seqlens_t=torch.tensor([0, n], dtype=i32, device=dev),
            seq_lens_t=torch.tensor([n], dtype=i32, device=dev),
            block_tables=torch.zeros(1, blocks, dtype=i32, device=dev),
            slot_mapping=torch.full((n,), -1, dtype=i64, device=dev),
            state_src=torch.full((1,), self.pad_slot, dtype=i64, device=dev),
            state_dst=torch.full((1,), self.pad_slot, dtype=i64, device=dev),
            has_initial_state=torch.zeros(1, dtype=torch.bool, device=dev),
            logits_indices=torch.tensor([n - 1], dtype=i64, device=dev),
        )

    @torch.inference_mode()
    def _forward(
        self, rows: int, meta: ForwardMeta, tokens: int, pieces: _Pieces | None = None
    ) -> torch.Tensor:
        """The padded forward of `rows` rows, its cores on the first `tokens`, eagerly unless `pieces`
        captures; returns the final hidden states [rows, hidden]."""
        pieces = pieces or _Pieces(self._bufs, rows, tokens)
        hidden = self.model(self._ids[:rows], dataclasses.replace(meta, cores=pieces), self.cache)
        if self._hidden is None:
            self._hidden = hidden.new_empty(self._bufs.rows, hidden.shape[-1])
        return self._hidden[:rows].copy_(hidden)

    def _capture_all(self, pool: Any) -> None:
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with capture_cost(self.device) as cost, torch.cuda.stream(side):
            for n in reversed(self.sizes):  # most rows first: the smaller sizes reuse its pool memory
                meta = self._capture_meta(n)
                # this size's kernel variants and lazy state off the graphs, on the capture stream (the
                # largest size ran once already, on the default stream, to allocate the buffers; cuBLAS
                # keeps a workspace per stream)
                self._forward(n, meta, n)
                pieces = _Pieces(self._bufs, n, n, pool=pool, capture=True)
                try:
                    pieces.begin()
                    self._forward(n, meta, n, pieces)
                    pieces.end()
                except RuntimeError as err:
                    raise RuntimeError(
                        f"piecewise CUDA graphs: capturing a step of {n} tokens failed ({err}); start with "
                        "cuda_graph_config.piecewise: false (vLLM's --compilation-config "
                        '\'{"cudagraph_mode": "FULL_DECODE_ONLY"}\') to run prefill and mixed steps eagerly'
                    ) from err
                self._plans[n] = pieces.plan
                self.num_pieces += sum(isinstance(p, torch.cuda.CUDAGraph) for p in pieces.plan)
            current.wait_stream(side)
        self._bufs.clear_outputs()
        self.capture_seconds, self.graph_bytes = cost.seconds, cost.bytes

    # ---- replay -----------------------------------------------------------------------------------
    def execute(self, input_ids: torch.Tensor, meta: ForwardMeta) -> torch.Tensor | None:
        """The final hidden states [T, hidden] of a step of T = len(input_ids) tokens, or None when no size
        holds it. They are the graphs' memory: valid until the next step runs."""
        T = input_ids.shape[0]
        n = self.size_for(T)
        if n is None:
            return None
        self._ids[:T].copy_(input_ids)
        if not self.captured:
            return self._forward(n, meta, T)[:T]
        with torch.inference_mode():
            for part in self._plans[n]:
                if isinstance(part, _Core):
                    part.run(meta, self.cache, T)
                else:
                    part.replay()
        assert self._hidden is not None
        return self._hidden[:T]
