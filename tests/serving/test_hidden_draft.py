"""MTP and EAGLE-3 drafting in the executor (trtpipe/serving/hidden_draft.py).

Oracle for the drafts: the draft logits the executor's head computes (its catch-up forward and the next draft step,
recorded as they happen) against an independent float64 evaluation of the same formula: transformers' own decoder
block (DeepSeek-V3's, for MTP) or attention (Llama's, for EAGLE-3) in float64, with the target's hidden states from
transformers in float64; the tolerance is ORDER_FACTOR x the same evaluation's float32 error (tests/numerics.py).
Greedy output with either head is the output without speculation, token for token; the acceptance counters equal a
replay of the recorded drafts against the output. The heads are random (trtpipe.models.synthetic_heads): what they
accept is measured, not asserted.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from numerics import assert_as_accurate, error_scale, hf_float64
from trtpipe.errors import CheckpointError
from trtpipe.models.synthetic import load_hf, make_synthetic
from trtpipe.models.synthetic_heads import add_mtp_layer, make_eagle3_head
from trtpipe.runtime.hf_loader import load_hf_checkpoint
from trtpipe.serving.api import CapacityPolicy, ExecutorConfig, Request
from trtpipe.serving.executor import ExecutorCore
from trtpipe.serving.hidden_draft import HiddenDrafter, eagle3_capture_layers
from trtpipe.serving.kv_pool import BlockPool
from trtpipe.serving.reference_engine import ReferenceEngine, draft_engine

K = 3


@pytest.fixture(scope="module")
def mtp(tmp_path_factory):
    """(checkpoint dir with its MTP layer, the twin's model, HF main float32/float64, HF MTP block float32/float64,
    the MTP tensors)."""
    root = tmp_path_factory.mktemp("mtp")
    d = make_synthetic("deepseek_v3", root / "ds", seed=3)
    blk = make_synthetic("deepseek_v3", root / "blk", seed=5, num_hidden_layers=1, first_k_dense_replace=0)
    add_mtp_layer(d, blk, seed=6)
    t = {
        k[len("model.layers.3.") :]: v for k, v in load_file(str(d / "model.safetensors")).items() if ".layers.3." in k
    }
    main, block = load_hf(d), load_hf(blk)
    with torch.no_grad():  # the block model's final norm and head are the MTP layer's shared_head
        block.model.norm.weight.copy_(t["shared_head.norm.weight"])
        block.lm_head.weight.copy_(t["shared_head.head.weight"])
    return d, load_hf_checkpoint(d), main, hf_float64(main), block, hf_float64(block), t


@pytest.fixture(scope="module")
def eagle(tmp_path_factory):
    """(target dir: a synthetic Llama-3 of 8 layers, head dir, the twin's target, HF float32/float64, head tensors)."""
    root = tmp_path_factory.mktemp("eagle3")
    d = make_synthetic("llama3", root / "llama", seed=1, num_hidden_layers=8)
    head = make_eagle3_head(d, root / "head", seed=2)
    hf = load_hf(d)
    return d, head, load_hf_checkpoint(d), hf, hf_float64(hf), load_file(str(head / "model.safetensors"))


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.to(x.dtype)


@torch.no_grad()
def _mtp_oracle(main, block, t, tokens: list[int], d1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the first draft (after ``tokens``) and of the second (after ``d1``), transformers in the models'
    dtype: x_j = eh_proj([enorm(emb(t[j+1])); hnorm(H_j)]), H the target's normed output, through the block model
    (its layer, then shared_head.norm and the head); the second step reads the block's output at the last position."""
    dt, eps = main.dtype, main.config.rms_norm_eps
    H = main.model(torch.tensor([tokens[:-1]])).last_hidden_state
    emb = main.model.embed_tokens(torch.tensor([tokens[1:] + [d1]]))
    eh = t["eh_proj.weight"].to(dt)

    def x(e, h):
        return torch.cat([_rms(e, t["enorm.weight"], eps), _rms(h, t["hnorm.weight"], eps)], -1) @ eh.T

    X = x(emb[:, :-1], H)
    out = block.model(inputs_embeds=X).last_hidden_state
    X2 = torch.cat([X, x(emb[:, -1:], out[:, -1:])], 1)
    out2 = block.model(inputs_embeds=X2).last_hidden_state
    return block.lm_head(out[0, -1]), block.lm_head(out2[0, -1])


@torch.no_grad()
def _eagle3_oracle(hf, t, cfg: dict, tokens: list[int], d1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The EAGLE-3 head's draft logits by its formula: transformers' Llama attention (q/k/v over 2H inputs) and the
    target's hidden states after layers (1, L/2 - 1, L - 4) from transformers (hidden_states[i + 1])."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    dt, eps = hf.dtype, hf.config.rms_norm_eps
    Hd = cfg["hidden_size"]
    attn_cfg = LlamaConfig(**{**hf.config.to_dict(), "hidden_size": 2 * Hd, "head_dim": cfg["head_dim"]})
    attn_cfg._attn_implementation = "eager"
    attn = LlamaAttention(attn_cfg, 0).to(dt)
    attn.o_proj = torch.nn.Linear(cfg["num_attention_heads"] * cfg["head_dim"], Hd, bias=False).to(dt)
    for p in "qkvo":
        getattr(attn, f"{p}_proj").weight.copy_(t[f"midlayer.self_attn.{p}_proj.weight"])
    rope = LlamaRotaryEmbedding(LlamaConfig(**cfg)).to(dt)  # the head's own rope settings
    w = {k: v.to(dt) for k, v in t.items() if v.is_floating_point()}
    L = hf.config.num_hidden_layers
    hs = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
    cap = torch.cat([hs[i + 1] for i in eagle3_capture_layers(L)], -1)  # [1, N-1, 3H]
    emb_all = hf.model.embed_tokens(torch.tensor([tokens[1:] + [d1]]))

    def layer(emb, g):
        n = g.shape[1]
        pos = torch.arange(n)[None]
        cos, sin = rope(g, pos)
        h = torch.cat(
            [_rms(emb, w["midlayer.input_layernorm.weight"], eps), _rms(g, w["midlayer.hidden_norm.weight"], eps)], -1
        )
        mask = torch.full((n, n), float("-inf"), dtype=dt).triu(1)[None, None]
        a, _ = attn(h, (cos, sin), mask)
        x = g + a
        m = _rms(x, w["midlayer.post_attention_layernorm.weight"], eps)
        gate, up = m @ w["midlayer.mlp.gate_proj.weight"].T, m @ w["midlayer.mlp.up_proj.weight"].T
        return x + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T

    def logits(x):
        return _rms(x, w["norm.weight"], eps) @ w["lm_head.weight"].T

    g = cap @ w["fc.weight"].T
    x1 = layer(emb_all[:, :-1], g)
    x2 = layer(emb_all, torch.cat([g, x1[:, -1:]], 1))
    return logits(x1[0, -1]), logits(x2[0, -1])


def _prompts(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [
        [1] + torch.randint(3, 240, (int(m),), generator=g).tolist() for m in torch.randint(2, 14, (n,), generator=g)
    ]


def _serve(model, config, prompts, drafts=None, n=20):
    final = {}
    core = ExecutorCore(
        config,
        ReferenceEngine(model),
        lambda r: final.__setitem__(r.request_id, r) if r.is_final else None,
        draft_engine=drafts,
    )
    ids = [core.submit(Request(p, n, exclude_input_from_output=True, return_perf_metrics=True)) for p in prompts]
    core.run_until_idle()
    return [final[i] for i in ids], core


def _config(**kw):
    base = dict(
        max_batch_size=4, max_num_tokens=64, max_input_len=64, max_seq_len=128, num_blocks=64, tokens_per_block=8
    )
    return ExecutorConfig(**{**base, **kw})


def _record(monkeypatch):
    """Every head forward as it happens: (entries, their logit rows)."""
    calls = []
    original = HiddenDrafter._forward

    def spy(self, entries, hidden, depth=0):
        logits, nxt = original(self, entries, hidden, depth)
        calls.append(
            ([(e.request_id, list(e.tokens), e.start_pos, e.is_context) for e in entries], logits.clone(), depth)
        )
        return logits, nxt

    monkeypatch.setattr(HiddenDrafter, "_forward", spy)
    return calls


def _check_drafts(calls, full: dict[int, list[int]], oracle, limit: int) -> int:
    """Each catch-up forward's logits and the next step's, against ``oracle(tokens, d1)`` (float64, float32)."""
    checked = 0
    for i, (entries, logits, _) in enumerate(calls):
        if not entries[0][3] or i + 1 >= len(calls):
            continue
        nxt = {rid: (row, toks[0]) for (rid, toks, _, ctx), row in zip(calls[i + 1][0], calls[i + 1][1]) if not ctx}
        for (rid, toks, start, _), row in zip(entries, logits):
            if rid not in nxt or checked >= limit:
                continue
            seq = full[rid][: start + len(toks) + 1]
            second, d1 = nxt[rid]
            (r64a, r64b), (r32a, r32b) = oracle(seq, d1, True), oracle(seq, d1, False)
            assert_as_accurate(row, r64a, error_scale(r32a, r64a), f"request {rid}: first draft after {len(seq)}")
            assert_as_accurate(second, r64b, error_scale(r32b, r64b), f"request {rid}: second draft")
            checked += 1
    return checked


def _replayed_acceptance(calls, full: dict[int, list[int]]) -> dict[int, tuple[int, int]]:
    """(drafts, accepted) per request from the recorded drafts: the drafts of each step are the argmax chain of one
    catch-up and its next steps; accepted = the longest prefix equal to what the request then output."""
    drafts: dict[int, list[int]] = {}
    start: dict[int, int] = {}
    out: dict[int, list[int]] = {}
    for entries, logits, depth in calls:
        for (rid, toks, pos, ctx), row in zip(entries, logits):
            if ctx and depth == 0:  # a round's first forward (a vanilla MTP round's later layers are contexts too)
                if rid in drafts:
                    out.setdefault(rid, []).append((start[rid], drafts[rid]))
                drafts[rid], start[rid] = [], pos + len(toks) + 1
            drafts[rid].append(row)
    for rid in drafts:
        out.setdefault(rid, []).append((start[rid], drafts[rid]))
    result = {}
    for rid, steps in out.items():
        total = acc = 0
        for n, rows in steps:
            ds = [int(r.argmax()) for r in rows]
            total += len(ds)
            for j, dtok in enumerate(ds):
                if n + j >= len(full[rid]) or full[rid][n + j] != dtok:
                    break
                acc += 1
        result[rid] = (total, acc)
    return result


@pytest.mark.slow
def test_mtp_drafts_as_float64_and_greedy_unchanged(mtp, monkeypatch):
    d, model, main32, main64, blk32, blk64, t = mtp
    prompts = _prompts(4, seed=7)
    plain, _ = _serve(model, _config(), prompts)
    calls = _record(monkeypatch)
    cfg = _config(speculative_decoding_type="MTP", max_draft_len=K)
    spec, core = _serve(model, cfg, prompts, draft_engine(cfg, model, d))
    full = {}
    for rid, (p, a, b) in enumerate(zip(prompts, plain, spec), start=1):
        assert not b.has_error, b.error
        assert b.tokens == a.tokens  # the drafts change nothing in greedy output
        full[rid] = p + b.tokens

    def oracle(seq, d1, f64):
        return _mtp_oracle(main64 if f64 else main32, blk64 if f64 else blk32, t, seq, d1)

    assert _check_drafts(calls, full, oracle, limit=6) == 6
    _check_counters(calls, full, spec, core)


def _check_counters(calls, full, spec, core):
    s = core.speculator
    replay = _replayed_acceptance(calls, full)
    for rid, r in enumerate(spec, start=1):
        assert (r.perf.total_draft_tokens, r.perf.total_accepted_draft_tokens) == replay[rid]
    assert s.total_draft_tokens == sum(v[0] for v in replay.values()) > 0
    assert s.total_accepted_draft_tokens == sum(v[1] for v in replay.values())
    assert core.pool.stats().free_blocks == core.pool.stats().max_blocks
    assert s.draft.pool.num_free == s.draft.pool.num_blocks and not s.draft.state  # the head's KV came back


@pytest.mark.slow
def test_eagle3_drafts_as_float64_and_greedy_unchanged(eagle, monkeypatch):
    import json

    d, head, model, hf32, hf64, t = eagle
    cfg_head = json.loads((head / "config.json").read_text())
    prompts = _prompts(4, seed=8)
    plain, _ = _serve(model, _config(), prompts)
    calls = _record(monkeypatch)
    cfg = _config(speculative_decoding_type="Eagle3", max_draft_len=K, speculative_model=str(head))
    drafter = draft_engine(cfg, model, d)
    spec, core = _serve(model, cfg, prompts, drafter)
    full = {}
    for rid, (p, a, b) in enumerate(zip(prompts, plain, spec), start=1):
        assert not b.has_error, b.error
        assert b.tokens == a.tokens
        full[rid] = p + b.tokens

    def oracle(seq, d1, f64):
        return _eagle3_oracle(hf64 if f64 else hf32, t, cfg_head, seq, d1)

    # the recorded d1 is a target id: the oracle embeds it; the rows are over the draft vocabulary
    assert _check_drafts(calls, full, oracle, limit=6) == 6
    d2t = t["d2t"]
    for entries, logits, _ in calls:  # every draft is a target id through d2t
        assert logits.shape[-1] == len(d2t)
    _check_counters(_as_target(calls, d2t), full, spec, core)


def _as_target(calls, d2t):
    """The recorded rows re-indexed over the target vocabulary (target id d + d2t[d] holds draft logit d)."""
    out = []
    for entries, logits, depth in calls:
        V = int((torch.arange(len(d2t)) + d2t).max()) + 1
        full = torch.full((logits.shape[0], V), float("-inf"))
        full[:, torch.arange(len(d2t)) + d2t] = logits
        out.append((entries, full, depth))
    return out


def test_eagle3_capture_layers_are_upstreams_default():
    assert eagle3_capture_layers(32) == (1, 15, 28)  # Llama-3.1-8B
    assert eagle3_capture_layers(8) == (1, 3, 4)
    with pytest.raises(CheckpointError, match="more than 5 layers"):
        eagle3_capture_layers(5)


def test_a_checkpoint_without_mtp_layer_is_refused_in_one_line(tmp_path):
    import json

    d = make_synthetic("deepseek_v3", tmp_path / "ds", seed=3)
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, "num_nextn_predict_layers": 0}))
    model = load_hf_checkpoint(d)
    cfg = _config(speculative_decoding_type="MTP", max_draft_len=K)
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers is 0: no MTP layer to draft with"):
        draft_engine(cfg, model, d)


@pytest.mark.slow
def test_eagle3_sampled_drafts_carry_their_distribution_over_the_target_vocabulary(eagle, monkeypatch):
    """Under sampling each draft comes with the distribution it was drawn from, over the target's ids (draft id d
    at d + d2t[d]): what rejection sampling (speculative.verify, tested for any q) needs to keep the target's law."""
    from trtpipe.serving.api import SamplingParams
    from trtpipe.serving.speculative import Speculator

    d, head, model, *_ = eagle
    t2d = load_file(str(head / "model.safetensors"))["t2d"]
    seen = []
    original = Speculator.propose

    def spy(self, requests):
        out = original(self, requests)
        seen.extend(out.values())
        return out

    monkeypatch.setattr(Speculator, "propose", spy)
    cfg = _config(speculative_decoding_type="Eagle3", max_draft_len=K, speculative_model=str(head))
    final = {}
    core = ExecutorCore(
        cfg,
        ReferenceEngine(model),
        lambda r: final.__setitem__(r.request_id, r) if r.is_final else None,
        draft_engine=draft_engine(cfg, model, d),
    )
    for i, p in enumerate(_prompts(4, seed=9)):
        core.submit(Request(p, 12, sampling=SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=i)))
    core.run_until_idle()
    assert all(not r.has_error for r in final.values()) and len(final) == 4
    assert seen
    for drafts, q in seen:
        assert q is not None and q.shape == (len(drafts), len(t2d))
        torch.testing.assert_close(q.sum(-1), torch.ones(len(drafts), dtype=q.dtype))
        assert float(q[:, ~t2d].abs().max()) == 0.0  # no mass outside the draft vocabulary's target ids
        assert all(bool(t2d[tok]) and float(q[i, tok]) > 0 for i, tok in enumerate(drafts))


