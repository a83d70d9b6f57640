"""EAGLE-1/2 heads in the executor (trtpipe/serving/eagle1.py) on stories260k.

Oracle for the drafts: the draft logits the executor's head computes (its catch-up forward and the next draft step,
recorded as they happen, as tests/serving/test_hidden_draft.py records EAGLE-3's) against a float64 evaluation built
from transformers' own ``LlamaDecoderLayer`` with its ``input_layernorm`` removed (``cnets1.py``'s layer 0), over
``fc([emb(t[j + 1]); f[j]])`` with ``f`` transformers' float64 final-normed output of the target, and the target's
lm_head; the tolerance is ORDER_FACTOR x the same evaluation's float32 error (tests/numerics.py). Greedy output with
the head equals the output without it and transformers' float64 greedy, token for token; the acceptance counters
equal a replay of the recorded drafts. The head is random (trtpipe.models.synthetic_heads.make_eagle1_head): what it
accepts is measured, not asserted.
"""

from __future__ import annotations

import json

import pytest
import torch

from numerics import hf_float64
from serving_oracle import check_greedy
from test_hidden_draft import _check_counters, _check_drafts, _config, _prompts, _record, _serve
from trtpipe.errors import CheckpointError
from trtpipe.models.synthetic import load_hf
from trtpipe.models.synthetic_heads import make_eagle1_head
from trtpipe.runtime.hf_loader import load_hf_checkpoint
from trtpipe.serving.eagle1 import Eagle1Head, load_eagle1_head
from trtpipe.serving.reference_engine import draft_engine

K = 3
EOS = 2


@pytest.fixture(scope="module")
def eagle1(tmp_path_factory, stories_dir):
    """(head dir, the twin's target, HF float32, HF float64, head tensors, head config) for a 2-layer random head
    (layer 1 has its input_layernorm, layer 0 none)."""
    head = make_eagle1_head(stories_dir, tmp_path_factory.mktemp("eagle1") / "head", num_layers=2, seed=5)
    hf = load_hf(stories_dir)
    t = torch.load(head / "pytorch_model.bin", weights_only=True)
    return head, load_hf_checkpoint(stories_dir), hf, hf_float64(hf), t, json.loads((head / "config.json").read_text())


@torch.no_grad()
def eagle1_oracle(hf, t: dict, cfg: dict, tokens: list[int], d1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's first draft logits after ``tokens`` and its second after ``d1``, by cnets1.py's formula in
    ``hf``'s dtype: transformers' LlamaDecoderLayer (layer 0 without input_layernorm), the target's normed output
    from transformers, the target's lm_head."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    dt = hf.dtype
    lc = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "bias")})
    lc._attn_implementation = "eager"
    layers = []
    for i in range(cfg["num_hidden_layers"]):
        layer = LlamaDecoderLayer(lc, i).to(dt)
        sd = {k[len(f"layers.{i}.") :]: v.to(dt) for k, v in t.items() if k.startswith(f"layers.{i}.")}
        if i == 0:
            layer.input_layernorm = torch.nn.Identity()
        layer.load_state_dict(sd, strict=True)
        layers.append(layer)
    rope = LlamaRotaryEmbedding(lc).to(dt)
    fc_w, fc_b, E = t["fc.weight"].to(dt), t["fc.bias"].to(dt), t["embed_tokens.weight"].to(dt)
    feats = hf.model(torch.tensor([tokens[:-1]])).last_hidden_state  # the target's normed output
    emb = E[torch.tensor([tokens[1:] + [d1]])]

    def run(x):
        n = x.shape[1]
        pos = torch.arange(n)[None]
        cos_sin = rope(x, pos)
        mask = torch.full((n, n), float("-inf"), dtype=dt).triu(1)[None, None]
        for layer in layers:
            out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
            x = out[0] if isinstance(out, tuple) else out
        return x

    X = torch.cat([emb[:, :-1], feats], -1) @ fc_w.T + fc_b
    out = run(X)
    X2 = torch.cat([X, torch.cat([emb[:, -1:], out[:, -1:]], -1) @ fc_w.T + fc_b], 1)
    out2 = run(X2)
    return hf.lm_head(out[0, -1]), hf.lm_head(out2[0, -1])


@pytest.mark.slow
def test_eagle1_drafts_as_float64_and_greedy_unchanged(eagle1, stories_dir, monkeypatch):
    head, model, hf32, hf64, t, cfg_head = eagle1
    prompts = _prompts(4, seed=8)
    plain, _ = _serve(model, _config(), prompts, n=24)
    calls = _record(monkeypatch)
    cfg = _config(speculative_decoding_type="Eagle", max_draft_len=K, speculative_model=str(head))
    drafter = draft_engine(cfg, model, stories_dir)
    assert isinstance(drafter, Eagle1Head)
    spec, core = _serve(model, cfg, prompts, drafter, n=24)
    full = {}
    for rid, (p, a, b) in enumerate(zip(prompts, plain, spec), start=1):
        assert not b.has_error, b.error
        assert b.tokens == a.tokens  # the drafts change nothing in greedy output
        assert check_greedy(model, hf64, p, b.tokens, 24, EOS) == ""  # and it is transformers' float64 greedy
        full[rid] = p + b.tokens

    def oracle(seq, d1, f64):
        return eagle1_oracle(hf64 if f64 else hf32, t, cfg_head, seq, d1)

    assert _check_drafts(calls, full, oracle, limit=6) == 6
    _check_counters(calls, full, spec, core)
    s = core.speculator
    print(f"random EAGLE-1 head: {s.total_accepted_draft_tokens} of {s.total_draft_tokens} drafts accepted")


def test_a_head_that_does_not_fit_the_target_is_refused_in_one_line(eagle1, tmp_path):
    head, model, *_ = eagle1
    t = torch.load(head / "pytorch_model.bin", weights_only=True)
    cfg = json.loads((head / "config.json").read_text())

    def write(name, tensors, config):
        d = tmp_path / name
        d.mkdir()
        torch.save(tensors, d / "pytorch_model.bin")
        (d / "config.json").write_text(json.dumps(config))
        return d

    cases = {
        "fc": ({k: v for k, v in t.items() if k != "fc.bias"}, cfg, "tensor 'fc.bias' is missing"),
        "layer": (
            {k: v for k, v in t.items() if k != "layers.1.input_layernorm.weight"},
            cfg,
            "tensor 'layers.1.input_layernorm.weight' is missing",
        ),
        "vocab": (t, {**cfg, "vocab_size": cfg["vocab_size"] + 1}, "vocab_size .* differs from the target's"),
        "width": (t, {**cfg, "hidden_size": cfg["hidden_size"] * 2}, "hidden_size .* differs from the target's"),
    }
    for name, (tensors, config, why) in cases.items():
        with pytest.raises(CheckpointError, match=why) as e:
            load_eagle1_head(write(name, tensors, config), model)
        assert "\n" not in str(e.value)
