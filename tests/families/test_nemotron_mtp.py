"""NemotronH's multi-token-prediction block (model/nemotron_h/mtp.py): the config keys that describe it, the
checkpoint `hyserve make-tiny --mtp` writes in NVIDIA's layout (`mtp.layers.{j}.*`, per-expert tensors), its
loading (all tensors taken when the block is built, ignored when not), its KV layer in the cache layout, and
its forward against a float64 reference written from the block's equations: a pass over a prompt, then a
chained one-token pass that reads the first pass's KV."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from hyserve.engine.runner.runner import ModelRunner
from hyserve.engine.sampling_params import SamplingParams
from hyserve.engine.scheduler.scheduler import ScheduledBatch, ScheduledSeq
from hyserve.model.nemotron_h.config import HybridModelConfig
from hyserve.model.nemotron_h.model import NemotronHForCausalLM
from hyserve.model.tiny import make_tiny
from hyserve.model.weights import load_checkpoint

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=["dense", "moe"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("mtp") / request.param, variant=request.param, mtp=True)


def _model(d: Path, mtp: bool, dtype: torch.dtype = torch.float64) -> NemotronHForCausalLM:
    cfg = HybridModelConfig.from_hf(d).with_mtp(mtp)
    model = NemotronHForCausalLM(cfg, dtype=dtype)
    load_checkpoint(model, d, names=model.checkpoint_names)
    return model


def test_checkpoint_layout_and_config(ckpt: Path) -> None:
    raw = json.loads((ckpt / "config.json").read_text())
    assert raw["num_nextn_predict_layers"] == 1 and raw["mtp_hybrid_override_pattern"] in ("*-", "*E")
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        names = {k for k in f.keys() if k.startswith("mtp.")}
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight"} <= names
    assert (
        "mtp.layers.1.final_layernorm.weight" in names and "mtp.layers.0.final_layernorm.weight" not in names
    )
    if raw["mtp_hybrid_override_pattern"] == "*E":
        assert "mtp.layers.1.mixer.experts.0.up_proj.weight" in names  # per-expert, as the Hub ships them
    cfg = HybridModelConfig.from_hf(ckpt)
    assert cfg.mtp_layer_ids == () and cfg.with_mtp().mtp_layer_ids == (cfg.num_layers, cfg.num_layers + 1)
    assert cfg.with_mtp().kv_layer_ids == (*cfg.attention_layer_ids, cfg.num_layers)
    assert cfg.with_mtp().kv_bytes_per_token > cfg.kv_bytes_per_token


def test_loads_with_the_block_and_ignores_it_without(ckpt: Path) -> None:
    with_mtp, without = _model(ckpt, True), _model(ckpt, False)
    assert without.mtp is None and with_mtp.mtp is not None
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        eh = f.get_tensor("mtp.layers.0.eh_proj.weight")
    assert torch.equal(with_mtp.mtp.layers[0].eh_proj.weight.float(), eh.float())
    # the backbone is the same either way
    a, b = dict(with_mtp.backbone.named_parameters()), dict(without.backbone.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"num_nextn_predict_layers": 2, "mtp_hybrid_override_pattern": "*E"}, "runs one MTP layer"),
        ({"num_nextn_predict_layers": 1}, "the MTP block's layers are not given"),
        ({"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "M*"}, "Mamba layers ('M')"),
        ({"num_nextn_predict_layers": 1, "mtp_layers_block_type": ["attention", "bogus"]}, "expected a list"),
    ],
)
def test_bad_mtp_configs_name_the_key(ckpt: Path, raw: dict, needle: str) -> None:
    base = {k: v for k, v in json.loads((ckpt / "config.json").read_text()).items() if "mtp" not in k}
    base.pop("num_nextn_predict_layers", None)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        HybridModelConfig.from_dict({**base, **raw})


def test_a_checkpoint_without_the_block_refuses_it(tmp_path: Path) -> None:
    d = make_tiny(tmp_path / "plain")
    with pytest.raises(ValueError, match="has no multi-token-prediction layer"):
        HybridModelConfig.from_hf(d).with_mtp()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference(model: NemotronHForCausalLM, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The block's equations in float64 over a whole sequence (causal attention over every position)."""
    cfg = model.config
    eps = cfg.layer_norm_epsilon
    mtp = model.mtp
    assert mtp is not None
    first, second = mtp.layers[0], mtp.layers[1]
    emb = model.backbone.embeddings.weight[next_ids]
    x = torch.cat([_rms(emb, first.enorm.weight, eps), _rms(hidden, first.hnorm.weight, eps)], -1)
    x = x @ first.eh_proj.weight.T
    # attention (NoPE), GQA, causal
    a = first.mixer
    y = _rms(x, first.norm.weight, eps)
    T, d = y.shape[0], cfg.head_dim
    q = (y @ a.q_proj.weight.T).view(T, -1, d).transpose(0, 1)
    k = (y @ a.k_proj.weight.T).view(T, -1, d).transpose(0, 1)
    v = (y @ a.v_proj.weight.T).view(T, -1, d).transpose(0, 1)
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    att = (q @ k.transpose(1, 2)) * a.scale
    att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    o = (att @ v).transpose(0, 1).reshape(T, -1) @ a.o_proj.weight.T
    r = o + x
    y = _rms(r, second.norm.weight, eps)
    if cfg.mtp_layer_types[1] == "moe":
        m = second.mixer(y, None, None)  # the MoE layer's own reference path (tested against its refs)
    else:
        m = F.relu(y @ second.mixer.up_proj.weight.T).pow(2) @ second.mixer.down_proj.weight.T
    return _rms(m + r, second.final_layernorm.weight, eps)


