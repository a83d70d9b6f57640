"""Draft logits (trtpipe/serving/draft_logits.py): external drafts verified by rejection sampling against the
distribution they were drawn from, the draft model's generation logits.

Target: stories260k (5 layers); draft: stories260k cut to its first 4 of 5 layers (same tokenizer, another distribution). Each trial
asks the draft executor for k = 3 sampled tokens with their generation logits (``return_generation_logits``), then
the target executor for k + 1 tokens with those as ``draft_tokens`` / ``draft_logits``, as upstream's BLS does with
``use_draft_logits``. Oracle: transformers in float64. The target's first output token over N seeded trials must be
distributed as the target's own next-token distribution at temperature 1 (chi-square goodness of fit, the p-value
printed); a control that lies about the draft distribution (the logits tripled) fails the same test, so the test can
fail. Greedy output with draft logits is the output without drafts.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from numerics import chi_square_pvalue, hf_float64
from trtpipe.models.synthetic import load_hf
from trtpipe.runtime.hf_loader import load_hf_checkpoint
from trtpipe.serving.api import ExecutorConfig, Request, SamplingParams
from trtpipe.serving.executor import ExecutorCore
from trtpipe.serving.reference_engine import ReferenceEngine

K = 3
N = 1500  # trials per run
PROMPT = [1, 403, 407, 261, 378, 285]
ALPHA = 1e-3  # the goodness-of-fit test's level: a correct sampler fails it once in a thousand runs


@pytest.fixture(scope="module")
def models(tmp_path_factory, stories_dir):
    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("cut") / "stories-4l"
    shutil.copytree(stories_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 4
    (d / "config.json").write_text(json.dumps(cfg))
    sd = load_file(d / "model.safetensors")
    keep = {k: v for k, v in sd.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 4}
    save_file(keep, d / "model.safetensors", metadata={"format": "pt"})
    return load_hf_checkpoint(stories_dir), load_hf_checkpoint(d), load_hf(stories_dir)


def _run(model, requests):
    config = ExecutorConfig(
        max_batch_size=64, max_num_tokens=2048, max_input_len=64, max_seq_len=96, num_blocks=512, tokens_per_block=8
    )
    final = {}
    core = ExecutorCore(
        config, ReferenceEngine(model), lambda r: final.__setitem__(r.request_id, r) if r.is_final else None
    )
    ids = [core.submit(r) for r in requests]
    core.run_until_idle()
    return [final[i] for i in ids]


def _drafts(draft, n: int, sampling):
    got = _run(
        draft,
        [
            Request(
                PROMPT,
                K,
                sampling=sampling(i),
                min_tokens=K,
                exclude_input_from_output=True,
                return_generation_logits=True,
            )
            for i in range(n)
        ],
    )
    for r in got:
        assert len(r.tokens) == K and len(r.generation_logits) == K
    return [(r.tokens, torch.stack(r.generation_logits).numpy()) for r in got]


def _verify(target, drafts, sampling, scale: float = 1.0, without: bool = False):
    return _run(
        target,
        [
            Request(
                PROMPT,
                K + 1,
                sampling=sampling(i),
                exclude_input_from_output=True,
                return_perf_metrics=True,
                draft_tokens=d,
                draft_logits=None if without else q * scale,
            )
            for i, (d, q) in enumerate(drafts)
        ],
    )


@pytest.mark.slow
def test_sampled_output_keeps_the_targets_distribution_with_draft_logits(models):
    target, draft, hf = models
    with torch.no_grad():
        p = torch.softmax(hf_float64(hf)(torch.tensor([PROMPT])).logits[0, -1], -1).numpy()
    drafts = _drafts(draft, N, lambda i: SamplingParams(1.0, seed=10_000 + i))
    sampling = lambda i: SamplingParams(1.0, seed=20_000 + i)  # noqa: E731
    got = _verify(target, drafts, sampling)
    first = [r.tokens[0] for r in got]
    accepted = sum(r.perf.total_accepted_draft_tokens for r in got)
    pvalue = chi_square_pvalue(first, p)
    print(f"draft logits: chi-square p-value {pvalue:.4f} over {N} trials; accepted {accepted} of {K * N} drafts")
    assert pvalue > ALPHA
    assert 0 < accepted < K * N
    # the same drafts verified as tokens only (no draft logits: each kept with the target's probability of it)
    tokens_only = sum(r.perf.total_accepted_draft_tokens for r in _verify(target, drafts, sampling, without=True))
    print(f"accepted without draft logits: {tokens_only} of {K * N}")
    # control: a verification told the wrong draft distribution (the logits tripled: a sharper q) is biased, and the
    # same test sees it
    lied = _verify(target, drafts, sampling, scale=3.0)
    control = chi_square_pvalue([r.tokens[0] for r in lied], p)
    print(f"control (logits x3): chi-square p-value {control:.3g}")
    assert control < ALPHA


def test_greedy_output_with_draft_logits_is_the_output_without_drafts(models):
    target, draft, _ = models
    drafts = _drafts(draft, 4, lambda i: SamplingParams(1.0, seed=i))
    plain = _run(target, [Request(PROMPT, K + 1, exclude_input_from_output=True) for _ in drafts])
    got = _verify(target, drafts, lambda i: SamplingParams())
    assert [r.tokens for r in got] == [r.tokens for r in plain]


@pytest.mark.parametrize(
    "logits, why",
    [
        (np.zeros((2, 512), np.float32), "needs one row of 512 logits per draft token (3 in draft_input_ids)"),
        (np.zeros((3, 100), np.float32), "needs one row of 512 logits per draft token"),
        (np.zeros(512, np.float32), "needs one row of 512 logits per draft token"),
        (np.full((3, 512), np.nan, np.float32), "holds a NaN or infinite value"),
        (np.array([[np.inf] * 512] * 3, np.float32), "holds a NaN or infinite value"),
    ],
    ids=["rows", "vocab", "1-d", "nan", "inf"],
)
def test_a_misshaped_or_non_finite_draft_logits_input_is_one_line(logits, why):
    """What the Triton twin checks before a request reaches the executor (a 4xx there, never a failed step)."""
    from trtpipe.serving.draft_logits import check_draft_logits

    with pytest.raises(ValueError, match="^draft_logits ") as info:
        check_draft_logits(logits, 3, 512)
    assert why in str(info.value) and "\n" not in str(info.value)
    padded = check_draft_logits(np.zeros((1, 3, 520), np.float32), 3, 512)  # an engine's padded rows: cut
    assert padded.shape == (3, 512)
