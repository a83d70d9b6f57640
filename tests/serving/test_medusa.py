"""Medusa heads in the executor (trtpipe/serving/medusa.py) on stories260k.

Oracle for the drafts: each head's logits by the formula of upstream's ``MedusaHead`` (residual blocks
``x + silu(linear(x))``, then the head's lm_head) over transformers' float64 hidden state after the final norm, at
the position before the request's last token; the tolerance is ORDER_FACTOR x the same evaluation's float32 error.
Greedy output with Medusa equals the output without it and transformers' float64 greedy, token for token. The
acceptance counters equal a replay of the recorded drafts against the output. The heads are random
(trtpipe.models.synthetic_heads.make_medusa_heads): what they accept is measured, not asserted.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from numerics import assert_as_accurate, error_scale
from serving_oracle import check_greedy
from trtpipe.errors import CheckpointError
from trtpipe.models.synthetic import load_hf
from trtpipe.models.synthetic_heads import make_medusa_heads
from trtpipe.serving.api import ExecutorConfig, Request, SamplingParams
from trtpipe.serving.executor import ExecutorCore
from trtpipe.recipe.medusa import tree_problem
from trtpipe.serving.medusa import (
    MedusaDrafter,
    MedusaHeads,
    chain_choices,
    is_chain,
    load_medusa_heads,
    sorted_choices,
    tree_parents,
)
from trtpipe.serving.tree_verify import paths_from_parents
from trtpipe.serving.reference_engine import ReferenceEngine, draft_engine

EOS = 2
K = 3
HEADS = 4
# a tree of 10 candidates over the 4 heads (top-3 of head 0, top-2 of head 1 under its top-1, ...)
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0]]


@pytest.fixture(scope="module")
def fitted_heads(tmp_path_factory, stories_dir):
    """Heads fitted to the target's own text (trtpipe.models.synthetic_heads.fit_medusa_heads): their top-1 is right
    often enough, and their top-2/3 often when top-1 is not, so trees take sibling paths and move KV."""
    from trtpipe.models.synthetic_heads import fit_medusa_heads

    return fit_medusa_heads(stories_dir, tmp_path_factory.mktemp("fitted") / "heads", HEADS, samples=256, length=48)[0]


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory, stories_dir):
    return make_medusa_heads(stories_dir, tmp_path_factory.mktemp("medusa") / "heads", num_heads=HEADS, seed=4)


def _config(**kw) -> ExecutorConfig:
    base = dict(
        max_batch_size=8, max_num_tokens=128, max_input_len=96, max_seq_len=160, num_blocks=96, tokens_per_block=8
    )
    return ExecutorConfig(**{**base, **kw})


def _serve(model, config, requests, drafts=None):
    final = {}
    core = ExecutorCore(
        config,
        ReferenceEngine(model),
        lambda r: final.__setitem__(r.request_id, r) if r.is_final else None,
        draft_engine=drafts,
    )
    ids = [core.submit(r) for r in requests]
    core.run_until_idle()
    return [final[i] for i in ids], core


def _prompts(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [
        [1] + torch.randint(3, 500, (int(m),), generator=g).tolist() for m in torch.randint(3, 20, (n,), generator=g)
    ]


def _record(monkeypatch):
    """Every proposal as it happens: {request id: [(its tokens, drafts, the heads' logits [k, V])]}."""
    calls: dict[int, list] = {}
    original, logits = MedusaDrafter.propose, MedusaHeads.logits
    last = []

    def heads_spy(self, hidden, k):
        out = logits(self, hidden, k)
        last.append(out.clone())
        return out

    def spy(self, requests, ks):
        out = original(self, requests, ks)
        for i, rid in enumerate(out):  # the heads' rows follow the drafted requests' order
            r = next(x for x in requests if x.id == rid)
            calls.setdefault(rid, []).append((list(r.tokens), out[rid][0], last[-1][: len(out[rid][0]), i]))
        return out

    monkeypatch.setattr(MedusaHeads, "logits", heads_spy)
    monkeypatch.setattr(MedusaDrafter, "propose", spy)
    return calls


@torch.no_grad()
def _oracle(hf, t: dict, tokens: list[int], k: int) -> torch.Tensor:
    """[k, V] head logits by upstream's MedusaHead formula, in the model's dtype, over transformers' hidden state
    (after the final norm) at the position that emitted the last token."""
    x0 = hf.model(torch.tensor([tokens[:-1]])).last_hidden_state[0, -1]
    out = []
    for h in range(k):
        x = x0
        w, b = t[f"{h}.0.linear.weight"].to(x.dtype), t[f"{h}.0.linear.bias"].to(x.dtype)
        x = x + torch.nn.functional.silu(x @ w.T + b)
        out.append(x @ t[f"{h}.1.weight"].to(x.dtype).T)
    return torch.stack(out)


def test_chain_choices_and_trees():
    assert chain_choices(3) == [[0], [0, 0], [0, 0, 0]]
    assert is_chain([[0, 0], [0]]) and not is_chain([[0], [1]]) and not is_chain([[0], [0, 0], [0, 1]])
    tree = sorted_choices([[0, 1], [1], [0], [0, 0, 0], [0, 0]])
    assert tree == [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    assert tree_parents(tree) == [-1, 0, 0, 1, 1, 3]
    assert tree_problem(tree) == ""
    assert tree_problem([[0], [1, 0]]) == "[1, 0] has no parent [1] in the choices"
    assert tree_problem([[0], [0]]) == "[0] appears twice"


@pytest.mark.slow
def test_medusa_drafts_as_float64_and_greedy_unchanged(model_tp1, oracle, stories_dir, heads_dir, monkeypatch):
    prompts = _prompts(6, seed=11)

    def requests():
        return [Request(p, 24, end_id=EOS, exclude_input_from_output=True, return_perf_metrics=True) for p in prompts]

    plain, _ = _serve(model_tp1, _config(), requests())
    calls = _record(monkeypatch)
    cfg = _config(speculative_decoding_type="Medusa", max_draft_len=K, speculative_model=str(heads_dir))
    spec, core = _serve(model_tp1, cfg, requests(), draft_engine(cfg, model_tp1))
    t = load_file(str(heads_dir / "medusa_lm_head.safetensors"))
    hf32 = load_hf(stories_dir)
    checked = 0
    for rid, (p, a, b) in enumerate(zip(prompts, plain, spec), start=1):
        assert not b.has_error, b.error
        assert b.tokens == a.tokens  # the drafts change nothing in greedy output
        assert check_greedy(model_tp1, oracle, p, b.tokens, 24, EOS) == ""
        full = p + b.tokens
        drafted = accepted = 0
        for seq, drafts, rows in calls[rid]:
            n = len(seq)
            assert seq == full[:n] and drafts == rows.argmax(-1).tolist()
            if checked < 8:  # the heads' logits over the target's hidden state, as float64 computes them
                r64, r32 = _oracle(oracle, t, seq, len(drafts)), _oracle(hf32, t, seq, len(drafts))
                assert_as_accurate(rows, r64, error_scale(r32, r64), f"request {rid}: heads after {n} tokens")
                checked += 1
            drafted += len(drafts)
            for j, d in enumerate(drafts):  # replay: the longest prefix equal to what the request then output
                if n + j >= len(full) or full[n + j] != d:
                    break
                accepted += 1
        assert (b.perf.total_draft_tokens, b.perf.total_accepted_draft_tokens) == (drafted, accepted)
    assert checked == 8
    s = core.speculator
    assert s.total_draft_tokens == sum(r.perf.total_draft_tokens for r in spec) > 0
    assert s.total_accepted_draft_tokens == sum(r.perf.total_accepted_draft_tokens for r in spec)
    assert core.pool.stats().free_blocks == core.pool.stats().max_blocks and not s.draft.state
    print(f"random Medusa heads: {s.total_accepted_draft_tokens} of {s.total_draft_tokens} drafts accepted")


def test_heads_missing_a_tensor_or_too_few_for_the_chain_are_refused_in_one_line(model_tp1, heads_dir, tmp_path):
    cfg = _config(speculative_decoding_type="Medusa", max_draft_len=HEADS + 1, speculative_model=str(heads_dir))
    with pytest.raises(ValueError, match=r"^speculative.max_draft_len 5: .* has 4$"):
        draft_engine(cfg, model_tp1)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((heads_dir / "config.json").read_text())
    t = load_file(str(heads_dir / "medusa_lm_head.safetensors"))
    del t["2.0.linear.weight"]
    save_file(t, str(bad / "medusa_lm_head.safetensors"))
    with pytest.raises(CheckpointError, match=r"Medusa head 2: tensor '2.0.linear.weight' is missing") as e:
        load_medusa_heads(bad, model_tp1)
    assert "\n" not in str(e.value)
    (bad / "medusa_lm_head.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no medusa_lm_head.pt or medusa_lm_head.safetensors"):
        load_medusa_heads(bad, model_tp1)


@pytest.mark.slow
def test_medusa_under_sampling_reproduces_per_seed_with_consistent_counters(model_tp1, heads_dir):
    """Deterministic (top-1) drafts under sampling go through the one rejection-sampling rule with a one-hot draft;
    the same seed gives the same tokens run after run, and every request completes with its counters consistent."""
    cfg = _config(speculative_decoding_type="Medusa", max_draft_len=K, speculative_model=str(heads_dir))
    s = SamplingParams(temperature=0.8, top_k=20, seed=5)
    runs = []
    for _ in range(2):
        reqs = [Request([1, 40, 41, 42], 16, sampling=s, return_perf_metrics=True) for _ in range(3)]
        out, core = _serve(model_tp1, cfg, reqs, draft_engine(cfg, model_tp1))
        assert all(not r.has_error for r in out)
        assert all(0 <= r.perf.total_accepted_draft_tokens <= r.perf.total_draft_tokens for r in out)
        runs.append([r.tokens for r in out])
    assert runs[0] == runs[1]


def test_triton_medusa_choices_are_parsed_and_checked():
    from trtpipe.serving.medusa import check_choices, parse_choices

    assert parse_choices("{0, 0, 0}, {0, 1}") == [[0, 0, 0], [0, 1]]  # tensorrtllm_backend's own example
    cfg = _config(speculative_decoding_type="Medusa", max_draft_len=2)
    check_choices("{0}, {0, 0}", cfg)
    assert check_choices("{0}, {1}", cfg) == [[0], [1]]  # a tree with siblings
    for bad in ("{0}, {1, 0}", "{0}", "0, 1", "{0, 0"):
        with pytest.raises(ValueError, match=r"^tensorrt_llm twin: medusa_choices .*") as e:
            check_choices(bad, cfg)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="does not speculate with Medusa"):
        check_choices("{0}", _config())


@pytest.mark.slow
def test_medusa_at_tp2_in_one_process_keeps_greedy_output(model_tp2, heads_dir):
    prompts = _prompts(4, seed=12)

    def requests():
        return [Request(p, 24, end_id=EOS, exclude_input_from_output=True, return_perf_metrics=True) for p in prompts]

    plain, _ = _serve(model_tp2, _config(), requests())
    cfg = _config(speculative_decoding_type="Medusa", max_draft_len=K, speculative_model=str(heads_dir))
    spec, core = _serve(model_tp2, cfg, requests(), draft_engine(cfg, model_tp2))
    for a, b in zip(plain, spec):
        assert not b.has_error, b.error
        assert b.tokens == a.tokens
    assert core.speculator.total_draft_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_sampled_output_distribution_unchanged_with_medusa(model_tp1, oracle, heads_dir, tmp_path, tree):
    """2,000 seeded requests: token 2 (the first a verification emits, from the draft of head 0 or the residual)
    follows the exact float64 marginal sum_t1 p(t1) p(t2 | t1). Head 0 reads the prompt's last hidden state (the same
    for every request) and is set to propose the marginal's likeliest token, so drafts are kept often and rejected
    often: both branches run. ``tree``: choices [[0], [1]], head 0's top-2 (the two likeliest) as siblings, verified by
    token matching (upstream's acceptDraftTokensByIdsWithPaths): a sibling is kept exactly when token 2 is it."""
    from test_speculative import ALPHA, _chi2

    from trtpipe.serving.speculative import sampling_probs

    d = tmp_path / "heads"
    d.mkdir()
    (d / "config.json").write_text((heads_dir / "config.json").read_text())
    prompt = [1, 403, 407, 261, 378]
    s = SamplingParams(temperature=1.0, top_k=20)
    with torch.no_grad():
        p1 = sampling_probs(oracle(torch.tensor([prompt])).logits[0, -1], s)
        support = p1.nonzero().flatten().tolist()
        rows = oracle(torch.tensor([prompt + [x] for x in support])).logits[:, -1]
        marginal = (p1[support, None] * sampling_probs(rows, s)).sum(0)
        h = oracle.model(torch.tensor([prompt])).last_hidden_state[0, -1].float()
    t = load_file(str(heads_dir / "medusa_lm_head.safetensors"))
    t["0.0.linear.weight"].zero_()
    t["0.0.linear.bias"].zero_()
    t["0.1.weight"] = torch.zeros_like(t["0.1.weight"])
    top2 = marginal.topk(2).indices.tolist()
    t["0.1.weight"][top2[0]] = h / h.dot(h)  # logit 1 for that token, 0 for the rest
    if tree:
        t["0.1.weight"][top2[1]] = 0.5 * h / h.dot(h)  # logit 0.5: head 0's rank 1
    save_file(t, str(d / "medusa_lm_head.safetensors"))
    n = 2000
    reqs = [
        # a tree needs room for its 2 nodes in the request: 4 tokens
        Request(prompt, 3 + tree, exclude_input_from_output=True, sampling=SamplingParams(1.0, 20, 1.0, seed=3000 + i))
        for i in range(n)
    ]
    choices = {"medusa_choices": [[0], [1]]} if tree else {}
    cfg = _config(speculative_decoding_type="Medusa", max_draft_len=2, speculative_model=str(d), **choices)
    out, core = _serve(model_tp1, cfg, reqs, draft_engine(cfg, model_tp1))
    counts = torch.zeros(marginal.numel())
    for r in out:
        counts[r.tokens[1]] += 1
    sp = core.speculator
    rate = sp.total_accepted_draft_tokens / sp.total_draft_tokens
    # a draft d is kept exactly when the request's token 2 is d: the acceptance rate estimates marginal[d]
    # (binomial, 4.5 standard deviations: a correct implementation fails once in 1.5e5 seeds). A tree's requests
    # that reject both siblings verify again with fewer nodes, so only its distribution is compared.
    want = float(marginal.max())
    if not tree:
        assert 0 < want < 1 and abs(rate - want) < 4.5 * (want * (1 - want) / n) ** 0.5, (rate, want)
    else:
        assert sp.total_accepted_draft_tokens > 0
    pv = _chi2(counts, marginal)
    print(f"Medusa sampling: acceptance {rate:.3f} of {sp.total_draft_tokens} drafts; chi-square p = {pv:.3g}")
    assert pv > ALPHA, f"chi-square p = {pv:.3g}"


def _tree_record(monkeypatch):
    """Every tree proposal: {request id: [(its tokens, node tokens, parents)]}."""
    calls: dict[int, list] = {}
    original = MedusaDrafter.propose

    def spy(self, requests, ks):
        out = original(self, requests, ks)
        for rid, (d, _, fields) in out.items():
            r = next(x for x in requests if x.id == rid)
            mask = fields["spec_mask"]
            parents = [-1] + [max(j for j in range(i) if mask[i, j]) for i in range(1, len(d) + 1)]
            calls.setdefault(rid, []).append((list(r.tokens), d, parents))
        return out

    monkeypatch.setattr(MedusaDrafter, "propose", spy)
    return calls


@pytest.mark.slow
def test_medusa_tree_keeps_greedy_output_and_counts_a_replay(model_tp1, oracle, fitted_heads, monkeypatch):
    """medusa_choices with siblings: the heads' top-k build the tree, one target forward verifies it with the tree
    mask, the longest agreeing path is kept (its KV moved behind the prefix). Greedy output equals the executor
    without speculation and transformers' float64 greedy; the counters equal a replay of each recorded tree against
    the output (the longest root-to-node path whose tokens the request then output); each tree's node tokens are
    the heads' top-k at their ranks."""
    prompts = _prompts(6, seed=11)

    def requests():
        return [Request(p, 24, end_id=EOS, exclude_input_from_output=True, return_perf_metrics=True) for p in prompts]

    plain, _ = _serve(model_tp1, _config(), requests())
    calls = _tree_record(monkeypatch)
    cfg = _config(
        speculative_decoding_type="Medusa",
        max_draft_len=len(TREE),
        speculative_model=str(fitted_heads),
        medusa_choices=TREE,
    )
    spec, core = _serve(model_tp1, cfg, requests(), draft_engine(cfg, model_tp1))
    nodes = sorted_choices(TREE)
    t = load_file(str(fitted_heads / "medusa_lm_head.safetensors"))
    moved = 0  # verifications whose accepted path is not at slots 1.. already (its KV moved)
    for rid, (p, a, b) in enumerate(zip(prompts, plain, spec), start=1):
        assert not b.has_error, b.error
        assert b.tokens == a.tokens  # the tree changes nothing in greedy output
        assert check_greedy(model_tp1, oracle, p, b.tokens, 24, EOS) == ""
        full = p + b.tokens
        drafted = accepted = 0
        for seq, drafts, parents in calls[rid]:
            n = len(seq)
            assert seq == full[:n] and parents == tree_parents(nodes[: len(drafts)])
            # every proposal (after moved verifications too: the heads read the accepted node's hidden state): node c
            # holds head len(c) - 1's rank-c[-1] token, as float64 ranks them (ties aside)
            r64 = _oracle(oracle, t, seq, max(len(c) for c in nodes))
            for c, tok in zip(nodes, drafts):
                row = r64[len(c) - 1]
                want = row.topk(c[-1] + 1).values[-1]
                assert abs(float(row[tok] - want)) <= 1e-4 * float(row.abs().max()), (c, tok)
            drafted += len(drafts)
            best = 0
            for path in paths_from_parents(parents):  # replay: the longest path the output then followed
                j = 0
                while j < len(path) and n + j < len(full) and full[n + j] == drafts[path[j] - 1]:
                    j += 1
                best = max(best, j)
            accepted += best
            moved += best > 0 and any(
                path[:best] != list(range(1, best + 1)) and all(full[n + j] == drafts[path[j] - 1] for j in range(best))
                for path in paths_from_parents(parents)
                if len(path) >= best
            )
        assert (b.perf.total_draft_tokens, b.perf.total_accepted_draft_tokens) == (drafted, accepted)
    s = core.speculator
    assert moved > 0 and s.total_accepted_draft_tokens > 0  # sibling paths were taken, their KV moved
    assert core.pool.stats().free_blocks == core.pool.stats().max_blocks and not s.draft.state
    print(
        f"fitted Medusa heads, tree of {len(TREE)}: {s.total_accepted_draft_tokens} accepted in {s.verifications} "
        f"verifications, {moved} off the first path"
    )


@pytest.mark.slow
def test_medusa_tree_under_sampling_reproduces_per_seed(model_tp1, heads_dir):
    """Token matching under sampling (upstream's acceptDraftTokensByIdsWithPaths): the same seed gives the same
    tokens run after run, and every request completes with consistent counters."""
    cfg = _config(
        speculative_decoding_type="Medusa",
        max_draft_len=len(TREE),
        speculative_model=str(heads_dir),
        medusa_choices=TREE,
    )
    s = SamplingParams(temperature=0.8, top_k=20, seed=5)
    runs = []
    for _ in range(2):
        reqs = [Request([1, 40, 41, 42], 16, sampling=s, return_perf_metrics=True) for _ in range(3)]
        out, core = _serve(model_tp1, cfg, reqs, draft_engine(cfg, model_tp1))
        assert all(not r.has_error for r in out)
        assert all(0 <= r.perf.total_accepted_draft_tokens <= r.perf.total_draft_tokens for r in out)
        runs.append([r.tokens for r in out])
    assert runs[0] == runs[1]
