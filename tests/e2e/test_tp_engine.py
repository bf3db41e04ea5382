"""The engine over two ranks (rank 0 here, rank 1 a worker process, gloo): `LLM(tp_size=2)` gives the greedy
tokens of tp_size 1 and its chosen-token logprobs within 1e-4, on the tiny dense, MoE and latent-MoE configs
(MoE also with ep_size 2), through chunked prefill, preemption, prefix-cache hits, prompt logprobs, seeded
sampling, the warm-up and the decode-graph path; bad layouts fail before any rank starts; a rank that dies
fails the next step at once (docs/architecture.md, "Parallelism").

A process is a rank of one engine at a time: the tests that build their own engines come first, then the
module's shared tp-2 dense engine, whose last test kills its worker."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hyserve import LLM, SamplingParams
from hyserve.distributed import parallel_info
from hyserve.engine.parallel import launch
from hyserve.engine.parallel.parallel_runner import DriverRunner, RankLost
from hyserve.engine.runner.runner import ModelRunner
from hyserve.engine.speculative.mtp import MTPDrafter
from hyserve.model.nemotron_h.checkpoint import NAMES, NAMES_MTP
from hyserve.model.nemotron_h.config import HybridModelConfig
from hyserve.model.nemotron_h.model import NemotronHForCausalLM
from hyserve.model.weights import save_checkpoint
from tests.model_harness import strong_random_weights

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TIMEOUT_S = 20.0  # every collective of these tests (both ranks); a hang fails in seconds, not at CI's limit

# small pools and budgets, the same at tp 1 and tp 2: prompts longer than max_num_tokens prefill in chunks,
# 24 KV blocks of 8 tokens cannot hold the batch below at once (preemption), snapshots every 16 tokens
OPTIONS = dict(
    device="cpu",
    max_batch_size=4,
    max_num_tokens=32,
    max_seq_len=128,
    seed=7,
    kv_cache_config={
        "max_tokens": 192,
        "tokens_per_block": 8,
        "mamba_state_config": {"periodic_snapshot_interval": 16},
    },
)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True)


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 70) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [[1, *torch.randint(3, 250, (k,), generator=g).tolist()] for k in lens]


def _checkpoint(root: Path, variant: str, seed: int = 5, mtp: bool = False) -> str:
    """tests/configs/<variant> with O(1)-logit random weights (a 1e-4 bound on near-uniform logits proves
    little), saved as a checkpoint every rank loads its shard from; mtp: with an MTP block (attention, then
    the variant's MoE), as Nemotron 3 ships it."""
    d = root / (variant + ("-mtp" if mtp else ""))
    d.mkdir()
    raw = json.loads((CONFIGS / variant / "config.json").read_text())
    if mtp:
        raw.update(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E")
    (d / "config.json").write_text(json.dumps(raw))
    cfg = HybridModelConfig.from_hf(d).with_mtp(mtp)
    model = NemotronHForCausalLM(cfg, dtype=torch.float32)
    strong_random_weights(model, cfg, seed=seed)
    save_checkpoint(model, d, names=NAMES_MTP if mtp else NAMES)
    return str(d)


@pytest.fixture(scope="module", autouse=True)
def _short_timeouts() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HYSERVE_DIST_TIMEOUT_S", str(TIMEOUT_S))  # the worker processes read it
        mp.setattr(launch.envs, "HYSERVE_DIST_TIMEOUT_S", TIMEOUT_S)  # this process read it at import
        yield


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-ckpts")
    return {
        v: _checkpoint(root, v)
        for v in ("tiny-nemotron-h-dense", "tiny-nemotron-3-moe", "tiny-nemotron-3-latent-moe")
    }


def _same(a: list, b: list, what: str) -> None:
    """Greedy tokens identical, chosen-token logprobs within 1e-4 (float32, tp 2 against tp 1)."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.token_ids == y.token_ids, f"{what}: prompt {i}: tp2 {y.token_ids} != tp1 {x.token_ids}"
        if x.logprobs is not None:
            err = max(abs(u.logprob - v.logprob) for u, v in zip(x.logprobs, y.logprobs))
            assert err <= 1e-4, f"{what}: prompt {i}: max |logprob tp2 - tp1| = {err:.2e}"


def _run_all(llm: LLM) -> dict[str, list]:
    """The scenarios, in order, on one engine."""
    out: dict[str, list] = {}
    out["batch"] = llm.generate(_prompts(8, seed=1), GREEDY)  # chunked prefill + preemption
    shared = _prompts(1, seed=2, lo=50, hi=51)[0]
    llm.generate([shared], GREEDY)
    out["prefix"] = llm.generate([shared + [9, 8, 7], shared + [5]], GREEDY)  # prefix-cache hits
    plp = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    out["prompt_logprobs"] = llm.generate(_prompts(2, seed=3, lo=40, hi=60), plp)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    out["seeded"] = llm.generate(_prompts(3, seed=4), seeded)
    # the decode-graph and piecewise-graph paths (static buffers, run eagerly on the CPU), told to every rank
    llm.engine.runner.capture_graphs(
        [1, 2, 3, 4], max_blocks_per_seq=16, pad_slot=0, enable_padding=False, mixed_sizes=[16, 64, 256]
    )
    out["graphs"] = llm.generate(_prompts(4, seed=5), GREEDY)
    out["stats"] = [llm.stats()]
    return out


@pytest.mark.parametrize(
    ("variant", "ep"),
    [
        ("tiny-nemotron-3-moe", 1),
        ("tiny-nemotron-3-moe", 2),
        ("tiny-nemotron-3-latent-moe", 1),
        ("tiny-nemotron-3-latent-moe", 2),
    ],
)
def test_moe_tp2_matches_tp1(ckpts: dict[str, str], variant: str, ep: int) -> None:
    prompts = _prompts(6, seed=6)
    ref = LLM(ckpts[variant], **OPTIONS).generate(prompts, GREEDY)
    with LLM(ckpts[variant], tp_size=2, ep_size=ep, **OPTIONS) as llm:
        assert parallel_info().ep_size == ep
        got = llm.generate(prompts, GREEDY)
        assert llm.stats()["num_preemptions"] > 0
    _same(ref, got, f"{variant} tp 2 ep {ep}")
    assert parallel_info().world_size == 1  # close() left the group: the next engine can form its own


def test_speculative_tp2_matches_tp1(ckpts: dict[str, str]) -> None:
    """Drafts verified over two ranks: each rank chains its Mamba heads' states through the scratch slots and
    takes the accepted position's state (rank 0 tells the others), so tp 2 with speculation gives tp 1's
    plain greedy tokens, with drafts accepted, through chunked prefill."""
    from tests.engine.test_speculative import OracleDrafter

    prompts = _prompts(6, seed=12)
    ref = LLM(ckpts["tiny-nemotron-3-moe"], **OPTIONS).generate(prompts, GREEDY)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with LLM(ckpts["tiny-nemotron-3-moe"], tp_size=2, speculative_config=spec, **OPTIONS) as llm:
        assert llm.engine.spec is not None
        llm.engine.spec.drafter = OracleDrafter({tuple(p): o.token_ids for p, o in zip(prompts, ref)})
        got = llm.generate(prompts, GREEDY)
        s = llm.stats()
    _same(ref, got, "speculative, tp 2")
    assert s["spec_decode_num_accepted_tokens"] > 0


def _mtp_drafts(llm: LLM, prompts: list[list[int]]) -> tuple[list, list[tuple[int, list[int]]]]:
    """Greedy outputs, and every draft the MTP drafter kept (context length, tokens), in order."""
    assert llm.engine.spec is not None and isinstance(llm.engine.spec.drafter, MTPDrafter)
    drafter = llm.engine.spec.drafter
    seen: list[tuple[int, list[int]]] = []
    after = drafter.after_step

    def record(*args: object) -> None:
        before = dict(drafter._drafts)
        after(*args)  # type: ignore[arg-type]
        seen.extend(v for k, v in sorted(drafter._drafts.items()) if before.get(k) != v)

    drafter.after_step = record  # type: ignore[method-assign]
    return llm.generate(prompts, GREEDY), seen


def test_mtp_tp2_drafts_as_tp1(tmp_path: Path) -> None:
    """MTP drafting over two ranks: rank 0 plans each step's MTP passes and the worker runs the same passes
    on its shard (the block's attention and MoE are collectives), so tp 2 drafts tp 1's tokens and gives
    plain decoding's greedy tokens, through chunked prefill and preemption. Above 2 running requests a step
    drafts nothing and its catch-up pass follows it at once, the samples broadcast to the worker."""
    ckpt = _checkpoint(tmp_path, "tiny-nemotron-3-moe", mtp=True)
    prompts = _prompts(6, seed=13)
    spec = {"method": "mtp", "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    ref = LLM(ckpt, **OPTIONS).generate(prompts, GREEDY)
    with LLM(ckpt, speculative_config=spec, **OPTIONS) as llm:
        one, drafts_one = _mtp_drafts(llm, prompts)
    with LLM(ckpt, tp_size=2, speculative_config=spec, **OPTIONS) as llm:
        two, drafts_two = _mtp_drafts(llm, prompts)
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["spec_decode_num_drafts"] > 0
        assert stats["overlapped_steps_total"] > 0
    _same(ref, one, "MTP, tp 1")
    _same(ref, two, "MTP, tp 2")
    assert len(drafts_one) >= 10 and drafts_two == drafts_one


def _kv_scales(llm: LLM) -> dict[int, tuple[float, float]]:
    model = llm.engine.loaded.model
    return {
        i: (float(model.backbone.layers[i].mixer.k_scale), float(model.backbone.layers[i].mixer.v_scale))
        for i in model.config.attention_layer_ids
    }


def test_fp8_kv_calibration_tp2_matches_tp1(ckpts: dict[str, str]) -> None:
    """Calibrated fp8 KV scales over two ranks (each holds one of the two KV heads): rank 0's scales are
    tp 1's (the max over both ranks' heads, not its own head's), and the greedy output is tp 1's."""
    opts = {**OPTIONS, "kv_cache_config": {**OPTIONS["kv_cache_config"], "dtype": "fp8"}}
    prompts = _prompts(4, seed=8)
    tp1 = LLM(ckpts["tiny-nemotron-h-dense"], **opts)
    ref, scales = tp1.generate(prompts, GREEDY), _kv_scales(tp1)
    with LLM(ckpts["tiny-nemotron-h-dense"], tp_size=2, **opts) as llm:
        # equal up to float32 rounding: the sharded k_proj / v_proj GEMMs round differently
        got_scales = _kv_scales(llm)
        assert got_scales.keys() == scales.keys() and all(s != 1.0 for pair in scales.values() for s in pair)
        for i, pair in scales.items():
            assert got_scales[i] == pytest.approx(pair, rel=1e-6), (i, got_scales[i], pair)
        got = llm.generate(prompts, GREEDY)
    _same(ref, got, "fp8 KV calibrated, tp 2")


def test_one_rank_has_no_group_and_the_plain_runner(ckpts: dict[str, str]) -> None:
    llm = LLM(ckpts["tiny-nemotron-h-dense"], **OPTIONS)
    assert type(llm.engine.runner) is ModelRunner and parallel_info().world_size == 1
    assert not launch.spans_ranks(llm.config)


@pytest.mark.parametrize(
    ("opts", "needles"),
    [
        (
            {"tp_size": 3},
            [
                "does not split over tp_size 3",
                "num_attention_heads (4) is not divisible by tp_size (3)",
                "mamba_num_heads (8) is not divisible by tp_size (3)",
            ],
        ),
        ({"tp_size": 2, "ep_size": 4}, ["ep_size (4) must divide tp_size (2)"]),
    ],
)
def test_bad_layouts_fail_before_any_rank_starts(
    ckpts: dict[str, str], opts: dict, needles: list[str]
) -> None:
    t0 = time.monotonic()
    with pytest.raises(ValueError) as e:
        LLM(ckpts["tiny-nemotron-h-dense"], **{**OPTIONS, **opts})
    for n in needles:
        assert n in str(e.value), str(e.value)
    assert time.monotonic() - t0 < 5.0 and parallel_info().world_size == 1


def test_fewer_gpus_than_ranks_is_refused(ckpts: dict[str, str]) -> None:
    from hyserve.config import build_engine_config

    cfg = build_engine_config({"tp_size": 2}, model=ckpts["tiny-nemotron-h-dense"])
    gpus = torch.cuda.device_count()
    if gpus >= 2:
        pytest.skip("this machine has the GPUs")
    with pytest.raises(ValueError, match=f"2 ranks on this host need 2 visible GPUs, but {gpus} are visible"):
        launch.check_layout(cfg, world_size=2, local_world_size=2, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL, one per rank)")
@pytest.mark.parametrize(("variant", "ep"), [("tiny-nemotron-h-dense", 1), ("tiny-nemotron-3-latent-moe", 2)])
def test_two_gpus_match_one(
    ckpts: dict[str, str], capfd: pytest.CaptureFixture[str], variant: str, ep: int
) -> None:
    """NCCL with one GPU per rank, float32: the warm-up on both ranks (0 compilations after ready on either),
    decode graphs captured on both (dense), every step broadcast; tokens equal tp 1 on one GPU."""
    opts = dict(
        device="cuda",
        dtype="float32",
        warmup="on",
        max_batch_size=8,
        max_num_tokens=128,
        max_seq_len=256,
        kv_cache_config={"max_gpu_total_bytes": 256 * 2**20, "tokens_per_block": 16},
    )
    prompts = _prompts(8, seed=12, hi=200)
    ref_llm = LLM(ckpts[variant], **opts)
    ref = ref_llm.generate(prompts, GREEDY)
    del ref_llm
    with LLM(ckpts[variant], tp_size=2, ep_size=ep, **opts) as llm:
        assert parallel_info().backend == "nccl"
        assert (llm.engine.runner.graphs is not None) == (variant == "tiny-nemotron-h-dense")
        got = llm.generate(prompts, GREEDY)
        assert llm.stats()["jit_compiles_after_ready"] == 0
    _same(ref, got, f"{variant} on two GPUs")
    assert "compilations after ready" not in capfd.readouterr().err  # rank 1 reports its own at shutdown


@pytest.fixture(scope="module")
def dense(ckpts: dict[str, str]) -> Iterator[tuple[LLM, dict[str, list]]]:
    ref = _run_all(LLM(ckpts["tiny-nemotron-h-dense"], **OPTIONS))
    llm = LLM(ckpts["tiny-nemotron-h-dense"], tp_size=2, warmup="on", **OPTIONS)
    try:
        yield llm, ref
    finally:
        llm.close()


def test_dense_tp2_matches_tp1_through_every_kind_of_step(dense: tuple[LLM, dict[str, list]]) -> None:
    llm, ref = dense
    assert isinstance(llm.engine.runner, DriverRunner) and parallel_info().tp_size == 2
    assert llm.engine.warmup_report is not None and not llm.engine.warmup_report.failed
    got = _run_all(llm)
    for what in ("batch", "prefix", "seeded", "graphs"):
        _same(ref[what], got[what], what)
    stats = got["stats"][0]
    assert stats["num_preemptions"] > 0 and stats["step_failures_total"] == 0
    assert stats["overlapped_steps_total"] > 0  # decode rows fed from the device samples: broadcast to rank 1
    assert all(o.num_cached_tokens >= 48 for o in got["prefix"]), [o.num_cached_tokens for o in got["prefix"]]
    for a, b in zip(ref["prompt_logprobs"], got["prompt_logprobs"]):
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for u, v in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert u is not None and v is not None and u.token_id == v.token_id
            assert abs(u.logprob - v.logprob) <= 1e-4 and u.top.keys() == v.top.keys()
    with pytest.raises(RuntimeError, match="already rank 0 of an engine over 2 ranks"):
        LLM(llm.config.model, **OPTIONS)  # its layers would take this engine's shards


def test_a_dead_rank_fails_the_next_step_at_once(dense: tuple[LLM, dict[str, list]]) -> None:
    """Last in the module: it ends the shared engine."""
    llm, _ = dense
    runner = llm.engine.runner
    assert isinstance(runner, DriverRunner) and runner.health() is None
    proc = runner_procs(llm)[0]
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    assert runner.health() is not None and "exited with status -9" in str(runner.health())
    with pytest.raises(RankLost, match="lost contact with the other ranks"):
        llm.generate(_prompts(2, seed=8), GREEDY)
    assert time.monotonic() - t0 < 10.0  # the broken connection, not the 20 s collective timeout
    with pytest.raises(RankLost):  # and every step after it
        llm.generate(_prompts(1, seed=9), GREEDY)
    llm.close()
    assert (
        parallel_info().world_size == 1
    )  # the broken group is left too: this process can build another engine


def runner_procs(llm: LLM) -> list:
    """The worker processes rank 0 started for `llm` (through the launcher's clean-up hook)."""
    runner = llm.engine.runner
    assert isinstance(runner, DriverRunner)
    owner = runner.lost_rank.__self__  # type: ignore[attr-defined]  # launch.Ranks.lost
    assert isinstance(owner, launch.Ranks)
    return owner.procs
