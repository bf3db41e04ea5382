"""Train a multi-token-prediction (MTP) block for a NemotronH checkpoint that has none, and write a copy of
the checkpoint with it: `mtp.layers.{0,1}.*` tensors in NVIDIA's layout, `num_nextn_predict_layers: 1`,
`mtp_hybrid_override_pattern: "*-"` (attention, then an MLP of the model's intermediate size).

The target stays frozen: hyserve runs it to get each sequence's final-normed hidden states. The block is
trained in plain torch on the equations of model/nemotron_h/mtp.py (tests/families/test_nemotron_mtp.py
checks hyserve's block against the same equations) to predict token t + 2 from (h_t, token t + 1), on the
needle task of scripts/train_needle.py, the answer's positions weighted up. At the end, hyserve serves the new
checkpoint with `speculative_config.method: mtp` and plain, on the same prompts: the acceptance length and
whether the answers agree are printed and written to benchmarks/results/mtp_train_<name>.json.

    python -m scripts.train_mtp --out models/hyserve-needle-tiny-mtp --steps 600
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from hyserve import LLM, SamplingParams
from hyserve.bench.report import stamp
from hyserve.engine.runner.runner import ModelRunner
from hyserve.engine.sampling_params import SamplingParams as SP
from hyserve.engine.scheduler.scheduler import ScheduledBatch, ScheduledSeq
from hyserve.model.nemotron_h.config import HybridModelConfig
from hyserve.model.nemotron_h.model import NemotronHForCausalLM
from hyserve.model.weights import load_checkpoint
from scripts import train_needle as T

ROOT = Path(__file__).resolve().parents[1]


class PlainMTP(nn.Module):
    """The MTP block of model/nemotron_h/mtp.py with an MLP second sublayer, in differentiable plain torch."""

    def __init__(self, cfg: HybridModelConfig) -> None:
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.heads, self.kv_heads, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.layer_norm_epsilon
        # the norms' weights, by checkpoint name below mtp.layers. ("0.enorm" -> "0/enorm": no dots in a key)
        self.w = nn.ParameterDict(
            {
                k: nn.Parameter(torch.ones(h))
                for k in ("0/enorm", "0/hnorm", "0/norm", "1/norm", "1/final_layernorm")
            }
        )
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.q = nn.Linear(h, self.heads * self.d, bias=False)
        self.k = nn.Linear(h, self.kv_heads * self.d, bias=False)
        self.v = nn.Linear(h, self.kv_heads * self.d, bias=False)
        self.o = nn.Linear(self.heads * self.d, h, bias=False)
        self.up = nn.Linear(h, inter, bias=False)
        self.down = nn.Linear(inter, h, bias=False)
        for lin in (self.eh_proj, self.q, self.k, self.v, self.up):
            nn.init.normal_(lin.weight, std=0.02)
        for lin in (self.o, self.down):
            nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2))

    def _rms(self, x: torch.Tensor, key: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[key.replace(".", "/")]

    def _level(self, emb: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A pass's residual input and its attention's q, k, v ([B, heads, T, d]; k and v repeated to the
        query heads)."""
        x = self.eh_proj(torch.cat([self._rms(emb, "0.enorm"), self._rms(hidden, "0.hnorm")], -1))
        y = self._rms(x, "0.norm")
        B, L, _ = y.shape
        q = self.q(y).view(B, L, self.heads, self.d).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k = self.k(y).view(B, L, self.kv_heads, self.d).transpose(1, 2).repeat_interleave(rep, 1)
        v = self.v(y).view(B, L, self.kv_heads, self.d).transpose(1, 2).repeat_interleave(rep, 1)
        return x, q, k, v

    def _finish(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        r = self.o(a.transpose(1, 2).reshape(*x.shape[:2], -1)) + x
        m = self.down(F.relu(self.up(self._rms(r, "1.norm"))).pow(2))
        return self._rms(m + r, "1.final_layernorm")

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, levels: int = 1) -> list[torch.Tensor]:
        """emb: [B, T, h] the embeddings of tokens 1..T (the token after each position), hidden: [B, T, h] the
        target's hidden states at positions 0..T-1 -> each level's output [B, T, h].

        Level 0 is the catch-up pass (causal over its own keys). Level c at position t is the c-th chained
        pass as the engine runs it: its inputs are level c - 1's output at t - 1 and token t + 1, and it
        attends to level 0's keys up to t - c, then level l's key at t - c + l for l = 1..c (the chain's own
        earlier passes, the last at t). It predicts token t + 2 like level 0; positions t < c have no such
        pass (their outputs are not meaningful)."""
        outs: list[torch.Tensor] = []
        keys: list[tuple[torch.Tensor, torch.Tensor]] = []
        L = emb.shape[1]
        pos = torch.arange(L)
        for c in range(levels):
            h_in = hidden if c == 0 else F.pad(outs[-1][:, :-1], (0, 0, 1, 0))  # level c - 1 at t - 1
            x, q, k, v = self._level(emb, h_in)
            keys.append((k, v))
            scale = self.d**-0.5
            s0 = (q @ keys[0][0].transpose(-1, -2)) * scale  # [B, H, T, T] against level 0's keys
            s0 = s0.masked_fill(pos[None, :] > pos[:, None] - c, float("-inf"))
            chain_k = [F.pad(keys[lv][0], (0, 0, c - lv, 0))[:, :, :L] for lv in range(1, c + 1)]
            chain_v = [F.pad(keys[lv][1], (0, 0, c - lv, 0))[:, :, :L] for lv in range(1, c + 1)]
            sl = [((q * kl).sum(-1, keepdim=True)) * scale for kl in chain_k]
            p = torch.cat([s0, *sl], -1).softmax(-1)
            a = p[..., :L] @ keys[0][1]
            for i, vl in enumerate(chain_v):
                a = a + p[..., L + i : L + i + 1] * vl
            outs.append(self._finish(x, a))
        return outs

    def state(self) -> dict[str, torch.Tensor]:
        """The block's tensors under their checkpoint names."""
        out = {f"mtp.layers.{k.replace('/', '.')}.weight": v.detach().clone() for k, v in self.w.items()}
        out["mtp.layers.0.eh_proj.weight"] = self.eh_proj.weight.detach().clone()
        for name, lin in (("q_proj", self.q), ("k_proj", self.k), ("v_proj", self.v), ("o_proj", self.o)):
            out[f"mtp.layers.0.mixer.{name}.weight"] = lin.weight.detach().clone()
        out["mtp.layers.1.mixer.up_proj.weight"] = self.up.weight.detach().clone()
        out["mtp.layers.1.mixer.down_proj.weight"] = self.down.weight.detach().clone()
        return out


