"""Random draft heads for tests and benchmarks: an EAGLE-3 head for a Llama target, Medusa heads, and an MTP layer
added to a synthetic DeepSeek-V3 checkpoint. Random weights draft badly, but speculation's greedy output never depends on what a
head proposes, so they test the execution; acceptance measured with them is a random head's.

- EAGLE-3: the layout of a published head such as ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`` (as recalled, not checked
  against the hub files here): config ``architectures: [LlamaForCausalLMEagle3]``, ``num_hidden_layers: 1``,
  ``draft_vocab_size`` (32000 of Llama-3's 128256); tensors ``fc.weight`` [H, 3H], ``midlayer.*`` (``hidden_norm``,
  ``input_layernorm``, ``post_attention_layernorm``, ``self_attn.{q,k,v,o}_proj`` with q/k/v over 2H inputs,
  ``mlp.{gate,up,down}_proj``), ``norm.weight``, ``lm_head.weight`` [draft vocab, H], ``d2t`` (int64 offsets,
  target id = d + d2t[d]) and ``t2d`` (bool over the target vocabulary); no embedding (the target's is used).
- MTP: DeepSeek-V3's ``model.layers.{num_hidden_layers}.*``: a full decoder block (MLA + MoE) plus ``enorm``,
  ``hnorm``, ``eh_proj`` [H, 2H], ``shared_head.norm``, ``shared_head.head`` and ``embed_tokens`` (copies of the
  target's lm_head and embedding, as the released checkpoints store them); ``num_nextn_predict_layers: 1``, or
  several such layers (``add_mtp_layers``: DeepSeek-V3 ships one, TensorRT-LLM runs more as vanilla MTP).
- Heads that draft: ``fit_eagle1_head`` (ridge-fitted) and ``train_eagle3_head`` (trained with Adam on the target's
  own text, over ``deepened_llama``'s 8-layer copy of a small Llama), for the tests and benchmarks that need
  accepted drafts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trtpipe.jsonfile import load_json

EAGLE3_DRAFT_VOCAB_RATIO = 32000 / 128256  # the published Llama-3.1-8B head's draft vocabulary share


def make_eagle3_head(target_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """A random EAGLE-3 head for the Llama checkpoint ``target_dir`` (its width, heads and MLP ratios)."""
    tcfg = load_json(Path(target_dir) / "config.json")
    H, V = int(tcfg["hidden_size"]), int(tcfg["vocab_size"])
    nh, nkv = int(tcfg["num_attention_heads"]), int(tcfg.get("num_key_value_heads") or tcfg["num_attention_heads"])
    d = int(tcfg.get("head_dim") or H // nh)
    inter = int(tcfg["intermediate_size"])
    dv = max(2, round(V * EAGLE3_DRAFT_VOCAB_RATIO))
    g = torch.Generator().manual_seed(seed)

    def w(o: int, i: int) -> torch.Tensor:
        return torch.randn(o, i, generator=g) / i**0.5

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, generator=g)

    kept = torch.randperm(V, generator=g)[:dv].sort().values  # the draft vocabulary: target ids, ascending
    t = {
        "fc.weight": w(H, 3 * H),
        "midlayer.hidden_norm.weight": norm(H),
        "midlayer.input_layernorm.weight": norm(H),
        "midlayer.post_attention_layernorm.weight": norm(H),
        "midlayer.self_attn.q_proj.weight": w(nh * d, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(nkv * d, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(nkv * d, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, nh * d),
        "midlayer.mlp.gate_proj.weight": w(inter, H),
        "midlayer.mlp.up_proj.weight": w(inter, H),
        "midlayer.mlp.down_proj.weight": w(H, inter),
        "norm.weight": norm(H),
        "lm_head.weight": w(dv, H),
        "d2t": kept - torch.arange(dv),
        "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, kept, True),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": H,
        "intermediate_size": inter,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": d,
        "num_hidden_layers": 1,
        "max_position_embeddings": int(tcfg.get("max_position_embeddings") or 2048),
        "rms_norm_eps": float(tcfg.get("rms_norm_eps") or 1e-5),
        # the target's rope (the published Llama-3.1 head repeats the target's rope_theta and llama3 rope_scaling)
        **{k: tcfg[k] for k in ("rope_parameters", "rope_theta", "rope_scaling") if k in tcfg},
        "tie_word_embeddings": False,
        "vocab_size": V,
        "draft_vocab_size": dv,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def add_mtp_layer(model_dir: str | Path, block_dir: str | Path, seed: int = 0) -> Path:
    """Give the DeepSeek-V3 checkpoint ``model_dir`` one MTP layer (in place): its decoder block is layer 0 of
    ``block_dir`` (a one-layer synthetic DeepSeek-V3 whose layer is MoE: ``first_k_dense_replace=0``), its norms and
    ``eh_proj`` random."""
    return add_mtp_layers(model_dir, [block_dir], seed)


def add_mtp_layers(model_dir: str | Path, block_dirs: list, seed: int = 0) -> Path:
    """Give ``model_dir`` one MTP layer per block directory, stored as ``model.layers.{num_hidden_layers + i}``
    (each with its own random norms and ``eh_proj``), and ``num_nextn_predict_layers: len(block_dirs)``."""
    d = Path(model_dir)
    cfg = load_json(d / "config.json")
    n, H = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    tensors = load_file(str(d / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    dtype = tensors["model.embed_tokens.weight"].dtype
    for i, block_dir in enumerate(block_dirs):
        block = load_file(str(Path(block_dir) / "model.safetensors"))
        pre = f"model.layers.{n + i}."
        for k, v in block.items():
            if k.startswith("model.layers.0."):
                tensors[pre + k[len("model.layers.0.") :]] = v
        tensors[pre + "enorm.weight"] = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
        tensors[pre + "hnorm.weight"] = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
        tensors[pre + "eh_proj.weight"] = (torch.randn(H, 2 * H, generator=g) / (2 * H) ** 0.5).to(dtype)
        tensors[pre + "shared_head.norm.weight"] = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
        tensors[pre + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        tensors[pre + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": len(block_dirs)}, indent=2))
    return d


def make_medusa_heads(
    target_dir: str | Path, out_dir: str | Path, num_heads: int = 4, num_layers: int = 1, seed: int = 0
) -> Path:
    """Random Medusa heads for the checkpoint ``target_dir`` in the layout TensorRT-LLM's converter reads
    (``load_medusa_hf``, ``tensorrt_llm/models/medusa/weight.py``): ``config.json`` with ``medusa_num_heads`` and
    ``medusa_num_layers`` (``MedusaForCausalLm.from_hugging_face``, ``tensorrt_llm/models/medusa/model.py@02499765``)
    and ``medusa_lm_head.safetensors`` with ``{h}.{l}.linear.weight`` / ``.bias`` (the residual blocks) and
    ``{h}.{num_layers}.weight`` (the head's lm_head, no bias), as FasterDecoding's ``medusa_lm_head`` stores them."""
    tcfg = load_json(Path(target_dir) / "config.json")
    H, V = int(tcfg["hidden_size"]), int(tcfg["vocab_size"])
    g = torch.Generator().manual_seed(seed)
    t = {}
    for h in range(num_heads):
        for j in range(num_layers):
            t[f"{h}.{j}.linear.weight"] = torch.randn(H, H, generator=g) / H**0.5
            t[f"{h}.{j}.linear.bias"] = 0.1 * torch.randn(H, generator=g)
        t[f"{h}.{num_layers}.weight"] = torch.randn(V, H, generator=g) / H**0.5
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "medusa_lm_head.safetensors"))
    cfg = {
        "medusa_num_heads": num_heads,
        "medusa_num_layers": num_layers,
        "hidden_size": H,
        "vocab_size": V,
        "base_model_name_or_path": str(target_dir),
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def self_sampled(hf, samples: int, tokens: int) -> torch.Tensor:
    """``samples`` sequences of exactly ``tokens`` tokens the transformers model ``hf`` samples itself from BOS (id 1),
    the text the fitted and trained heads learn from (the caller seeds torch)."""
    return hf.generate(
        torch.ones(samples, 1, dtype=torch.long),
        do_sample=True,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        pad_token_id=0,
    )


def fit_medusa_heads(
    target: str | Path, out: str | Path, num_heads: int, samples: int = 1024, length: int = 64, seed: int = 0
) -> tuple[Path, list[float]]:
    """Medusa heads fitted by ridge regression to the target's own sampled text (``samples`` sequences of ``length``
    tokens from BOS, the last eighth held out): head ``i`` maps the target's final hidden state at position j to
    token j + 2 + i (one-hot targets; the residual block left at zero, so it is the identity), saved in upstream's
    heads layout. Returns the directory and each head's held-out top-1 accuracy."""
    from trtpipe.models.synthetic import load_hf

    ridge = 1e-2
    torch.manual_seed(seed)
    hf = load_hf(target)
    V = hf.config.vocab_size
    with torch.no_grad():
        seqs = self_sampled(hf, samples, length)
        h = hf.model(seqs).last_hidden_state.double()  # after the final norm: what the heads read
    heads = make_medusa_heads(target, out, num_heads=num_heads, seed=seed)
    t = load_file(str(heads / "medusa_lm_head.safetensors"))
    train, accuracy = seqs.shape[0] - samples // 8, []
    for i in range(num_heads):
        x = h[:, : -(2 + i)]  # position j predicts t[j + 2 + i]
        y = seqs[:, 2 + i :]
        xt, yt = x[:train].reshape(-1, x.shape[-1]), y[:train].reshape(-1)
        xty = torch.zeros(x.shape[-1], V, dtype=torch.float64).index_add_(1, yt, xt.T)  # x^T one-hot(y)
        w = torch.linalg.solve(xt.T @ xt + ridge * len(yt) * torch.eye(x.shape[-1], dtype=torch.float64), xty)
        t[f"{i}.0.linear.weight"].zero_()
        t[f"{i}.0.linear.bias"].zero_()
        t[f"{i}.1.weight"] = w.T.float().contiguous()
        xh, yh = x[train:].reshape(-1, x.shape[-1]), y[train:].reshape(-1)
        accuracy.append(float(((xh @ w).argmax(-1) == yh).double().mean()))
    save_file(t, str(heads / "medusa_lm_head.safetensors"))
    return heads, accuracy