def test_forward_matches_the_reference(ckpt: Path) -> None:
    model = _model(ckpt, True)
    cfg = model.config
    g = torch.Generator().manual_seed(3)
    T = 13
    next_ids = torch.randint(3, cfg.vocab_size, (T + 1,), generator=g)
    hidden = torch.randn(T + 1, cfg.hidden_size, generator=g, dtype=torch.float64)
    cache = model.allocate_cache(num_blocks=8, tokens_per_block=8, num_slots=2, device="cpu")
    runner = ModelRunner(model, cache, torch.device("cpu"))

    def step(start: int, n: int, decode: bool) -> torch.Tensor:
        seq = ScheduledSeq(
            request_id="r", token_ids=next_ids[start : start + n].tolist(), start_pos=start,
            block_ids=[0, 1], state_src=None if start == 0 else 0, state_dst=0, sample=True, snapshots=[],
            params=SamplingParams(), num_output_tokens=0,
        )  # fmt: skip
        ids, meta = runner.build_meta(ScheduledBatch(seqs=[seq], num_decodes=int(decode)))
        return model.mtp_forward(ids, hidden[start : start + n], meta, cache)

    got = torch.cat([step(0, T, False), step(T, 1, True)])  # the prompt's pass, then one chained position
    want = _reference(model, next_ids, hidden)
    assert (got - want).abs().max().item() < 1e-9


def _reference_drafts(model: NemotronHForCausalLM, context: list[int], k: int) -> list[int]:
    """Drafts recomputed from scratch: one target prefill over the context, one MTP pass over every position
    but the last (each with the token after it), then k - 1 chained passes."""
    cache = model.allocate_cache(num_blocks=64, tokens_per_block=8, num_slots=2, device="cpu")
    runner = ModelRunner(model, cache, torch.device("cpu"))
    blocks = list(range(64))

    def run(ids: list[int], start: int, decode: bool) -> tuple[torch.Tensor, object]:
        seq = ScheduledSeq(
            request_id="r", token_ids=ids, start_pos=start, block_ids=blocks, state_src=None, state_dst=0,
            sample=True, snapshots=[], params=SamplingParams(), num_output_tokens=0,
        )  # fmt: skip
        return runner.build_meta(ScheduledBatch(seqs=[seq], num_decodes=int(decode)))

    ids, meta = run(context, 0, False)
    hidden = model(ids, meta, cache)
    ids, meta = run(context[1:], 0, False)
    out = model.mtp_forward(ids, hidden[:-1], meta, cache)[-1:]
    drafts = [int(model.compute_logits(out).argmax(-1))]
    for j in range(1, k):
        ids, meta = run([drafts[-1]], len(context) - 2 + j, True)
        out = model.mtp_forward(ids, out, meta, cache)
        drafts.append(int(model.compute_logits(out).argmax(-1)))
    return drafts


