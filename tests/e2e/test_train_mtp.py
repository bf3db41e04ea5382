"""scripts/train_mtp.py end to end on the CPU, a few steps: it writes a copy of the needle checkpoint with an
MTP block in NVIDIA's layout, which hyserve loads and drafts with, giving plain decoding's answers."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from scripts import train_mtp


def test_a_few_steps_write_a_checkpoint_that_drafts(tmp_path: Path) -> None:
    out = tmp_path / "needle-mtp"
    argv = ["--out", str(out), "--steps", "3", "--batch", "2", "--result-dir", str(tmp_path)]
    assert train_mtp.main(argv) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["mtp_hybrid_override_pattern"] == "*-"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"mtp.layers.0.eh_proj.weight", "mtp.layers.1.final_layernorm.weight"} <= names
    res = json.loads((tmp_path / "mtp_train_needle-mtp.json").read_text())
    assert res["same_answers"] == res["prompts"] == 16 and res["acceptance_length"] >= 1.0


def test_the_trained_module_is_hyserves_block(tmp_path: Path) -> None:
    """The plain-torch block the script trains computes what hyserve's MTP block computes with its tensors:
    the same output over a sequence, from the embeddings of the tokens after each position and the target's
    hidden states at those positions; and its chained levels are what the engine's chain passes compute."""
    import torch

    from hyserve.engine.runner.runner import ModelRunner
    from hyserve.engine.sampling_params import SamplingParams
    from hyserve.engine.scheduler.scheduler import ScheduledBatch, ScheduledSeq
    from hyserve.model.nemotron_h.config import HybridModelConfig
    from hyserve.model.nemotron_h.model import NemotronHForCausalLM
    from hyserve.model.weights import load_checkpoint

    target = train_mtp.ROOT / "models" / "hyserve-needle-tiny"
    torch.manual_seed(0)
    plain = train_mtp.PlainMTP(HybridModelConfig.from_hf(target))
    out = tmp_path / "ckpt"
    train_mtp.write_checkpoint(target, out, plain.state())
    cfg = HybridModelConfig.from_hf(out).with_mtp()
    model = NemotronHForCausalLM(cfg, dtype=torch.float32)
    load_checkpoint(model, out, names=model.checkpoint_names)
    ids = [1, 5, 40, 41, 42, 7, 9, 100, 101, 3, 4, 60, 61, 62, 5, 40, 41, 2]
    h = train_mtp.target_hidden(model, ids)
    cache = model.allocate_cache(num_blocks=4, tokens_per_block=8, num_slots=1, device="cpu")
    seq = ScheduledSeq(
        request_id="r", token_ids=ids[1:], start_pos=0, block_ids=[0, 1, 2, 3], state_src=None, state_dst=0,
        sample=True, snapshots=[], params=SamplingParams(), num_output_tokens=0,
    )  # fmt: skip
    x, meta = ModelRunner(model, cache, torch.device("cpu")).build_meta(
        ScheduledBatch(seqs=[seq], num_decodes=0)
    )
    with torch.no_grad():
        got = model.mtp_forward(x, h[:-1], meta, cache)
        emb = model.backbone.embeddings.weight[torch.tensor(ids[1:])][None]
        levels = plain(emb, h[:-1][None], levels=3)
    assert (got - levels[0][0]).abs().max().item() < 1e-4
    # the chained levels are the engine's chain passes: level c at position t follows a catch-up over
    # positions 0 .. t - c, then c one-row passes, each from the previous output and the true next token
    runner = ModelRunner(model, cache, torch.device("cpu"))

    def meta_of(tokens: list[int], start: int, decode: bool):  # noqa: ANN202
        s = ScheduledSeq(
            request_id="r", token_ids=tokens, start_pos=start, block_ids=[0, 1, 2, 3], state_src=None,
            state_dst=0, sample=True, snapshots=[], params=SamplingParams(), num_output_tokens=0,
        )  # fmt: skip
        return runner.build_meta(ScheduledBatch(seqs=[s], num_decodes=int(decode)))

    for c in (1, 2):
        for t in (c + 2, 9, len(ids) - 2):
            with torch.no_grad():
                x, meta = meta_of(ids[1 : t - c + 2], 0, False)
                out = model.mtp_forward(x, h[: t - c + 1], meta, cache)[-1:]
                for j in range(1, c + 1):
                    x, meta = meta_of([ids[t - c + j + 1]], t - c + j, True)
                    out = model.mtp_forward(x, out, meta, cache)
            assert (out[0] - levels[c][0, t]).abs().max().item() < 1e-4, (c, t)