def make_eagle1_head(target_dir: str | Path, out_dir: str | Path, num_layers: int = 1, seed: int = 0) -> Path:
    """A random EAGLE-1/2 head for the Llama checkpoint ``target_dir`` in the EAGLE repository's layout
    (``eagle/model/cnets1.py@c9292914``: ``Model`` with ``fc = Linear(2H, H, bias=True)``, ``embed_tokens`` and
    ``layers.{l}`` Llama decoder layers whose layer 0 has no ``input_layernorm``; ``ea_model.py@2320d52e`` loads the
    state dict from ``pytorch_model.bin`` with ``strict=True``, so the embedding, a copy of the target's, is stored).
    The config.json is the head's LlamaConfig (the target's shapes, ``num_hidden_layers`` of the head)."""
    tcfg = load_json(Path(target_dir) / "config.json")
    H, V = int(tcfg["hidden_size"]), int(tcfg["vocab_size"])
    nh, nkv = int(tcfg["num_attention_heads"]), int(tcfg.get("num_key_value_heads") or tcfg["num_attention_heads"])
    d = int(tcfg.get("head_dim") or H // nh)
    inter = int(tcfg["intermediate_size"])
    g = torch.Generator().manual_seed(seed)

    def w(o: int, i: int) -> torch.Tensor:
        return torch.randn(o, i, generator=g) / i**0.5

    emb = next(
        (
            v
            for k, v in load_file(str(Path(target_dir) / "model.safetensors")).items()
            if k.endswith("embed_tokens.weight")
        ),
        None,
    )
    t = {"fc.weight": w(H, 2 * H), "fc.bias": 0.1 * torch.randn(H, generator=g), "embed_tokens.weight": emb.float()}
    for i in range(num_layers):
        p = f"layers.{i}."
        t.update(
            {
                p + "self_attn.q_proj.weight": w(nh * d, H),
                p + "self_attn.k_proj.weight": w(nkv * d, H),
                p + "self_attn.v_proj.weight": w(nkv * d, H),
                p + "self_attn.o_proj.weight": w(H, nh * d),
                p + "mlp.gate_proj.weight": w(inter, H),
                p + "mlp.up_proj.weight": w(inter, H),
                p + "mlp.down_proj.weight": w(H, inter),
                p + "post_attention_layernorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
            }
        )
        if i > 0:
            t[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.contiguous() for k, v in t.items()}, out / "pytorch_model.bin")
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "bias": True,
        "hidden_act": "silu",
        "hidden_size": H,
        "intermediate_size": inter,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": d,
        "num_hidden_layers": num_layers,
        "max_position_embeddings": int(tcfg.get("max_position_embeddings") or 2048),
        "rms_norm_eps": float(tcfg.get("rms_norm_eps") or 1e-5),
        **{k: tcfg[k] for k in ("rope_parameters", "rope_theta", "rope_scaling") if k in tcfg},
        "vocab_size": V,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def fit_eagle1_head(
    target_dir: str | Path,
    out_dir: str | Path,
    samples: int = 256,
    tokens: int = 64,
    ridge: float = 1e-3,
    seed: int = 0,
) -> Path:
    """An EAGLE-1/2 head that drafts: :func:`make_eagle1_head`'s layout with the layers' outputs zeroed (``o_proj``,
    ``down_proj``: each layer is then the identity) and ``fc`` ridge-fitted to map [emb(t[j + 1]); f[j]] onto the
    target's next feature f[j + 1] (its final-normed output, which its lm_head reads), over ``samples`` sequences of
    ``tokens`` the target sampled itself from BOS. Linear, so it drafts only roughly; enough to be accepted."""
    from trtpipe.models.synthetic import load_hf

    out = make_eagle1_head(target_dir, out_dir, seed=seed)
    t = torch.load(out / "pytorch_model.bin", weights_only=True)
    torch.manual_seed(seed)
    hf = load_hf(target_dir)
    with torch.no_grad():
        seqs = self_sampled(hf, samples, tokens)
        f = hf.model(seqs).last_hidden_state.double()
    e = t["embed_tokens.weight"].double()[seqs[:, 1:-1]]  # emb(t[j + 1]) beside f[j], j = 0 .. n - 3
    x = torch.cat([e, f[:, :-2]], -1).reshape(-1, 2 * f.shape[-1])
    y = f[:, 1:-1].reshape(-1, f.shape[-1])
    x1 = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], -1)
    w = torch.linalg.solve(x1.T @ x1 + ridge * len(x1) * torch.eye(x1.shape[1], dtype=x.dtype), x1.T @ y)
    t["fc.weight"], t["fc.bias"] = w[:-1].T.float().contiguous(), w[-1].float().contiguous()
    for k in t:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            t[k] = torch.zeros_like(t[k])
    torch.save(t, out / "pytorch_model.bin")
    return out


