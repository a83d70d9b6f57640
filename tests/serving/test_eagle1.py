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
from trtpipe.models.synthetic_heads import fit_eagle1_head, make_eagle1_head
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


@pytest.fixture(scope="module")
def fitted(stories_dir, tmp_path_factory):
    """A head that drafts (trtpipe.models.synthetic_heads.fit_eagle1_head: fc ridge-fitted on the target's own text,
    the layers' outputs zeroed), so the counters and the tree's KV moves see accepted drafts: (dir, tensors)."""
    head = fit_eagle1_head(stories_dir, tmp_path_factory.mktemp("eagle1-fitted") / "head", samples=128)
    return head, torch.load(head / "pytorch_model.bin", weights_only=True)


@torch.no_grad()
def path_logits(hf, t: dict, cfg: dict, tokens: list[int], path: list[int]) -> list[torch.Tensor]:
    """The head's draft logits after ``tokens`` and after each prefix of the drafted ``path``, by cnets1.py's formula
    in ``hf``'s dtype: transformers' LlamaDecoderLayer (layer 0 without input_layernorm), the target's normed output
    from transformers, the target's lm_head; each draft reads its token and the head's output at the one before."""
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
    emb = E[torch.tensor([tokens[1:] + list(path)])]

    def run(x):
        n = x.shape[1]
        pos = torch.arange(n)[None]
        cos_sin = rope(x, pos)
        mask = torch.full((n, n), float("-inf"), dtype=dt).triu(1)[None, None]
        for layer in layers:
            out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
            x = out[0] if isinstance(out, tuple) else out
        return x

    m = len(tokens) - 1
    X = torch.cat([emb[:, :m], feats], -1) @ fc_w.T + fc_b
    out = run(X)
    logits = [hf.lm_head(out[0, -1])]
    for i in range(len(path)):
        X = torch.cat([X, torch.cat([emb[:, m + i : m + i + 1], out[:, -1:]], -1) @ fc_w.T + fc_b], 1)
        out = run(X)
        logits.append(hf.lm_head(out[0, -1]))
    return logits


def eagle1_oracle(hf, t, cfg, tokens, d1):
    first, second = path_logits(hf, t, cfg, tokens, [d1])
    return first, second


def _head(kind, eagle1, fitted):
    """``random``: the random 2-layer head (layer 1 with its input_layernorm: every part of the formula); ``fitted``:
    the ridge-fitted head, whose drafts are accepted."""
    return (eagle1[0], eagle1[4]) if kind == "random" else fitted


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["random", "fitted"])
def test_eagle1_drafts_as_float64_and_greedy_unchanged(kind, eagle1, fitted, stories_dir, monkeypatch):
    _, model, hf32, hf64, *_ = eagle1
    head, t = _head(kind, eagle1, fitted)
    cfg_head = json.loads((head / "config.json").read_text())
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
    if kind == "fitted":  # its drafts are accepted: the replay is not all zeros
        assert s.total_accepted_draft_tokens > 0
    print(f"{kind} EAGLE-1 head: {s.total_accepted_draft_tokens} of {s.total_draft_tokens} drafts accepted")


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


