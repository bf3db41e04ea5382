"""Packing and chunking invariances of the NemotronH model over the paged-KV / state-slot layout.

- a packed step of several sequences (decodes and prefills/extends mixed) = each sequence run alone;
- prefill split into chunks (state carried through the pools) = prefill in one pass;
- decode steps after a prefill = the logits of one full forward pass;
- a SnapshotWrite at a chunk boundary, resumed from its slot (src_override) = continuing without it;
- pools poisoned with NaN where nothing may be read, and checked unchanged where nothing may be written.

The stock harness (tests/model_harness.py) drives single-sequence schedules. `Driver` below is a variant for
packed steps: it returns logits in the caller's item order (the stock harness reorders decodes first and
returns them in that internal order), scatters each sequence's KV over randomly chosen non-contiguous blocks
and gives it a random state slot, and can start from NaN-poisoned pools.
"""

from __future__ import annotations

import pytest
import torch

from hyserve.model.cache_tensors import CacheTensors
from hyserve.model.forward_meta import ForwardMeta, SnapshotWrite
from hyserve.model.nemotron_h.config import HybridModelConfig
from hyserve.model.nemotron_h.model import NemotronHForCausalLM
from hyserve.model.tiny import tiny_config
from tests.model_harness import Harness, strong_random_weights

torch.set_num_threads(1)

ATOL = 2e-5  # float32; logits are O(1)-O(10), and packing only changes summation order


def build_model(variant: str) -> NemotronHForCausalLM:
    cfg = HybridModelConfig.from_dict(tiny_config(variant), name=f"tiny-{variant}")
    assert cfg.chunk_size == 8
    model = NemotronHForCausalLM(cfg, dtype=torch.float32)
    strong_random_weights(model, cfg, seed=5)
    return model.eval()


@pytest.fixture(scope="module")
def dense() -> NemotronHForCausalLM:
    return build_model("dense")  # 7 layers: 3 Mamba, 2 attention, 2 MLP


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request, dense) -> NemotronHForCausalLM:
    return dense if request.param == "dense" else build_model("moe")