@pytest.mark.slow
@pytest.mark.parametrize(
    "knobs",
    [
        dict(enable_chunked_context=True, max_num_tokens=16),  # prompts in chunks: the head reads every chunk's rows
        dict(capacity_policy=CapacityPolicy.MAX_UTILIZATION, num_blocks=16, max_seq_len=48),  # pauses recompute
    ],
    ids=["chunked-context", "max-utilization-pauses"],
)
def test_mtp_through_chunks_and_pauses_keeps_greedy_output(mtp, knobs):
    """Chunked prompts and MAX_UTILIZATION pauses (KV dropped, prompt + output recomputed) reach the head as any step
    does; the output stays the output without speculation and the head's blocks all come back."""
    d, model, *_ = mtp
    g = torch.Generator().manual_seed(11)
    prompts = [[1] + torch.randint(3, 240, (int(m),), generator=g).tolist() for m in (18, 25, 9, 30)]
    plain, _ = _serve(model, _config(**knobs), prompts, n=16)
    cfg = _config(speculative_decoding_type="MTP", max_draft_len=K, **knobs)
    spec, core = _serve(model, cfg, prompts, draft_engine(cfg, model, d), n=16)
    for a, b in zip(plain, spec):
        assert not b.has_error, b.error
        assert b.tokens == a.tokens
    s = core.speculator
    assert s.total_draft_tokens > 0
    assert s.draft.pool.num_free == s.draft.pool.num_blocks and not s.draft.state
    if "capacity_policy" in knobs:  # the pool is small enough that requests were paused and recomputed
        assert sum(it.num_paused for it in core.iterations) > 0


