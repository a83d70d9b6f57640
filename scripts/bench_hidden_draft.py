#!/usr/bin/env python3
"""MTP and EAGLE-3 drafting on the CPU twin's executor, with and without, in one run.

Workloads (greedy, end id off, every request makes exactly ``--tokens`` tokens; max_draft_len 3):
- ``mtp-random``: the synthetic DeepSeek-V3 (trtpipe.models.synthetic "deepseek_v3", 3 layers, MLA + MoE) with a
  random MTP layer (trtpipe.models.synthetic_heads.add_mtp_layer); random prompts of 4-16 tokens.
- ``eagle3-random``: stories260k deepened to 8 layers (its layers 2-4 repeated: upstream's default EAGLE-3 capture
  needs more than 5) with a random EAGLE-3 head (make_eagle3_head); story openings.
- ``eagle3-trained``: the same target with an EAGLE-3 head trained here for ``--train-steps`` Adam steps on the
  target's own sampled text (teacher forcing of the first draft only: input (t[j+1], the target's layers 1, 3, 4
  at j), label t[j+2], over a draft vocabulary of the target's most frequent tokens, 1/4 of its vocabulary as the
  published Llama-3.1 head keeps); saved in the published layout and loaded by the twin like any head.

Per run: tokens per target forward (output tokens / target forwards each request took part in), acceptance rate,
ITL p50 and output tok/s (as scripts/bench_speculative.py, whose ``run`` this reuses), ratios against the same
workload and concurrency without speculation in this run.

    .venv/bin/python scripts/bench_hidden_draft.py [--requests 16] [--tokens 64] [--train-steps 400] [--json out]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speculative import OPENINGS, STORIES, print_table, run  # noqa: E402

CAPTURE = (1, 3, 4)  # eagle3_capture_layers(8)


def deepened(out: Path) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(STORIES, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 8}))
    sd = load_file(str(out / "model.safetensors"))
    for new, old in ((5, 2), (6, 3), (7, 4)):
        for k in [k for k in sd if k.startswith(f"model.layers.{old}.")]:
            sd[k.replace(f"model.layers.{old}.", f"model.layers.{new}.")] = sd[k].clone()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def train_eagle3(target: Path, out: Path, steps: int, seed: int = 0) -> tuple[Path, float, float]:
    """An EAGLE-3 head trained on the target's sampled text; returns its directory, the last training loss and the
    held-out first-draft accuracy."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    from trtpipe.models.synthetic import load_hf
    from trtpipe.models.synthetic_heads import make_eagle3_head

    torch.manual_seed(seed)
    hf = load_hf(target)
    cfg = hf.config
    H, V, eps = cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps
    with torch.no_grad():  # the target's own text: 1,024 samples of 64 tokens from BOS, the last 128 held out
        seqs = hf.generate(
            torch.ones(1024, 1, dtype=torch.long), do_sample=True, max_new_tokens=64, min_new_tokens=64, pad_token_id=0
        )
        hs = hf(seqs, output_hidden_states=True).hidden_states
        cap = torch.cat([hs[i + 1] for i in CAPTURE], -1)  # [B, T, 3H]
        emb = hf.model.embed_tokens(seqs)
    counts = torch.bincount(seqs.flatten(), minlength=V)
    dv = V // 4
    kept = counts.topk(dv).indices.sort().values
    t2d = torch.zeros(V, dtype=torch.bool).index_fill_(0, kept, True)
    to_draft = torch.full((V,), -100, dtype=torch.long).index_copy_(0, kept, torch.arange(dv))

    head = make_eagle3_head(target, out, seed=seed)  # the layout and config; its weights are the start
    hcfg = json.loads((head / "config.json").read_text())
    hcfg["draft_vocab_size"] = dv
    from safetensors.torch import load_file

    w = {
        k: torch.nn.Parameter(v.clone())
        for k, v in load_file(str(head / "model.safetensors")).items()
        if v.is_floating_point()
    }
    w["lm_head.weight"] = torch.nn.Parameter(torch.randn(dv, H) / H**0.5)
    attn_cfg = LlamaConfig(**{**cfg.to_dict(), "hidden_size": 2 * H, "head_dim": hcfg["head_dim"]})
    attn_cfg._attn_implementation = "eager"
    attn = LlamaAttention(attn_cfg, 0)
    attn.o_proj = torch.nn.Linear(hcfg["num_attention_heads"] * hcfg["head_dim"], H, bias=False)
    for p in "qkvo":
        getattr(attn, f"{p}_proj").weight = w[f"midlayer.self_attn.{p}_proj.weight"]
    rope = LlamaRotaryEmbedding(LlamaConfig(**hcfg))

    def rms(x, g):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g

    def forward(e, c):
        n = c.shape[1]
        g = c @ w["fc.weight"].T
        cos, sin = rope(g, torch.arange(n)[None])
        h = torch.cat([rms(e, w["midlayer.input_layernorm.weight"]), rms(g, w["midlayer.hidden_norm.weight"])], -1)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        x = g + attn(h, (cos, sin), mask)[0]
        m = rms(x, w["midlayer.post_attention_layernorm.weight"])
        x = (
            x
            + (
                torch.nn.functional.silu(m @ w["midlayer.mlp.gate_proj.weight"].T)
                * (m @ w["midlayer.mlp.up_proj.weight"].T)
            )
            @ w["midlayer.mlp.down_proj.weight"].T
        )
        return rms(x, w["norm.weight"]) @ w["lm_head.weight"].T

    opt = torch.optim.Adam(list(w.values()), lr=3e-3)
    loss = torch.tensor(0.0)
    train = seqs.shape[0] - 128
    for step in range(steps):
        b = torch.randint(0, train, (32,))
        # position j reads (t[j+1], cap[j]) and predicts t[j+2]
        logits = forward(emb[b, 1:-1], cap[b, :-2])
        labels = to_draft[seqs[b, 2:]]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, dv), labels.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():  # held-out first-draft accuracy (labels in the draft vocabulary)
        held = torch.arange(train, seqs.shape[0])
        labels = to_draft[seqs[held, 2:]]
        hit = (forward(emb[held, 1:-1], cap[held, :-2]).argmax(-1) == labels)[labels >= 0]
        accuracy = float(hit.float().mean())
    tensors = {k: v.detach().clone() for k, v in w.items()}
    tensors["d2t"] = kept - torch.arange(dv)
    tensors["t2d"] = t2d
    save_file(tensors, str(head / "model.safetensors"), metadata={"format": "pt"})
    (head / "config.json").write_text(json.dumps(hcfg, indent=2))
    return head, float(loss.detach()), accuracy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--train-steps", type=int, default=400)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from trtpipe.models.synthetic import make_synthetic
    from trtpipe.models.synthetic_heads import add_mtp_layer, make_eagle3_head
    from trtpipe.runtime.hf_loader import load_hf_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="bench-heads-"))
    ds = make_synthetic("deepseek_v3", tmp / "ds", seed=3)
    add_mtp_layer(ds, make_synthetic("deepseek_v3", tmp / "blk", seed=5, num_hidden_layers=1, first_k_dense_replace=0))
    deep = deepened(tmp / "stories-8l")
    tok = AutoTokenizer.from_pretrained(str(STORIES))
    g = torch.Generator().manual_seed(0)
    random_prompts = [
        [1] + torch.randint(3, 240, (int(n),), generator=g).tolist()
        for n in torch.randint(4, 17, (args.requests,), generator=g)
    ]
    stories = [tok.encode(OPENINGS[i % len(OPENINGS)]) for i in range(args.requests)]
    trained, loss, accuracy = train_eagle3(deep, tmp / "head-trained", args.train_steps)
    print(
        f"eagle3-trained: last training loss {loss:.3f} after {args.train_steps} steps; held-out first-draft "
        f"accuracy {accuracy:.3f}"
    )
    workloads = {
        "mtp-random": (ds, random_prompts, {"speculative_decoding_type": "MTP", "max_draft_len": 3}),
        "eagle3-random": (
            deep,
            stories,
            {
                "speculative_decoding_type": "Eagle3",
                "max_draft_len": 3,
                "speculative_model": str(make_eagle3_head(deep, tmp / "head-random", seed=4)),
            },
        ),
        "eagle3-trained": (
            deep,
            stories,
            {"speculative_decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model": str(trained)},
        ),
    }
    rows = []
    for name, (model_dir, prompts, spec) in workloads.items():
        model = load_hf_checkpoint(model_dir)
        for c in (1, 8):
            base = run(model, prompts, args.tokens, c, {}, model_dir)
            with_spec = run(model, prompts, args.tokens, c, spec, model_dir)
            rows.append({"workload": name, "concurrency": c, "off": base, "on": with_spec})
    shutil.rmtree(tmp)
    print_table(rows)
    if args.json:
        args.json.write_text(
            json.dumps({"train_loss": loss, "heldout_first_draft_accuracy": accuracy, "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
