"""Speculative decoding in the executor (trtpipe/serving/speculative.py) on stories260k.

Greedy: the output with NGram or DraftTarget speculation is the output without it, token for token, and equals
transformers' own assisted generation (``prompt_lookup_num_tokens=``, ``assistant_model=``) in float64. The model as
its own draft accepts every draft, and the counters equal the trace worked out by hand. Sampling: rejection sampling
keeps the target's distribution (chi-square tests against exact float64 distributions, with their p-values).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

from trtpipe.checkpoint.convert import convert
from trtpipe.runtime import load_checkpoint
from trtpipe.serving.api import ExecutorConfig, Request, SamplingParams
from trtpipe.serving.executor import ExecutorCore
from trtpipe.serving.reference_engine import ReferenceEngine
from trtpipe.serving.speculative import ngram_draft, sampling_probs, verify

from serving_oracle import check_greedy

EOS = 2
# Each chi-square test fails a correct implementation with probability ALPHA (its seeds are fixed, so a given
# checkout passes or fails every time; a new seed would fail one run in 10,000).
ALPHA = 1e-4
DRAFT_LAYERS = 2


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, stories_dir):
    """stories260k cut to its first 2 layers: a cheaper draft with the target's tokenizer (and another distribution)."""
    d = tmp_path_factory.mktemp("draft") / "stories-2l"
    shutil.copytree(stories_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = DRAFT_LAYERS
    (d / "config.json").write_text(json.dumps(cfg))
    sd = load_file(d / "model.safetensors")
    keep = {k: v for k, v in sd.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < DRAFT_LAYERS}
    save_file(keep, d / "model.safetensors", metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory, draft_dir):
    return load_checkpoint(convert(draft_dir, tmp_path_factory.mktemp("draftck") / "tp1", tp=1, pp=1, dtype="float32"))


def _config(**kw) -> ExecutorConfig:
    base = dict(
        max_batch_size=8, max_num_tokens=128, max_input_len=96, max_seq_len=160, num_blocks=96, tokens_per_block=8
    )
    base.update(kw)
    return ExecutorConfig(**base)


def _serve(model, config, requests, draft=None):
    final = {}
    core = ExecutorCore(
        config,
        ReferenceEngine(model),
        lambda r: final.__setitem__(r.request_id, r) if r.is_final else None,
        draft_engine=ReferenceEngine(draft) if draft is not None else None,
    )
    ids = [core.submit(r) for r in requests]
    core.run_until_idle()
    return [final[i] for i in ids], core


def _prompts(n: int, seed: int, repetitive: bool):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if repetitive:  # a phrase said twice: n-gram lookups find continuations
            phrase = torch.randint(3, 500, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
            out.append([1] + phrase + phrase[:3])
        else:
            out.append(
                [1] + torch.randint(3, 500, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            )
    return out


def _greedy_requests(prompts, n=32):
    return [Request(p, n, end_id=EOS, exclude_input_from_output=True, return_perf_metrics=True) for p in prompts]


@torch.no_grad()
def _hf_generate(hf, prompt, n, **kw):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=EOS, pad_token_id=0, **kw)
    toks = out[0, len(prompt) :].tolist()
    return toks[: toks.index(EOS)] if EOS in toks else toks


def test_ngram_draft_is_the_earliest_continuation_of_the_longest_suffix():
    assert ngram_draft([5, 6, 7, 8, 5, 6], 3, 2) == [7, 8, 5]
    assert ngram_draft([5, 6, 9, 6, 7, 6], 2, 2) == [9, 6]  # suffix [6] first followed by 9 (the oldest match)
    assert ngram_draft([1, 2, 3], 2, 2) == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["NGram", "DraftTarget"])
def test_greedy_identical_with_and_without_speculation_and_to_transformers_assisted(
    kind, model_tp1, oracle, draft_model, draft_dir
):
    from trtpipe.models.synthetic import load_hf

    prompts = _prompts(8, seed=3, repetitive=kind == "NGram")
    plain, _ = _serve(model_tp1, _config(), _greedy_requests(prompts))
    spec_cfg = _config(speculative_decoding_type=kind, max_draft_len=3, max_matching_ngram_size=2)
    draft = draft_model if kind == "DraftTarget" else None
    spec, core = _serve(model_tp1, spec_cfg, _greedy_requests(prompts), draft)
    assistant = load_hf(draft_dir).double() if kind == "DraftTarget" else None
    for p, a, b in zip(prompts, plain, spec):
        assert not b.has_error, b.error
        assert b.tokens == a.tokens  # speculation changes nothing in greedy output
        assert check_greedy(model_tp1, oracle, p, b.tokens, 32, EOS) == ""
        kw = {"prompt_lookup_num_tokens": 3} if kind == "NGram" else {"assistant_model": assistant}
        assisted = _hf_generate(oracle, p, 32, **kw)
        assert assisted == _hf_generate(oracle, p, 32)  # transformers' own claim: assisted greedy is greedy
        assert b.tokens == assisted or check_greedy(model_tp1, oracle, p, b.tokens, 32, EOS) == ""
    s = core.speculator
    assert s.total_draft_tokens > 0 and 0 < s.total_accepted_draft_tokens <= s.total_draft_tokens
    assert sum(r.perf.total_draft_tokens for r in spec) == s.total_draft_tokens
    stats = core.pool.stats()
    assert stats.free_blocks == stats.max_blocks  # every target block came back
    if core.speculator.draft is not None:
        assert core.speculator.draft.pool.num_free == core.speculator.draft.pool.num_blocks  # and every draft block


def _self_draft_trace(n: int, k: int) -> tuple[int, int]:
    """(drafts, verifications) of one request of n tokens, no end id, when every draft is accepted: the prefill
    gives token 1; each step drafts min(k, n - out - 1) and emits that many + 1."""
    out, drafts, steps = 1, 0, 0
    while out < n:
        d = min(k, n - out - 1)
        drafts, steps, out = drafts + d, steps + 1, out + d + 1
    return drafts, steps


def test_the_model_as_its_own_draft_accepts_every_draft(model_tp1):
    n, k = 20, 3
    assert _self_draft_trace(n, k) == (14, 5)  # by hand: out 1 -> 5 -> 9 -> 13 -> 17 (4 drafts each) -> 20 (2)
    prompts = _prompts(4, seed=5, repetitive=False)
    reqs = [Request(p, n, exclude_input_from_output=True, return_perf_metrics=True) for p in prompts]
    out, core = _serve(model_tp1, _config(speculative_decoding_type="DraftTarget", max_draft_len=k), reqs, model_tp1)
    for r in out:
        assert len(r.tokens) == n
        assert (r.perf.total_draft_tokens, r.perf.total_accepted_draft_tokens) == (14, 14)
        assert r.perf.acceptance_rate == 1.0
    assert core.speculator.verifications == 4 * 5
    assert core.iteration == 1 + 5  # one prefill step for all four, then five verification steps


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed ``counts`` under ``probs``: cells expecting < 5 lumped into one."""
    n = int(counts.sum())
    assert n >= 500, f"only {n} samples"
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < 5:  # fold a too-small remainder into the smallest cell
        obs, exp = obs[:-1].clone(), exp[:-1].clone()
        i = int(exp.argmin())
        obs[i] += counts[~big].sum()
        exp[i] += expected[~big].sum()
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


@pytest.mark.slow
@pytest.mark.parametrize("deterministic", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(deterministic):
    """verify() on fixed logits: the first emitted token and, when the first draft is kept, the second, follow p."""
    g = torch.Generator().manual_seed(11)
    V, k = 12, 2
    logits = torch.randn(k + 1, V, generator=g, dtype=torch.float64) * 2
    s = SamplingParams(temperature=0.8, top_k=10, top_p=0.95)
    p = sampling_probs(logits, s)
    q = sampling_probs(torch.randn(k, V, generator=g, dtype=torch.float64) * 2, SamplingParams(temperature=1.0))
    first = torch.zeros(V)
    second = torch.zeros(V)
    n = 20_000
    gen = torch.Generator().manual_seed(12)
    fixed = [int(p[0].argmax()), int(p[1].argmax())]  # an n-gram's guess: the likely tokens, often kept
    for _ in range(n):
        drafts = fixed if deterministic else [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
        out = verify(drafts, None if deterministic else q, logits, s, gen)
        first[out[0]] += 1
        if len(out) > 1 and out[0] == drafts[0]:
            second[out[1]] += 1
    pv1, pv2 = _chi2(first, p[0]), _chi2(second, p[1])
    assert pv1 > ALPHA, f"first token: chi-square p = {pv1:.3g}"
    assert pv2 > ALPHA, f"second token after an accepted draft: chi-square p = {pv2:.3g}"


@pytest.mark.slow
def test_sampled_output_distribution_unchanged_through_the_executor(model_tp1, oracle, draft_model):
    """2,000 seeded requests of 3 tokens, the 2-layer draft proposing: token 2 (the first a verification emits)
    follows the exact float64 marginal sum_t1 p(t1) p(t2 | t1) of the target's sampling distribution."""
    prompt = [1, 403, 407, 261, 378]
    s = SamplingParams(temperature=1.0, top_k=20)
    with torch.no_grad():
        p1 = sampling_probs(oracle(torch.tensor([prompt])).logits[0, -1], s)
        support = p1.nonzero().flatten().tolist()
        rows = oracle(torch.tensor([prompt + [t] for t in support])).logits[:, -1]
        marginal = (p1[support, None] * sampling_probs(rows, s)).sum(0)
    n = 2000
    reqs = [
        Request(prompt, 3, exclude_input_from_output=True, sampling=SamplingParams(1.0, 20, 1.0, seed=1000 + i))
        for i in range(n)
    ]
    out, core = _serve(model_tp1, _config(speculative_decoding_type="DraftTarget", max_draft_len=2), reqs, draft_model)
    counts = torch.zeros(marginal.numel())
    for r in out:
        counts[r.tokens[1]] += 1
    rate = core.speculator.total_accepted_draft_tokens / core.speculator.total_draft_tokens
    assert 0 < rate < 1  # the draft is another model: some rejected, some kept (both branches are tested)
    pv = _chi2(counts, marginal)
    assert pv > ALPHA, f"chi-square p = {pv:.3g}"


@pytest.mark.slow
def test_greedy_identical_at_tp2(model_tp2, oracle, model_tp1):
    """The tp=2 checkpoint (two shards per layer, summed as the all-reduce would) with the tp=1 model as draft."""
    prompts = _prompts(6, seed=9, repetitive=True)
    plain, _ = _serve(model_tp2, _config(), _greedy_requests(prompts, 24))
    for kind, draft in (("NGram", None), ("DraftTarget", model_tp1)):
        spec, core = _serve(
            model_tp2, _config(speculative_decoding_type=kind, max_draft_len=3), _greedy_requests(prompts, 24), draft
        )
        for p, a, b in zip(prompts, plain, spec):
            assert not b.has_error, b.error
            assert b.tokens == a.tokens
            assert check_greedy(model_tp2, oracle, p, b.tokens, 24, EOS) == ""
        assert core.speculator.total_accepted_draft_tokens > 0