def _fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block FP8: codes and ``weight_scale_inv`` (block amax / 448, one per block x block tile)."""
    out_f, in_f = w.shape
    s = torch.ones(-(-out_f // block), -(-in_f // block))
    for r in range(s.shape[0]):
        for c in range(s.shape[1]):
            amax = w[r * block : (r + 1) * block, c * block : (c + 1) * block].abs().max().float()
            s[r, c] = amax / 448.0 if amax > 0 else 1.0
    full = s.repeat_interleave(block, 0)[:out_f].repeat_interleave(block, 1)[:, :in_f]
    return (w.float() / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), s


@pytest.mark.slow
def test_mtp_on_a_block_fp8_checkpoint_as_deepseek_ships_it(mtp, tmp_path):
    """Every decoder projection and the MTP layer's (eh_proj included) stored block-FP8: the head's projections run
    as the layer's own (dequantized codes, FP8 activations), and the output is still the output without MTP."""
    import json

    from trtpipe.runtime.linear import Float32Linear

    src = mtp[0]
    tensors = load_file(str(src / "model.safetensors"))
    for k in [k for k in tensors if ".layers." in k and k.endswith(("_proj.weight", "_proj_with_mqa.weight"))]:
        tensors[k], tensors[k[: -len("weight")] + "weight_scale_inv"] = _fp8_blocks(tensors[k])
    d = tmp_path / "fp8"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": q}))
    model = load_hf_checkpoint(d)
    cfg = _config(speculative_decoding_type="MTP", max_draft_len=K)
    head = draft_engine(cfg, model, d)
    assert not isinstance(head.eh_proj, Float32Linear)  # built from the stored FP8 codes and scales
    prompts = _prompts(3, seed=12)
    plain, _ = _serve(model, _config(), prompts)
    spec, core = _serve(model, cfg, prompts, head)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert core.speculator.total_draft_tokens > 0


def test_a_target_without_its_hidden_states_is_refused_in_one_line(eagle):
    """The heads read the target's hidden states where the executor runs: an engine whose hidden states are on other
    ranks (mpirun ranks at pp 2: rank 0 holds only its stage's layers) or a LoRA-wrapped one is refused when the
    executor is built, not left to draft nothing (pp 1 ranks: tests/serving/mpi/test_heads_tp2.py)."""
    from trtpipe.runtime.distributed import RankLayout
    from trtpipe.serving.mpi_engine import RankEngine

    d, head, model, *_ = eagle
    cfg = _config(speculative_decoding_type="Eagle3", max_draft_len=K, speculative_model=str(head))
    drafter = draft_engine(cfg, model, d)
    staged = RankEngine.__new__(RankEngine)
    staged.model = type("M", (), {"layout": RankLayout(1, 2, 0), "args": model.args})()
    for engine in (staged, object()):
        with pytest.raises(ValueError, match="reads the target's hidden states"):
            drafter.drafter(engine, BlockPool(8, 8))