TREE = [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0]]  # siblings at depths 1 and 2


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["random", "fitted"])
def test_an_eagle_tree_drafts_as_float64_keeps_greedy_output_and_counts_its_longest_path(
    kind, eagle1, fitted, stories_dir, monkeypatch
):
    """eagle_choices with siblings: each node's logits (a level forward over the non-leaf nodes with the tree mask)
    equal the float64 chain along its path; the target verifies the tree (tree_verify) and greedy output is unchanged
    and transformers' float64 greedy; the counters equal a replay of the longest matching path of each tree."""
    from numerics import assert_as_accurate, error_scale

    from trtpipe.recipe.medusa import braces
    from trtpipe.serving.eagle1 import Eagle1TreeDrafter
    from trtpipe.serving.tree_verify import parents_from_mask, paths_from_parents

    _, model, hf32, hf64, *_ = eagle1
    head, t = _head(kind, eagle1, fitted)
    cfg_head = json.loads((head / "config.json").read_text())
    prompts = _prompts(4, seed=9)
    plain, _ = _serve(model, _config(), prompts, n=24)
    calls = _record(monkeypatch)
    proposals = []
    original = Eagle1TreeDrafter.propose

    def spy(self, requests, ks):
        out = original(self, requests, ks)
        for r in requests:
            if r.id in out:
                drafts, _, fields = out[r.id]
                proposals.append((r.id, len(r.tokens), drafts, parents_from_mask(fields["spec_mask"])))
        return out

    monkeypatch.setattr(Eagle1TreeDrafter, "propose", spy)
    k = len(TREE)
    cfg = _config(
        speculative_decoding_type="Eagle", max_draft_len=k, speculative_model=str(head), eagle_choices=braces(TREE)
    )
    drafter = draft_engine(cfg, model, stories_dir)
    assert drafter.tree == sorted(TREE, key=lambda c: (len(c), c))
    spec, core = _serve(model, cfg, prompts, drafter, n=24)
    full = {}
    for rid, (p, a, b) in enumerate(zip(prompts, plain, spec), start=1):
        assert not b.has_error, b.error
        assert b.tokens == a.tokens
        assert check_greedy(model, hf64, p, b.tokens, 24, EOS) == ""
        full[rid] = p + b.tokens
    checked = 0
    for entries, rows, *_ in calls:  # the level forwards: masked entries, one row per non-leaf node
        if checked >= 6 or entries[0][3]:
            continue
        for rid, toks, start, _ in entries:
            seq = full[rid][: start + 1]
            prop = next(p for p in proposals if p[0] == rid and p[1] == start + 1)
            parents, drafts = prop[3], prop[2]
            for i, tok in enumerate(toks):  # the node's path: its ancestors' tokens then its own
                node = drafts.index(tok) + 1 if drafts.count(tok) == 1 else None
                if node is None:
                    continue
                path, j = [], node
                while j > 0:
                    path.insert(0, drafts[j - 1])
                    j = parents[j]
                r64, r32 = path_logits(hf64, t, cfg_head, seq, path)[-1], path_logits(hf32, t, cfg_head, seq, path)[-1]
                assert_as_accurate(rows[i], r64, error_scale(r32, r64), f"request {rid}: node {path} after {len(seq)}")
                checked += 1
            break
    assert checked >= 6
    drafted = {rid: 0 for rid in full}
    accepted = {rid: 0 for rid in full}
    for rid, n, drafts, parents in proposals:  # replay: the longest path of the tree the output followed
        drafted[rid] += len(drafts)
        best = 0
        for path in paths_from_parents(parents):
            m = 0
            for node in path:
                if n + m >= len(full[rid]) or full[rid][n + m] != drafts[node - 1]:
                    break
                m += 1
            best = max(best, m)
        accepted[rid] += best
    for rid, r in enumerate(spec, start=1):
        assert (r.perf.total_draft_tokens, r.perf.total_accepted_draft_tokens) == (drafted[rid], accepted[rid])
    s = core.speculator
    assert s.total_draft_tokens == sum(drafted.values()) > 0
    assert s.total_accepted_draft_tokens == sum(accepted.values())
    assert s.total_accepted_draft_tokens > 0 or kind == "random"  # the fitted head's drafts are accepted
    assert core.pool.stats().free_blocks == core.pool.stats().max_blocks
    assert s.draft.pool.num_free == s.draft.pool.num_blocks and not s.draft.state
    print(f"{kind} EAGLE-1 head, tree of {k}: {s.total_accepted_draft_tokens} of {s.total_draft_tokens} accepted")


def test_triton_eagle_choices_must_be_what_the_executor_drafts():
    from trtpipe.serving.medusa import check_choices
    from trtpipe.serving.eagle1 import parse_tree

    chain = _config(speculative_decoding_type="Eagle", max_draft_len=2)
    check_choices("{0}, {0, 0}", chain, "eagle_choices")
    tree = _config(speculative_decoding_type="Eagle", max_draft_len=3, eagle_choices="{0}, {1}, {0, 0}")
    check_choices("{1}, {0}, {0, 0}", tree, "eagle_choices")  # the same tree in another order
    for cfg, bad in ((chain, "{0}, {1}"), (tree, "{0}, {1}, {1, 0}"), (tree, "{0}, {0, 0}, {0, 0, 0}")):
        with pytest.raises(ValueError, match=r"^tensorrt_llm twin: eagle_choices .*speculative.eagle_choices") as e:
            check_choices(bad, cfg, "eagle_choices")
        assert "\n" not in str(e.value)
    assert parse_tree("{0}, {0, 0}", 2) is None and parse_tree("", 3) is None  # the chain: HiddenDrafter's
    assert parse_tree("{1}, {0}, {0, 0}", 3) == [[0], [1], [0, 0]]
    with pytest.raises(ValueError, match="choice \\[0, 0, 0\\] is not connected"):
        parse_tree("{0}, {0, 0, 0}", 2)
    with pytest.raises(ValueError, match="3 draft tokens, but max_draft_len is 4"):
        parse_tree("{0}, {1}, {0, 0}", 4)