def target_hidden(model: NemotronHForCausalLM, ids: list[int]) -> torch.Tensor:
    """The frozen target's final-normed hidden states over `ids` ([L, h]), one prefill through hyserve."""
    bs = 64
    cache = model.allocate_cache(
        num_blocks=-(-len(ids) // bs), tokens_per_block=bs, num_slots=1, device="cpu"
    )
    runner = ModelRunner(model, cache, torch.device("cpu"))
    seq = ScheduledSeq(
        request_id="t", token_ids=ids, start_pos=0, block_ids=list(range(-(-len(ids) // bs))), state_src=None,
        state_dst=0, sample=True, snapshots=[], params=SP(), num_output_tokens=0,
    )  # fmt: skip
    x, meta = runner.build_meta(ScheduledBatch(seqs=[seq], num_decodes=0))
    return model(x, meta, cache)


def batch(tok, rng: random.Random, model, n: int, lo: int, hi: int) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
    """n needle examples of lo-hi prompt tokens: (token ids, hidden states, targets t + 2, weights)."""
    exs = [
        T.make_example(tok, rng, target_len=rng.randint(lo, hi), depth=rng.random(),
                       code=T.random_code(rng, 1.0), style=rng.choice(T.FILLER_STYLES))
        for _ in range(n)
    ]  # fmt: skip
    width = max(len(e.ids) for e in exs)
    ids = torch.zeros(n, width, dtype=torch.long)
    hid = torch.zeros(n, width, model.config.hidden_size)
    tgt = torch.full((n, width), -100, dtype=torch.long)
    wts = torch.zeros(n, width)
    for i, e in enumerate(exs):
        L = len(e.ids)
        ids[i, :L] = torch.tensor(e.ids)
        hid[i, :L] = target_hidden(model, e.ids)
        tgt[i, : L - 2] = torch.tensor(e.ids[2:])
        wts[i, : L - 2] = 0.1
        wts[i, max(0, e.answer_start - 2) : L - 2] = 1.0  # positions whose token t + 2 is in the answer
    return ids, hid, tgt, wts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=ROOT / "models" / "hyserve-needle-tiny")
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "hyserve-needle-tiny-mtp")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--levels",
        type=int,
        default=1,
        help="train the catch-up pass and levels - 1 chained passes, as the engine runs them (k = levels)",
    )
    ap.add_argument("--result-dir", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args(argv)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    tok = T.tiny_tokenizer()
    cfg = HybridModelConfig.from_hf(a.target)
    model = NemotronHForCausalLM(cfg, dtype=torch.float32)
    load_checkpoint(model, a.target, names=model.checkpoint_names)
    emb = model.backbone.embeddings.weight.detach()
    head = (model.lm_head.weight if model.lm_head is not None else model.backbone.embeddings.weight).detach()
    mtp = PlainMTP(cfg)
    opt = torch.optim.AdamW(mtp.parameters(), lr=a.lr, weight_decay=0.01)
    t0 = time.monotonic()
    for step in range(a.steps):
        ids, hid, tgt, wts = batch(tok, rng, model, a.batch, 160, 320)
        for g in opt.param_groups:
            g["lr"] = a.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / a.steps))
        nxt = F.pad(ids[:, 1:], (0, 1))  # position t's input is token t + 1
        loss = torch.zeros(())
        for c, out in enumerate(mtp(emb[nxt], hid, a.levels)):
            w = wts.clone()
            w[:, :c] = 0  # level c starts at position c
            ce = F.cross_entropy(
                (out @ head.T).flatten(0, 1), tgt.flatten(), ignore_index=-100, reduction="none"
            )
            loss = loss + (ce * w.flatten()).sum() / w.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == a.steps - 1:
            print(f"step {step}: loss {loss.item():.3f} ({time.monotonic() - t0:.0f}s)", flush=True)
    write_checkpoint(a.target, a.out, mtp.state())
    result = {
        **stamp(
            "mtp_train", ["python", "-m", "scripts.train_mtp", *(argv if argv is not None else sys.argv[1:])]
        )
    }
    result.update(measure(a.out))
    result.update(
        steps=a.steps,
        batch=a.batch,
        lr=a.lr,
        seed=a.seed,
        levels=a.levels,
        train_seconds=time.monotonic() - t0,
    )
    path = a.result_dir / f"mtp_train_{a.out.name}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


