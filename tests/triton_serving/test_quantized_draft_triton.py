"""A draft quantized by the pipeline (``speculative.draft_quantization: int4_awq``: the draft_engine stage quantizes
the plain stories260k with the recipe's quantization section and that algorithm) served in upstream's two-model form
by a real tritonserver through the CPU twin, beside a float32 target that is not quantized.

Shown: the served draft engine is INT4 AWQ (group 64); greedy BLS text with ``num_draft_tokens`` 3 equals the plain
repository's over the prompt set; the acceptance (accepted / drafted, summed over the prompts, 40 tokens each) is
measured and printed (docs/results/speculative-two-model.md records it with this command).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from test_speculative_triton import K, PROMPTS, bls, build_repo, speculative  # noqa: E402
from trtpipe.triton.server_process import start_server  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.slow]

QUANTIZED_DRAFT = (
    "speculative.draft_quantization=int4_awq",
    "quantization.group_size=64",
    'quantization.exclude=["*lm_head","*mlp.proj"]',
    "quantization.calibration.num_samples=16",
    "quantization.calibration.seq_len=64",
    "quantization.calibration.device=cpu",
)


@pytest.fixture(scope="module")
def repos(stories_dir, tmp_path_factory):
    plain = build_repo(tmp_path_factory.mktemp("plain"), stories_dir)
    spec = build_repo(tmp_path_factory.mktemp("qdraft"), stories_dir, *speculative(stories_dir), *QUANTIZED_DRAFT)
    return plain, spec


def test_a_pipeline_quantized_draft_keeps_greedy_text_through_tritonserver(repos):
    plain_repo, spec_repo = repos
    cfg = json.loads((spec_repo / "tensorrt_llm_draft" / "engine" / "checkpoint" / "config.json").read_text())
    assert cfg["quantization"]["quant_algo"] == "W4A16_AWQ" and cfg["quantization"]["group_size"] == 64
    target = json.loads((spec_repo / "tensorrt_llm" / "engine" / "checkpoint" / "config.json").read_text())
    assert not target["quantization"].get("quant_algo")  # only the draft is quantized
    with start_server(plain_repo, timeout=240) as plain, start_server(spec_repo, timeout=240) as spec:
        drafted = accepted = 0
        for prompt in PROMPTS:
            want = bls(plain, prompt, 40)
            got = bls(spec, prompt, 40, num_draft_tokens=K)
            assert got.get("text_output") == want["text_output"], (prompt, got)
            drafted += int(got["total_draft_tokens"].reshape(-1)[0])
            accepted += int(got["total_accepted_draft_tokens"].reshape(-1)[0])
    print(
        f"\nINT4-AWQ draft (draft_quantization: int4_awq) of a float32 target through tritonserver, k={K}: "
        f"{accepted} of {drafted} drafts accepted ({accepted / drafted:.3f})"
    )
    assert 0 < accepted <= drafted
