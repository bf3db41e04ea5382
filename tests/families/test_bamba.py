"""Bamba (BambaForCausalLM) served through the normal loader matches transformers on the CPU."""

from __future__ import annotations

import pytest
import torch

from tests.families.hf_parity import check_parity, check_tp2_matches_tp1

transformers = pytest.importorskip("transformers")


def _hf_model():
    torch.manual_seed(0)
    cfg = transformers.BambaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=[1],
        mamba_n_heads=8,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=8,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    hf = transformers.BambaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # visible SSM and norm parameters (init leaves them at 1, log(1..H))
        for m in hf.modules():
            if type(m).__name__ == "BambaMixer":
                m.dt_bias.normal_(0.0, 0.5)
                m.D.normal_(1.0, 0.2)
                m.norm.weight.normal_(1.0, 0.1)
    return hf


def test_bamba_greedy_matches_transformers(tmp_path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    worst = check_parity(str(tmp_path), hf)
    print(f"bamba max |dlogprob| {worst:.2e}")


@pytest.mark.slow
def test_bamba_tp2_matches_tp1(tmp_path):
    """Over two gloo ranks: each rank's Mamba heads, KV heads and MLP columns."""
    _hf_model().save_pretrained(tmp_path)
    check_tp2_matches_tp1(str(tmp_path))
