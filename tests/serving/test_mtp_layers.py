"""Vanilla MTP: a checkpoint with two MTP layers, layer d drafting the (d + 1)-th token (trtpipe/serving/hidden_draft.py).

The checkpoint is a synthetic DeepSeek-V3 (transformers' own model class from the real config, shrunk) with
``num_nextn_predict_layers: 2``, each MTP layer a transformers DeepSeek-V3 decoder block of its own. Oracle for the
drafts: transformers in float64 evaluating upstream's chain (``MTPWorker.forward``,
``tensorrt_llm/_torch/speculative/mtp.py@000a01de``): layer 1 over (token j + 1, the target's hidden state j), layer
2 over the stream shifted by one, whose last hidden state is layer 1's output at the last position; tolerance
ORDER_FACTOR x the float32 error (tests/numerics.py). Greedy output is the output without speculation; the counters
equal a replay of the recorded drafts.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from numerics import assert_as_accurate, error_scale, hf_float64
from test_hidden_draft import _check_counters, _config, _prompts, _record, _rms, _serve
from trtpipe.errors import CheckpointError
from trtpipe.models.synthetic import load_hf, make_synthetic
from trtpipe.models.synthetic_heads import add_mtp_layers
from trtpipe.runtime.hf_loader import load_hf_checkpoint
from trtpipe.recipe.speculative import check_mtp_draft_len
from trtpipe.serving.hidden_draft import DRAFT_LAYER, load_mtp_head
from trtpipe.serving.reference_engine import draft_engine

LAYERS = 2


@pytest.fixture(scope="module")
def ckpt2(tmp_path_factory):
    """(checkpoint dir with two MTP layers, the twin's model, the block directories)."""
    root = tmp_path_factory.mktemp("mtp2")
    d = make_synthetic("deepseek_v3", root / "ds", seed=3)
    blocks = [
        make_synthetic("deepseek_v3", root / f"blk{i}", seed=5 + i, num_hidden_layers=1, first_k_dense_replace=0)
        for i in range(LAYERS)
    ]
    add_mtp_layers(d, blocks, seed=6)
    return d, load_hf_checkpoint(d), blocks


@pytest.fixture(scope="module")
def mtp2(ckpt2):
    """(checkpoint dir, the twin's model, HF main 32/64, [(block 32, block 64, tensors)] per layer)."""
    d, model, blocks = ckpt2
    n = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    stored = load_file(str(d / "model.safetensors"))
    main = load_hf(d)
    per_layer = []
    for i, b in enumerate(blocks):
        pre = f"model.layers.{n + i}."
        t = {k[len(pre) :]: v for k, v in stored.items() if k.startswith(pre)}
        block = load_hf(b)
        with torch.no_grad():  # the block model's final norm and head are the MTP layer's shared_head
            block.model.norm.weight.copy_(t["shared_head.norm.weight"])
            block.lm_head.weight.copy_(t["shared_head.head.weight"])
        per_layer.append((block, hf_float64(block), t))
    return d, model, main, hf_float64(main), per_layer


@torch.no_grad()
def _vanilla_oracle(main, blocks, ts, tokens: list[int], d1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of layer 1's draft (after ``tokens``) and layer 2's (after ``d1``), transformers in the models' dtype.

    x^m_j = eh_proj_m([enorm_m(emb(s[j + m])); hnorm_m(G[j + m - 1])]) over positions j = 0..n-2, s = tokens + [d1],
    G = the target's normed outputs H_0..H_{n-2} then layer 1's output at the last position."""
    dt, eps = main.dtype, main.config.rms_norm_eps
    n = len(tokens)
    H = main.model(torch.tensor([tokens[:-1]])).last_hidden_state  # [1, n-1, H]
    emb = main.model.embed_tokens(torch.tensor([tokens + [d1]]))  # s_0..s_n

    def x(t, e, h):
        cat = torch.cat([_rms(e, t["enorm.weight"], eps), _rms(h, t["hnorm.weight"], eps)], -1)
        return cat @ t["eh_proj.weight"].to(dt).T

    (b1, t1), (b2, t2) = blocks
    out1 = b1.model(inputs_embeds=x(t1, emb[:, 1:n], H)).last_hidden_state
    G = torch.cat([H[:, 1:], out1[:, -1:]], 1)  # G_1..G_{n-1}
    out2 = b2.model(inputs_embeds=x(t2, emb[:, 2 : n + 1], G)).last_hidden_state
    return b1.lm_head(out1[0, -1]), b2.lm_head(out2[0, -1])


def _check_vanilla_drafts(calls, full: dict[int, list[int]], oracle, limit: int) -> int:
    """Each round's layer-1 row and layer-2 row (consecutive recorded forwards of depth 0 and 1) against the oracle."""
    checked = 0
    for (e0, l0, d0), (e1, l1, d1) in zip(calls, calls[1:]):
        if (d0, d1) != (0, 1):
            continue
        second = {rid: row for (rid, *_), row in zip(e1, l1)}
        for (rid, toks, start, _), row in zip(e0, l0):
            if rid not in second or checked >= limit:
                continue
            seq = full[rid][: start + len(toks) + 1]
            first = int(row.argmax())
            (a64, b64), (a32, b32) = oracle(seq, first, True), oracle(seq, first, False)
            assert_as_accurate(row, a64, error_scale(a32, a64), f"request {rid}: layer 1 after {len(seq)}")
            assert_as_accurate(second[rid], b64, error_scale(b32, b64), f"request {rid}: layer 2 after {len(seq)}")
            checked += 1
    return checked


@pytest.mark.slow
def test_two_mtp_layers_draft_as_float64_and_keep_greedy_output(mtp2, monkeypatch):
    d, model, main32, main64, per_layer = mtp2
    prompts = _prompts(4, seed=7)
    plain, _ = _serve(model, _config(), prompts)
    calls = _record(monkeypatch)
    cfg = _config(speculative_decoding_type="MTP", max_draft_len=LAYERS)
    head = draft_engine(cfg, model, d)
    assert head.vanilla and len(head.layers) == LAYERS
    spec, core = _serve(model, cfg, prompts, head)
    full = {}
    for rid, (p, a, b) in enumerate(zip(prompts, plain, spec), start=1):
        assert not b.has_error, b.error
        assert b.tokens == a.tokens  # the drafts change nothing in greedy output
        full[rid] = p + b.tokens
    assert {depth for *_, depth in calls} == {0, 1}  # each round runs layer 1 then layer 2

    def oracle(seq, d1, f64):
        blocks = [(b64 if f64 else b32, t) for b32, b64, t in per_layer]
        return _vanilla_oracle(main64 if f64 else main32, blocks, None, seq, d1)

    assert _check_vanilla_drafts(calls, full, oracle, limit=6) == 6
    _check_counters(calls, full, spec, core)
    # each MTP layer's KV is its own extra layer of the target's pool
    keys = {k[1] for k in core.engine.pools if k[0] == DRAFT_LAYER}
    assert keys == {model.args.num_layers + i for i in range(LAYERS)}


@pytest.mark.slow
def test_fewer_drafts_than_layers_run_the_first_layers(ckpt2):
    """max_draft_len 1 on a two-layer checkpoint drafts with layer 1 only (upstream's loop runs
    mtp_layers[:max_draft_len]); the output is still the output without speculation."""
    d, model, _ = ckpt2
    prompts = _prompts(3, seed=9)
    plain, _ = _serve(model, _config(), prompts)
    cfg = _config(speculative_decoding_type="MTP", max_draft_len=1)
    spec, core = _serve(model, cfg, prompts, draft_engine(cfg, model, d))
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    s = core.speculator
    assert s.total_draft_tokens == s.verifications > 0  # one draft per verification


def test_more_drafts_than_mtp_layers_are_refused_in_one_line(tmp_path):
    """Checked from config.json before any layer loads (the recipe rule says the same at validate)."""
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 3, "num_nextn_predict_layers": 2}))
    with pytest.raises(CheckpointError, match=r"^speculative.max_draft_len 3 drafts need 3 MTP layers: .*<= 2$"):
        load_mtp_head(tmp_path, None, 3)
    assert check_mtp_draft_len(1, 5) is None  # one layer (MTP-Eagle) is reused for any draft length
    assert check_mtp_draft_len(2, 2) is None