TREE_SAMPLED = [[0], [1], [2], [0, 0]]  # siblings at depth 1; 6 tokens leave room for the whole tree


def check_tree_sampling(model, hf64, kind: str, head, source, label: str) -> None:
    """2,000 seeded requests of 6 tokens under sampling through the 4-node tree ``TREE_SAMPLED`` drafted by ``kind``
    ("Eagle", "Eagle3") with ``head``: token 2 is the first a tree verification emits (the target's draw at the
    root, kept when a depth-1 node holds it: tree_verify.sampled_accept); its counts against the float64 marginal
    sum_x p(x | prompt) p(. | prompt, x), chi-square as tests/serving/test_speculative.py does."""
    from test_speculative import ALPHA, _chi2

    from trtpipe.recipe.medusa import braces
    from trtpipe.serving.api import Request, SamplingParams
    from trtpipe.serving.executor import ExecutorCore
    from trtpipe.serving.reference_engine import ReferenceEngine
    from trtpipe.serving.speculative import sampling_probs

    prompt = [1, 403, 407, 261, 378]
    s = SamplingParams(temperature=1.0, top_k=20)
    with torch.no_grad():
        p1 = sampling_probs(hf64(torch.tensor([prompt])).logits[0, -1], s)
        support = p1.nonzero().flatten().tolist()
        rows = hf64(torch.tensor([prompt + [x] for x in support])).logits[:, -1]
        marginal = (p1[support, None] * sampling_probs(rows, s)).sum(0)
    cfg = _config(
        speculative_decoding_type=kind,
        max_draft_len=len(TREE_SAMPLED),
        speculative_model=str(head),
        eagle_choices=braces(TREE_SAMPLED),
        max_batch_size=8,
        num_blocks=128,
    )
    n = 2000
    final = {}
    core = ExecutorCore(
        cfg,
        ReferenceEngine(model),
        lambda r: final.__setitem__(r.request_id, r) if r.is_final else None,
        draft_engine=draft_engine(cfg, model, source),
    )
    for i in range(n):
        core.submit(Request(prompt, 6, exclude_input_from_output=True, sampling=SamplingParams(1.0, 20, 1.0, seed=i)))
    core.run_until_idle()
    assert len(final) == n and all(not r.has_error for r in final.values())
    counts = torch.zeros(marginal.numel())
    for r in final.values():
        counts[r.tokens[1]] += 1
    sp = core.speculator
    pv = _chi2(counts, marginal)
    print(
        f"{label} tree sampling: {sp.total_accepted_draft_tokens} of {sp.total_draft_tokens} drafts accepted; "
        f"chi-square p = {pv:.3g}"
    )
    assert sp.total_draft_tokens >= 4 * n  # the first verification drafts the whole tree
    assert sp.total_accepted_draft_tokens > 0 and pv > ALPHA, f"chi-square p = {pv:.3g}"


@pytest.mark.slow
def test_sampled_output_distribution_unchanged_with_an_eagle_tree(eagle1, fitted, stories_dir):
    """The output distribution under sampling through an EAGLE-1 tree (:func:`check_tree_sampling`)."""
    _, model, _, hf64, *_ = eagle1
    head, _ = fitted
    check_tree_sampling(model, hf64, "Eagle", head, stories_dir, "EAGLE")


@pytest.mark.slow
def test_eagle_from_a_tp2_engine_checkpoint_keeps_greedy_output(fitted, stories_dir, tmp_path):
    """The Triton twin's path: the target and the head both from the EagleForCausalLM checkpoint the engine is built
    from, at tp 2 in one process (the head reads the target's lm_head shards side by side); greedy output equals
    the output without EAGLE and drafts are accepted."""
    from trtpipe.checkpoint.convert import convert
    from trtpipe.checkpoint.eagle import write_eagle_checkpoint
    from trtpipe.runtime import load_checkpoint

    head, _ = fitted
    base = convert(stories_dir, tmp_path / "ck", tp=2, pp=1, dtype="float32")
    ckpt = write_eagle_checkpoint(base, head, tmp_path / "eagle", 3, 3, 1)
    model = load_checkpoint(ckpt)
    assert len(model.lm_head) == 2
    prompts = _prompts(4, seed=10)
    plain, _ = _serve(model, _config(), prompts, n=24)
    # a speculative_model that does not exist: draft_engine reads the head built into the checkpoint instead
    cfg = _config(speculative_decoding_type="Eagle", max_draft_len=3, speculative_model=str(tmp_path / "absent"))
    drafter = draft_engine(cfg, model, ckpt)
    spec, core = _serve(model, cfg, prompts, drafter, n=24)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert core.speculator.total_accepted_draft_tokens > 0