def tokens(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def full_logits(model: NemotronHForCausalLM, toks: list[int]) -> torch.Tensor:
    """One pass over the whole sequence, alone, in a fresh harness: [len, V]."""
    return Harness(model, max_seqs=1, max_len=128).step([(0, toks)], all_logits=True)


def mamba_state(cache: CacheTensors, slot: int) -> dict[str, torch.Tensor]:
    out = {}
    for i, t in cache.conv.items():
        out[f"conv{i}"] = t[slot].clone()
    for i, t in cache.ssm.items():
        out[f"ssm{i}"] = t[slot].clone()
    return out


def assert_states_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 2e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-5, msg=k)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class Driver:
    """Packed steps over scattered blocks and slots; results in the caller's order."""

    def __init__(
        self,
        model: NemotronHForCausalLM,
        *,
        num_blocks: int = 128,
        bs: int = 4,
        num_slots: int = 24,
        seed: int = 0,
        poison_kv: bool = False,
        poison_state: bool = False,
    ) -> None:
        self.model = model
        self.bs = bs
        self.cache = CacheTensors.allocate(
            model.config.cache_layout(),
            num_blocks=num_blocks,
            tokens_per_block=bs,
            num_slots=num_slots,
            device="cpu",
        )
        for flag, pools in (
            (poison_kv, (self.cache.k, self.cache.v)),
            (poison_state, (self.cache.conv, self.cache.ssm)),
        ):
            if flag:
                for d in pools:
                    for t in d.values():
                        t.fill_(float("nan"))
        g = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(num_blocks, generator=g).tolist()
        self.free_slots = torch.randperm(num_slots, generator=g).tolist()
        self.blocks: dict[int, list[int]] = {}
        self.slot: dict[int, int] = {}
        self.lens: dict[int, int] = {}

    def take_slot(self) -> int:
        return self.free_slots.pop()

    def step(
        self,
        items: list[tuple[int, list[int]]],
        *,
        snapshots: list[tuple[int, int, int]] = (),
        src_override: dict[int, int] | None = None,
    ) -> list[torch.Tensor]:
        """items: [(sid, new tokens)]; snapshots: [(sid, num_tokens, slot)]. Returns each item's logits for
        all its new tokens ([n_i, V]), in the order of `items`."""
        src_override = src_override or {}
        is_dec = [len(t) == 1 and self.lens.get(sid, 0) > 0 for sid, t in items]
        order = [i for i in range(len(items)) if is_dec[i]] + [i for i in range(len(items)) if not is_dec[i]]
        nd = sum(is_dec)
        ids, cu, sm, seq_lens, src, dst, has_init = [], [0], [], [], [], [], []
        for i in order:
            sid, toks = items[i]
            if sid not in self.slot:
                self.slot[sid] = self.take_slot()
                self.blocks[sid] = []
            start = self.lens.get(sid, 0)
            end = start + len(toks)
            while len(self.blocks[sid]) * self.bs < end:
                self.blocks[sid].append(self.free_blocks.pop())
            ids += toks
            cu.append(len(ids))
            sm += [self.blocks[sid][p // self.bs] * self.bs + p % self.bs for p in range(start, end)]
            seq_lens.append(end)
            src.append(src_override.get(sid, self.slot[sid]))
            dst.append(self.slot[sid])
            has_init.append(start > 0 or sid in src_override)
            self.lens[sid] = end
        width = max(len(self.blocks[items[i][0]]) for i in order)
        tables = torch.zeros(len(items), width, dtype=torch.int32)
        for s, i in enumerate(order):
            b = self.blocks[items[i][0]]
            tables[s, : len(b)] = torch.tensor(b, dtype=torch.int32)
        pos = {items[i][0]: s for s, i in enumerate(order)}
        meta = ForwardMeta(
            num_decodes=nd,
            cu_seqlens=cu,
            seq_lens=seq_lens,
            cu_seqlens_t=torch.tensor(cu, dtype=torch.int32),
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables,
            slot_mapping=torch.tensor(sm, dtype=torch.int64),
            state_src=torch.tensor(src, dtype=torch.int64),
            state_dst=torch.tensor(dst, dtype=torch.int64),
            has_initial_state=torch.tensor(has_init, dtype=torch.bool),
            logits_indices=torch.arange(len(ids), dtype=torch.int64),
            snapshots=[SnapshotWrite(seq=pos[sid], num_tokens=n, slot=slot) for sid, n, slot in snapshots],
        )
        h = self.model(torch.tensor(ids, dtype=torch.long), meta, self.cache)
        logits = self.model.compute_logits(h[meta.logits_indices])
        out: list[torch.Tensor] = [torch.empty(0)] * len(items)
        for s, i in enumerate(order):
            out[i] = logits[cu[s] : cu[s + 1]]
        return out


# ---- packed batch = each sequence alone ---------------------------------------------------------------
def test_packed_steps_equal_each_sequence_alone(model):
    """Five sequences over four packed steps mixing fresh prefills, extends (chunked prefill continuing from
    the pools), 1-token prompts and decodes; every token's logits = those of the sequence run alone."""
    seqs = {0: tokens(16, 0), 1: tokens(5, 1), 2: tokens(21, 2), 3: tokens(14, 3), 4: tokens(18, 4)}
    schedule = [  # (sid, start, end) per step; items deliberately not in decode-first order
        [(0, 0, 13), (1, 0, 1), (2, 0, 9)],
        [(2, 9, 20), (0, 13, 14), (3, 0, 8), (1, 1, 2)],
        [(3, 8, 13), (1, 2, 3), (4, 0, 17), (0, 14, 15), (2, 20, 21)],
        [(1, 3, 4), (4, 17, 18), (0, 15, 16), (3, 13, 14)],
        [(1, 4, 5)],
    ]
    alone = {sid: full_logits(model, t) for sid, t in seqs.items()}
    drv = Driver(model, seed=1)
    for step in schedule:
        outs = drv.step([(sid, seqs[sid][a:b]) for sid, a, b in step])
        for (sid, a, b), got in zip(step, outs):
            assert got.shape == (b - a, model.config.vocab_size)
            diff = (got - alone[sid][a:b]).abs().max().item()
            assert diff <= ATOL, f"seq {sid} tokens {a}:{b}: packed differs from alone by {diff}"


def test_stock_harness_packed_step_with_decode_first_order(dense):
    """The stock harness, items given decodes-first (the order it returns logits in)."""
    a, b = tokens(11, 10), tokens(9, 11)
    h = Harness(dense, max_seqs=4, max_len=64)
    h.step([(0, a[:10])])
    out = h.step([(0, a[10:11]), (1, b)], all_logits=True)  # decode of seq 0 + prefill of seq 1
    torch.testing.assert_close(out[0], full_logits(dense, a)[10], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1:], full_logits(dense, b), atol=ATOL, rtol=0)


# ---- chunked prefill = one pass --------------------------------------------------------------------------
SPLITS = [[21], [5, 11, 5], [8, 8, 5], [3, 1, 17], [7, 14], [1, 20], [16, 5], [1, 1, 1, 18], [20, 1]]


@pytest.mark.parametrize("split", SPLITS, ids=["-".join(map(str, s)) for s in SPLITS])
def test_chunked_prefill_equals_one_pass(dense, split):
    toks = tokens(sum(split), 20)
    one = Harness(dense, max_seqs=1, max_len=64)
    ref = one.step([(0, toks)], all_logits=True)
    h = Harness(dense, max_seqs=1, max_len=64)
    pos = 0
    for n in split:
        got = h.step([(0, toks[pos : pos + n])], all_logits=True)
        diff = (got - ref[pos : pos + n]).abs().max().item()
        assert diff <= ATOL, f"chunk {pos}:{pos + n} differs from one pass by {diff}"
        pos += n
    # the state carried through the pools ends up the same, and so does the KV
    assert_states_close(mamba_state(h.cache, 0), mamba_state(one.cache, 0))
    for i in h.cache.k:
        torch.testing.assert_close(h.cache.k[i], one.cache.k[i], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h.cache.v[i], one.cache.v[i], atol=1e-5, rtol=1e-5)


# ---- decode after prefill = full forward ---------------------------------------------------------------
@pytest.mark.parametrize("prompt_len", [1, 9, 16])
def test_decode_after_prefill_equals_full_forward(dense, prompt_len):
    toks = tokens(prompt_len + 12, 30 + prompt_len)
    ref = full_logits(dense, toks)
    h = Harness(dense, max_seqs=1, max_len=64)
    last = h.step([(0, toks[:prompt_len])])[0]
    torch.testing.assert_close(last, ref[prompt_len - 1], atol=ATOL, rtol=0)
    for p in range(prompt_len, len(toks)):
        last = h.step([(0, [toks[p]])])[0]
        diff = (last - ref[p]).abs().max().item()
        assert diff <= ATOL, f"decode at position {p} differs from the full forward by {diff}"


# ---- snapshots ----------------------------------------------------------------------------------------
SNAP_A, SNAP_B, SNAP_END = 8, 9, 10  # extra state slots of the stock harness (max_seqs=8)


@pytest.fixture(scope="module")
def snapshot_run(dense):
    """Seq 0 prefills 21 tokens in one step, snapshotting after 8 and 16 (chunk boundaries) and at the end."""
    toks = tokens(21, 40)
    h = Harness(dense, max_seqs=8, max_len=64)
    logits = h.step(
        [(0, toks)], all_logits=True,
        snapshots=[SnapshotWrite(0, 8, SNAP_A), SnapshotWrite(0, 16, SNAP_B), SnapshotWrite(0, 21, SNAP_END)],
    )  # fmt: skip
    return h, toks, logits


def test_snapshot_states_equal_states_of_shorter_prefills(dense, snapshot_run):
    h, toks, logits = snapshot_run
    torch.testing.assert_close(
        logits, full_logits(dense, toks), atol=ATOL, rtol=0
    )  # snapshots change nothing
    for n, slot in ((8, SNAP_A), (16, SNAP_B), (21, SNAP_END)):
        ref = Harness(dense, max_seqs=1, max_len=64)
        ref.step([(0, toks[:n])])
        assert_states_close(mamba_state(h.cache, slot), mamba_state(ref.cache, 0))
    assert_states_close(mamba_state(h.cache, SNAP_END), mamba_state(h.cache, 0), atol=0)


@pytest.mark.parametrize("prefix,slot", [(8, SNAP_A), (16, SNAP_B)])
def test_resume_from_snapshot_equals_continuing_without_it(dense, snapshot_run, prefix, slot):
    """A new sequence shares seq 0's first `prefix` tokens (KV blocks copied, as a prefix-cache hit would
    give) and starts its Mamba layers from the snapshot slot; a different continuation then gives the same
    logits as running prefix + continuation in one pass, and so do the decode steps after it."""
    h, toks, _ = snapshot_run
    sid = 3
    cont = tokens(9, 41 + prefix)
    nb = prefix // h.bs
    for d in (h.cache.k, h.cache.v):
        for t in d.values():
            t[sid * h.bps : sid * h.bps + nb] = t[:nb]
    h.lens[sid] = prefix
    got = h.step([(sid, cont[:7])], all_logits=True, src_override={sid: slot})
    ref = full_logits(dense, toks[:prefix] + cont)
    diff = (got - ref[prefix : prefix + 7]).abs().max().item()
    assert diff <= ATOL, f"resumed from the snapshot after {prefix} tokens: logits differ by {diff}"
    for j in (7, 8):  # decode continues from the resumed sequence's own slot
        last = h.step([(sid, [cont[j]])])[0]
        torch.testing.assert_close(last, ref[prefix + j], atol=ATOL, rtol=0)
    del h.lens[sid]


def test_snapshot_in_packed_step_behind_a_decode(dense):
    """The snapshotting sequence sits behind a decode in the step, and continues from cached tokens."""
    a, b, c = tokens(12, 50), tokens(5 + 13, 51), tokens(17, 52)
    drv = Driver(dense, seed=3)
    drv.step([(0, a[:11]), (1, b[:5])])
    s_b, s_c = drv.take_slot(), drv.take_slot()
    outs = drv.step(
        [(2, c), (0, a[11:12]), (1, b[5:])],  # c: fresh 17 tokens; b: 5 cached + 13 new
        snapshots=[(2, 16, s_c), (1, 8, s_b)],
    )
    torch.testing.assert_close(outs[1], full_logits(dense, a)[11:12], atol=ATOL, rtol=0)
    for toks, n, slot in ((c, 16, s_c), (b, 5 + 8, s_b)):
        ref = Harness(dense, max_seqs=1, max_len=64)
        ref.step([(0, toks[:n])])
        assert_states_close(mamba_state(drv.cache, slot), mamba_state(ref.cache, 0))


def test_snapshots_of_every_kind_in_one_step(dense):
    """One step's snapshots at a chunk boundary, at a sequence's end, and at the end of a chunk shorter than
    the conv window (its window reaches into the initial conv state), over three prefill sequences: each
    equals the state of a shorter prefill (a layer writes them all from one plan of the step)."""
    a, b, c = tokens(12, 53), tokens(6 + 2, 54), tokens(17, 55)
    drv = Driver(dense, seed=5)
    drv.step([(0, a[:11]), (1, b[:6])])
    slots = [drv.take_slot() for _ in range(5)]
    drv.step(
        [(2, c), (0, a[11:12]), (1, b[6:]), (3, a[:1])],  # b: 6 cached + 2 new; 3: a one-token prompt
        snapshots=[(2, 8, slots[0]), (1, 2, slots[1]), (2, 16, slots[2]), (2, 17, slots[3]),
                   (3, 1, slots[4])],
    )  # fmt: skip
    for toks, n, slot in ((c, 8, slots[0]), (b, 8, slots[1]), (c, 16, slots[2]), (c, 17, slots[3]),
                          (a, 1, slots[4])):  # fmt: skip
        ref = Harness(dense, max_seqs=1, max_len=64)
        ref.step([(0, toks[:n])])
        assert_states_close(mamba_state(drv.cache, slot), mamba_state(ref.cache, 0))


def test_snapshot_off_chunk_boundary_is_rejected(dense):
    h = Harness(dense, max_seqs=2, max_len=64)
    with pytest.raises(ValueError, match="chunk"):
        h.step([(0, tokens(21, 60))], snapshots=[SnapshotWrite(0, 5, SNAP_A)])


# ---- poisoned pools -------------------------------------------------------------------------------------
def test_nan_kv_pool_is_never_read_and_foreign_blocks_never_written(dense):
    """Every KV row starts NaN: attention may only read rows its own sequence wrote, and a step writes
    nothing outside its sequences' blocks nor any other sequence's state slot."""
    seqs = {0: tokens(13, 70), 1: tokens(6, 71), 2: tokens(10, 72)}
    drv = Driver(dense, seed=4, poison_kv=True)
    out = drv.step([(0, seqs[0][:12]), (1, seqs[1][:5])])
    for sid, n in ((0, 12), (1, 5)):
        assert torch.isfinite(out[sid]).all()
        torch.testing.assert_close(out[sid], full_logits(dense, seqs[sid])[:n], atol=ATOL, rtol=0)
    kv_before = {i: (drv.cache.k[i].clone(), drv.cache.v[i].clone()) for i in drv.cache.k}
    state_before = mamba_state(drv.cache, drv.slot[1])
    out = drv.step([(0, seqs[0][12:13]), (2, seqs[2])])  # seq 1 sits this step out
    torch.testing.assert_close(out[0], full_logits(dense, seqs[0])[12:13], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], full_logits(dense, seqs[2]), atol=ATOL, rtol=0)
    bs = drv.bs
    written = {drv.blocks[0][p // bs] * bs + p % bs for p in [12]}
    written |= {drv.blocks[2][p // bs] * bs + p % bs for p in range(10)}
    for i, (k0, v0) in kv_before.items():
        k1, v1 = drv.cache.k[i].flatten(0, 1), drv.cache.v[i].flatten(0, 1)
        for row in range(k1.shape[0]):
            if row not in written:
                assert same_bits(k1[row], k0.flatten(0, 1)[row]) and same_bits(v1[row], v0.flatten(0, 1)[row])
    for k, v in mamba_state(drv.cache, drv.slot[1]).items():
        assert same_bits(v, state_before[k]), f"{k} of a sequence outside the step was written"


def test_fresh_sequence_ignores_its_src_slot_contents(dense):
    """has_initial_state=False means "start from zeros (src is ignored)" (ForwardMeta). A freshly allocated
    slot may hold anything (a finished request's state, or uninitialised memory): poisoned with NaN here,
    the outputs must still be finite and equal to a clean run."""
    seqs = {0: tokens(13, 80), 1: tokens(1, 81)}
    drv = Driver(dense, seed=5, poison_state=True)
    out = drv.step([(0, seqs[0]), (1, seqs[1])])
    for sid in (0, 1):
        assert torch.isfinite(out[sid]).all(), (
            f"seq {sid}: NaN from an ignored state slot leaked into the output"
        )
        torch.testing.assert_close(out[sid], full_logits(dense, seqs[sid]), atol=ATOL, rtol=0)


def test_new_a_log_values_reach_the_scan() -> None:
    """The mixer caches A = -exp(A_log); loading new weights (an in-place copy) must invalidate it."""
    model = build_model("dense")
    toks = tokens(20, seed=11)
    before = full_logits(model, toks)
    mixers = [blk.mixer for blk in model.backbone.layers if blk.kind == "mamba"]
    assert all(m._A_cache is not None for m in mixers)
    with torch.no_grad():
        for m in mixers:
            m.A_log.copy_(m.A_log * 0.5 - 1.0)
    after = full_logits(model, toks)
    fresh = build_model("dense")
    with torch.no_grad():
        fresh.load_state_dict(model.state_dict())
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, full_logits(fresh, toks), rtol=0, atol=0)


def test_a_model_built_under_inference_mode_still_runs() -> None:
    with torch.inference_mode():
        model = build_model("dense")
        assert next(model.parameters()).is_inference()
    torch.testing.assert_close(
        full_logits(model, tokens(9, seed=2)),
        full_logits(build_model("dense"), tokens(9, seed=2)),
        rtol=0,
        atol=0,
    )