def test_engine_drafts_are_the_blocks_own_predictions(ckpt: Path) -> None:
    """MTP drafting through the engine (`speculative_config.method: mtp`): outputs are plain decoding's, and
    the drafts it holds after each step are those a from-scratch recomputation of the block over the
    request's context gives (its catch-up passes saw every position once, with the right token after it),
    through chunked prefill and verify steps."""
    from hyserve import LLM

    opts = dict(dtype="float32", max_seq_len=256, max_num_tokens=16, kv_cache_config={"tokens_per_block": 8})
    prompt = [1, 5, 9, 13, 200, 17, 4, 88, 21, 90, 33, 7, 150, 61, 2, 19, 44, 8, 8, 30]  # 2 prefill chunks
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = LLM(str(ckpt), **opts).generate([prompt], p)[0].token_ids
    llm = LLM(str(ckpt), speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **opts)
    eng = llm.engine
    drafter = eng.spec.drafter  # type: ignore[union-attr]
    eng.add_request("r", prompt, p)
    got: list[int] = []
    checked = 0
    while eng.has_unfinished():
        for d in eng.step():
            got += d.token_ids
        req = eng.requests.get("r")
        held = drafter._drafts.get("r")
        if req is not None and held is not None and held[0] == req.num_tokens:
            context = req.prompt_token_ids + req.output_token_ids
            assert held[1] == _reference_drafts(eng.loaded.model, context, len(held[1])), len(context)
            checked += 1
    assert got == want and checked >= 3
    assert llm.stats()["spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("graphs", [False, True])
def test_drafts_stay_exact_across_steps_that_do_not_draft(ckpt: Path, graphs: bool) -> None:
    """Above `disable_by_batch_size` a step drafts nothing: the block's catch-up pass follows it as soon as it
    is sampled (its tokens read on the device), and the step is read a step later as any other. Three
    requests at a threshold of 1: while two or more run nothing drafts; once one is left it drafts again,
    and its drafts are still the block's own predictions over the whole context. With `graphs`, decode steps
    and verify steps run through the decode graphs' static buffers (eagerly on the CPU), which keep the hidden
    states."""
    from hyserve import LLM

    opts = dict(dtype="float32", max_seq_len=256, max_num_tokens=16, kv_cache_config={"tokens_per_block": 8})
    prompts = [
        [1, 5, 9, 13, 200, 17, 4, 88, 21, 90, 33, 7, 150, 61, 2, 19, 44, 8, 8, 30],
        [1, 7, 7, 3],
        [1, 2],
    ]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (16, 6, 9)]
    want = [o.token_ids for o in LLM(str(ckpt), **opts).generate(prompts, params)]
    spec = {"method": "mtp", "num_speculative_tokens": 3, "disable_by_batch_size": 1}
    llm = LLM(str(ckpt), speculative_config=spec, **opts)
    eng = llm.engine
    if graphs:
        # the padding rows' slot is a scratch slot: a verify step (1 sequence here) has no padding row
        pad = eng.cache.states.pad_slots[0]
        eng.runner.capture_graphs(
            [1, 2, 4], max_blocks_per_seq=32, pad_slot=pad, enable_padding=True, spec_widths=range(2, 5)
        )
    drafter = eng.spec.drafter  # type: ignore[union-attr]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), prompt, p)
    got: dict[str, list[int]] = {str(i): [] for i in range(3)}
    checked = crowded = 0
    while eng.has_unfinished():
        crowded += len(eng.scheduler.running) > 1
        for d in eng.step():
            got[d.request_id] += d.token_ids
        for rid, req in list(eng.requests.items()):
            held = drafter._drafts.get(rid)
            if held is not None and held[0] == req.num_tokens:
                context = req.prompt_token_ids + req.output_token_ids
                assert held[1] == _reference_drafts(eng.loaded.model, context, len(held[1])), len(context)
                checked += 1
    assert [got[str(i)] for i in range(3)] == want
    stats = llm.stats()
    assert crowded >= 5 and checked >= 3 and stats["spec_decode_num_drafts"] > 0
    assert stats["overlapped_steps_total"] > 0  # the steps that drafted nothing were read a step later


def test_drafts_stay_exact_after_a_step_in_flight_is_dropped(ckpt: Path) -> None:
    """A failure reset drops the step in flight unread (its catch-up ran at launch): a request added after
    it still gets every catch-up pass, so its drafts are the block's own predictions."""
    from hyserve import LLM

    opts = dict(dtype="float32", max_seq_len=256, max_num_tokens=16, kv_cache_config={"tokens_per_block": 8})
    spec = {"method": "mtp", "num_speculative_tokens": 3, "disable_by_batch_size": 1}
    llm = LLM(str(ckpt), speculative_config=spec, **opts)
    eng = llm.engine
    p = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i in range(3):
        eng.add_request(str(i), [1, 2, 3, 4 + i], p)
    for _ in range(4):
        eng.step()
    assert eng._inflight is not None  # a step that drafted nothing, in flight
    eng.reset_after_failure("a test")
    drafter = eng.spec.drafter  # type: ignore[union-attr]
    eng.add_request("new", [1, 9, 9, 9, 9], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    checked = 0
    while eng.has_unfinished():
        eng.step()
        req, held = eng.requests.get("new"), drafter._drafts.get("new")
        if req is not None and held is not None and held[0] == req.num_tokens:
            context = req.prompt_token_ids + req.output_token_ids
            assert held[1] == _reference_drafts(eng.loaded.model, context, len(held[1])), len(context)
            checked += 1
    assert checked >= 2


def test_mtp_drafting_without_a_block_is_refused_at_start_up(tmp_path: Path) -> None:
    from hyserve import LLM

    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="has no multi-token-prediction layer"):
        LLM(str(make_tiny(tmp_path / "plain")), speculative_config=spec)
    bamba = tmp_path / "bamba"
    bamba.mkdir()
    (bamba / "config.json").write_text(
        (ROOT / "benchmarks" / "configs" / "Bamba-9B" / "config.json").read_text()
    )
    with pytest.raises(ValueError, match="bamba models have no multi-token-prediction layer"):
        LLM(str(bamba), load_format="dummy", speculative_config=spec)
