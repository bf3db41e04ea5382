"""The steps the activation profiler runs (hyserve/engine/assembly/memory_profile.py) are steps the engine can
execute: here on the CPU with the tiny model. The long one writes prefix-cache snapshots, so on a GPU
its peak includes the scan's per-chunk states that a real step with snapshots keeps."""

from __future__ import annotations

import torch

from hyserve.engine.assembly.memory_profile import profile_batches
from hyserve.engine.runner.runner import ModelRunner
from hyserve.model.cache_tensors import CacheTensors
from hyserve.model.nemotron_h.config import HybridModelConfig
from hyserve.model.nemotron_h.model import NemotronHForCausalLM
from hyserve.model.tiny import builtin_model_dir
from tests.model_harness import strong_random_weights


def test_profile_batches_run_and_snapshot() -> None:
    cfg = HybridModelConfig.from_hf(builtin_model_dir())
    model = NemotronHForCausalLM(cfg, dtype=torch.float32)
    strong_random_weights(model, cfg, seed=1)
    model.eval()
    L = cfg.chunk_size
    n, bs = 3 * L + 5, 16
    prefills, decode = profile_batches(
        L, max_num_tokens=n, max_batch_size=4, graph_batch_size=3, tokens_per_block=bs
    )
    assert [len(b.seqs) for b in prefills] == [1, 4] and sum(len(s.token_ids) for s in prefills[1].seqs) == n
    assert prefills[0].seqs[0].snapshots == [(3 * L, 0), (n, 2)]
    assert decode.num_decodes == 3 and len(decode.seqs) == 3
    cache = CacheTensors.allocate(
        cfg.cache_layout(),
        num_blocks=-(-n // bs) + 4,
        tokens_per_block=bs,
        num_slots=3,
        device=torch.device("cpu"),
    )
    runner = ModelRunner(model, cache, torch.device("cpu"))
    for batch in (*prefills, decode):
        logits = runner.execute(batch)
        assert logits.shape[0] == sum(s.sample for s in batch.seqs) and torch.isfinite(logits).all()
    # the long step's snapshot at its end holds the live state it finished with
    runner.execute(prefills[0])
    for i in cfg.mamba_layer_ids:
        assert torch.equal(cache.ssm[i][2], cache.ssm[i][1]) and torch.equal(
            cache.conv[i][2], cache.conv[i][1]
        )
        assert not torch.equal(cache.ssm[i][0], cache.ssm[i][1])


def test_profile_short_step_snapshots_only_its_end() -> None:
    prefills, _ = profile_batches(
        128, max_num_tokens=100, max_batch_size=1, graph_batch_size=1, tokens_per_block=16
    )
    assert len(prefills) == 1 and prefills[0].seqs[0].snapshots == [(100, 2)]
    prefills, _ = profile_batches(
        128, max_num_tokens=256, max_batch_size=1, graph_batch_size=1, tokens_per_block=16
    )
    assert prefills[0].seqs[0].snapshots == [(128, 0), (256, 2)]