def deepened_llama(src: str | Path, out: str | Path) -> Path:
    """A copy of the Llama checkpoint ``src`` deepened to 8 layers (its layers 2-4 repeated as 5-7): upstream's
    default EAGLE-3 capture layers (1, L/2 - 1, L - 4) need more than 5 (stories260k has 5)."""
    import shutil

    out = Path(out)
    shutil.copytree(src, out)
    cfg = load_json(out / "config.json")
    (out / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 8}))
    sd = load_file(str(out / "model.safetensors"))
    for new, old in ((5, 2), (6, 3), (7, 4)):
        for k in [k for k in sd if k.startswith(f"model.layers.{old}.")]:
            sd[k.replace(f"model.layers.{old}.", f"model.layers.{new}.")] = sd[k].clone()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def train_eagle3_head(
    target: str | Path, out: str | Path, steps: int, samples: int = 1024, tokens: int = 64, seed: int = 0
) -> tuple[Path, float, float]:
    """An EAGLE-3 head trained for ``steps`` Adam steps on ``samples`` sequences of ``tokens`` the 8-layer Llama
    ``target`` sampled itself from BOS (teacher forcing of the first draft only: input (t[j+1], the target's layers
    1, 3, 4 at j), label t[j+2], over a draft vocabulary of the target's most frequent tokens, 1/4 of its vocabulary
    as the published Llama-3.1 head keeps), saved in the published layout; returns its directory, the last training
    loss and the first-draft accuracy on the last 1/8 of the samples, held out."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    from trtpipe.models.synthetic import load_hf

    torch.manual_seed(seed)
    hf = load_hf(target)
    cfg = hf.config
    H, V, eps = cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps
    capture = (1, 3, 4)  # eagle3_capture_layers(8)
    with torch.no_grad():  # the target's own text
        seqs = self_sampled(hf, samples, tokens)
        hs = hf(seqs, output_hidden_states=True).hidden_states
        cap = torch.cat([hs[i + 1] for i in capture], -1)  # [B, T, 3H]
        emb = hf.model.embed_tokens(seqs)
    counts = torch.bincount(seqs.flatten(), minlength=V)
    dv = V // 4
    kept = counts.topk(dv).indices.sort().values
    t2d = torch.zeros(V, dtype=torch.bool).index_fill_(0, kept, True)
    to_draft = torch.full((V,), -100, dtype=torch.long).index_copy_(0, kept, torch.arange(dv))

    head = make_eagle3_head(target, out, seed=seed)  # the layout and config; its weights are the start
    hcfg = load_json(head / "config.json")
    hcfg["draft_vocab_size"] = dv
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
    train = seqs.shape[0] - seqs.shape[0] // 8
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
