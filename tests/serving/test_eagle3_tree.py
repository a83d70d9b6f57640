"""EAGLE-3's static tree (``eagle_choices`` with siblings) in the executor: the EAGLE-1 tree drafter
(trtpipe/serving/eagle1.py ``Eagle1TreeDrafter``) over an EAGLE-3 head (trtpipe/serving/hidden_draft.py).

Oracle for every tree node's draft logits: the head's formula along the node's path in float64 (transformers' Llama
attention over the target's float64 hidden states, as tests/serving/test_hidden_draft.py evaluates EAGLE-3 chains),
with the tolerance ORDER_FACTOR x the same evaluation's float32 error. Greedy output with the tree equals the output
without speculation and transformers' float64 greedy, token for token; the acceptance counters equal a replay of the
longest matching path of each recorded tree; under sampling the first token a tree verification emits keeps the
target's distribution (chi-square). The head is trained here on the target's own text
(trtpipe.models.synthetic_heads.train_eagle3_head), so drafts are accepted; how many is measured, not asserted.
"""

from __future__ import annotations

import json

import pytest
import torch

from numerics import assert_as_accurate, error_scale
from serving_oracle import check_greedy
from numerics import hf_float64
from safetensors.torch import load_file
from test_hidden_draft import _config, _prompts, _record, _rms, _serve
from trtpipe.models.synthetic import load_hf
from trtpipe.models.synthetic_heads import deepened_llama, train_eagle3_head
from trtpipe.recipe.medusa import braces
from trtpipe.serving.eagle1 import Eagle1TreeDrafter
from trtpipe.serving.hidden_draft import eagle3_capture_layers
from trtpipe.runtime.hf_loader import load_hf_checkpoint
from trtpipe.serving.reference_engine import draft_engine
from trtpipe.serving.tree_verify import parents_from_mask, paths_from_parents

TREE = [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0]]  # siblings at depths 1 and 2, 3 deep
EOS = 2  # stories260k's </s>, as tests/serving/test_eagle1.py
WIDE = [[i] for i in range(8)] + [[0, 0], [1, 0], [2, 0], [0, 0, 0], [0, 1]]  # 8 siblings at depth 1


@pytest.fixture(scope="module")
def trained(stories_dir, tmp_path_factory):
    """(target: stories260k deepened to 8 layers, an EAGLE-3 head trained on its own text (150 steps on 256
    samples: it drafts, so kept nodes move the KV), the twin's target, HF float32, HF float64, head tensors)."""
    root = tmp_path_factory.mktemp("eagle3-tree")
    d = deepened_llama(stories_dir, root / "stories-8l")
    head, _, _ = train_eagle3_head(d, root / "head", 150, samples=256)
    hf = load_hf(d)
    return d, head, load_hf_checkpoint(d), hf, hf_float64(hf), load_file(str(head / "model.safetensors"))


@torch.no_grad()
def path_logits(hf, t, cfg: dict, tokens: list[int], path: list[int]) -> list[torch.Tensor]:
    """The head's logits after ``tokens`` and after each prefix of ``path`` (target ids): the catch-up over the
    target's captures, then one step per path token reading the previous step's output (the chain along the path,
    which is what a tree node sees)."""
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
    rope = LlamaRotaryEmbedding(LlamaConfig(**cfg)).to(dt)
    w = {k: v.to(dt) for k, v in t.items() if v.is_floating_point()}
    hs = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
    cap = torch.cat([hs[i + 1] for i in eagle3_capture_layers(hf.config.num_hidden_layers)], -1)
    emb = hf.model.embed_tokens(torch.tensor([tokens[1:] + path]))

    def layer(e, g):
        n = g.shape[1]
        cos, sin = rope(g, torch.arange(n)[None])
        h = torch.cat(
            [_rms(e, w["midlayer.input_layernorm.weight"], eps), _rms(g, w["midlayer.hidden_norm.weight"], eps)], -1
        )
        a, _ = attn(h, (cos, sin), torch.full((n, n), float("-inf"), dtype=dt).triu(1)[None, None])
        x = g + a
        m = _rms(x, w["midlayer.post_attention_layernorm.weight"], eps)
        gate, up = m @ w["midlayer.mlp.gate_proj.weight"].T, m @ w["midlayer.mlp.up_proj.weight"].T
        return x + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T

    g = cap @ w["fc.weight"].T
    n = g.shape[1]
    out = []
    for d in range(len(path) + 1):
        x = layer(emb[:, : n + d], g)
        out.append(_rms(x[0, -1], w["norm.weight"], eps) @ w["lm_head.weight"].T)
        g = torch.cat([g, x[:, -1:]], 1)
    return out


def _spy_proposals(monkeypatch) -> list:
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
    return proposals


def _replayed_tree_acceptance(proposals, full) -> tuple[dict, dict]:
    """(drafted, accepted) per request: every node drafted, the longest path of each tree the output followed."""
    drafted = {rid: 0 for rid in full}
    accepted = {rid: 0 for rid in full}
    for rid, n, drafts, parents in proposals:
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
    return drafted, accepted