def write_checkpoint(target: Path, out: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A copy of the target checkpoint with the MTP tensors and config keys added."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(target, out)
    weights = out / "model.safetensors"
    sd = load_file(str(weights))
    sd.update({k: v.contiguous() for k, v in tensors.items()})
    save_file(sd, str(weights), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*-")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def measure(ckpt: Path, k: int = 3) -> dict[str, object]:
    """hyserve with MTP drafting against plain decoding on the needle test prompts (batch 1 each)."""
    tok = T.tiny_tokenizer()
    rng = random.Random(2024)
    prompts = [T.bench_prompt_ids(tok, n, d) for n in (160, 300) for d in (0.0, 0.5, 1.0)]
    prompts += [
        T.make_example(tok, rng, target_len=160 + 16 * i, depth=i / 9, code=T.random_code(rng, 1.0),
                       style="mixed").ids[:-1]
        for i in range(10)
    ]  # fmt: skip
    greedy = SamplingParams(max_tokens=40, temperature=0)
    plain = LLM(str(ckpt), max_seq_len=4096)
    spec = LLM(str(ckpt), max_seq_len=4096, speculative_config={"method": "mtp", "num_speculative_tokens": k})
    same, t_plain, t_spec = 0, 0.0, 0.0
    for p in prompts:
        t = time.perf_counter()
        a = plain.generate([p], greedy)[0].token_ids
        t_plain += time.perf_counter() - t
        t = time.perf_counter()
        b = spec.generate([p], greedy)[0].token_ids
        t_spec += time.perf_counter() - t
        same += a == b
    s = spec.stats()
    drafts = max(1, s["spec_decode_num_drafts"])
    return {
        "checkpoint": ckpt.name,
        "prompts": len(prompts),
        "same_answers": same,
        "k": k,
        "acceptance_length": 1 + s["spec_decode_num_accepted_tokens"] / drafts,
        "accepted_share": s["spec_decode_num_accepted_tokens"] / max(1, s["spec_decode_num_draft_tokens"]),
        "cpu_seconds_plain": t_plain,
        "cpu_seconds_mtp": t_spec,
    }


if __name__ == "__main__":
    raise SystemExit(main())