@pytest.mark.slow
@pytest.mark.parametrize("tree", [TREE, WIDE], ids=["narrow", "wide"])
def test_an_eagle3_tree_drafts_as_float64_keeps_greedy_output_and_counts_its_longest_path(
    tree, trained, monkeypatch, stories_dir
):
    d, head, model, hf32, hf64, t = trained
    cfg_head = json.loads((head / "config.json").read_text())
    prompts = _prompts(4, seed=11)
    n_out = 24
    plain, _ = _serve(model, _config(), prompts, n=n_out)
    calls = _record(monkeypatch)
    proposals = _spy_proposals(monkeypatch)
    k = len(tree)
    cfg = _config(
        speculative_decoding_type="Eagle3", max_draft_len=k, speculative_model=str(head), eagle_choices=braces(tree)
    )
    drafter = draft_engine(cfg, model, d)
    assert drafter.tree == sorted(tree, key=lambda c: (len(c), c))  # the head; the executor asks it for its drafter
    spec, core = _serve(model, cfg, prompts, drafter, n=n_out)
    full = {}
    for rid, (p, a, b) in enumerate(zip(prompts, plain, spec), start=1):
        assert not b.has_error, b.error
        assert b.tokens == a.tokens  # the tree changes nothing in greedy output
        assert check_greedy(model, hf64, p, b.tokens, n_out, EOS) == ""  # and it is transformers' float64 greedy
        full[rid] = p + b.tokens
    d2t = t["d2t"].long()
    # every node's logits: the catch-up row (the root) and each level forward's rows (nodes with children)
    checked = roots = 0
    for entries, rows, _ in calls:
        row = 0
        for rid, toks, start, ctx in entries:
            if ctx:  # a catch-up: one row, the root's, after the sequence up to the last sampled token
                seq = full[rid][: start + len(toks) + 1]
                if roots < 4 and any(p[0] == rid and p[1] == len(seq) for p in proposals):
                    r64, r32 = (path_logits(hf, t, cfg_head, seq, [])[0] for hf in (hf64, hf32))
                    assert_as_accurate(rows[row], r64, error_scale(r32, r64), f"request {rid}: root after {len(seq)}")
                    _, _, drafts, parents = next(p for p in proposals if p[0] == rid and p[1] == len(seq))
                    kids = [j for j in range(1, len(drafts) + 1) if parents[j] == 0]  # the root's top ranks
                    assert [drafts[j - 1] for j in kids] == [int(x + d2t[x]) for x in r64.topk(len(kids)).indices]
                    roots += 1
                row += 1
                continue
            # a level forward: one row per node with children up to this level, in node order
            seq = full[rid][: start + 1]
            _, _, drafts, parents = next(p for p in proposals if p[0] == rid and p[1] == start + 1)
            for i in range(len(toks)):
                if checked < 12:
                    node = _row_node(parents, drafts, toks, i)
                    path = [drafts[x - 1] for x in _path(parents, node)]
                    r64, r32 = (path_logits(hf, t, cfg_head, seq, path)[-1] for hf in (hf64, hf32))
                    what = f"request {rid}: node {path} after {len(seq)}"
                    assert_as_accurate(rows[row + i], r64, error_scale(r32, r64), what)
                    # its children: the top ranks of these logits, mapped to target ids through d2t
                    kids = [j for j in range(1, len(drafts) + 1) if parents[j] == node]
                    top = r64.topk(len(kids)).indices
                    assert [drafts[j - 1] for j in kids] == [int(x + d2t[x]) for x in top], what
                    checked += 1
            row += len(toks)
    assert roots >= 4 and checked >= 12
    drafted, accepted = _replayed_tree_acceptance(proposals, full)
    for rid, r in enumerate(spec, start=1):
        assert (r.perf.total_draft_tokens, r.perf.total_accepted_draft_tokens) == (drafted[rid], accepted[rid])
    s = core.speculator
    assert s.total_draft_tokens == sum(drafted.values()) > 0
    assert s.total_accepted_draft_tokens == sum(accepted.values())
    assert core.pool.stats().free_blocks == core.pool.stats().max_blocks
    assert s.draft.pool.num_free == s.draft.pool.num_blocks and not s.draft.state
    assert s.total_accepted_draft_tokens > 0  # the trained head's drafts are accepted: kept nodes' KV moved
    print(f"trained EAGLE-3 head, tree of {k}: {s.total_accepted_draft_tokens} of {s.total_draft_tokens} accepted")


def _path(parents: list[int], node: int) -> list[int]:
    out = []
    while node > 0:
        out.insert(0, node)
        node = parents[node]
    return out


def _row_node(parents: list[int], drafts: list[int], toks: list[int], i: int) -> int:
    """The tree node of row ``i`` of a level forward: the forward lists, in node order, every node with children up
    to its depth (``Eagle1TreeDrafter.propose``); its tokens are ``toks``."""
    has_child = set(parents[1:])
    depth = max(len(_path(parents, j)) for j in range(1, len(drafts) + 1) if j in has_child and drafts[j - 1] in toks)
    for d in range(1, depth + 2):
        nodes = [j for j in range(1, len(drafts) + 1) if j in has_child and len(_path(parents, j)) <= d]
        if [drafts[j - 1] for j in nodes] == toks:
            return nodes[i]
    raise AssertionError(f"no level of the tree lists tokens {toks}")


@pytest.mark.slow
def test_sampled_output_distribution_unchanged_with_an_eagle3_tree(trained):
    """The output distribution under sampling through an EAGLE-3 tree, as tests/serving/test_eagle1.py checks
    EAGLE-1 trees (:func:`test_eagle1.check_tree_sampling`)."""
    from test_eagle1 import check_tree_sampling

    d, head, model, _, hf64, _ = trained
    check_tree_sampling(model, hf64, "Eagle3", head, d, "EAGLE-3")
