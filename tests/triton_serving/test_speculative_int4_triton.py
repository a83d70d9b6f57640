"""An INT4 copy of the target as its draft in upstream's two-model form, served by a real tritonserver through the
CPU twin: the measured acceptance rate, and greedy text identical to the text without speculation.

The draft is stories260k quantized INT4 AWQ through the pipeline (group 64; ``mlp.proj``, 172 inputs, and
``lm_head`` left unquantized; its unified HF export, as scripts/bench_speculative.py makes it), converted in its own
format by the draft_engine stage and served as ``tensorrt_llm_draft``; the target is stories260k in float32. The rate
(accepted / drafted over the prompt set, ``num_draft_tokens`` 3, 40 tokens each) is printed; docs/results/
speculative-two-model.md records it with this command.
"""

from __future__ import annotations

import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from test_speculative_triton import K, PROMPTS, RECIPES, bls, build_repo, speculative  # noqa: E402
from trtpipe.triton.server_process import start_server  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.slow]


def int4_export(tmp) -> object:
    """stories260k INT4 AWQ, exported (``trtpipe build recipes/stories-llmapi-fp8.yaml --set quantization.algo=int4_awq
    ... --until export``): its hf/ directory."""
    from trtpipe.app.stage_table import STAGES
    from trtpipe.app.validation import load_recipe
    from trtpipe.pipeline.runner import run_build

    sets = (
        "name=stories-int4-draft",
        f"work_dir={tmp}/work",
        "quantization.algo=int4_awq",
        "quantization.kv_cache=none",
        "quantization.group_size=64",
        'quantization.exclude=["*lm_head","*mlp.proj"]',
    )
    result = run_build(load_recipe(RECIPES / "stories-llmapi-fp8.yaml", sets), STAGES, until="export", quiet=True)
    return result.artifact("export") / "hf"


def test_int4_draft_measured_rate_and_identical_text(stories_dir, tmp_path_factory):
    draft = int4_export(tmp_path_factory.mktemp("int4"))
    repo = build_repo(tmp_path_factory.mktemp("spec4"), stories_dir, *speculative(draft))
    assert (repo / "tensorrt_llm_draft" / "engine" / "checkpoint").is_dir()
    accepted = drafted = 0
    with start_server(repo, timeout=240) as server:
        for prompt in PROMPTS:
            without = bls(server, prompt, 40)  # no num_draft_tokens: the target alone
            got = bls(server, prompt, 40, num_draft_tokens=K)
            assert got["text_output"] == without["text_output"], prompt
            a, d = (int(got[n].reshape(-1)[0]) for n in ("total_accepted_draft_tokens", "total_draft_tokens"))
            assert 0 <= a <= d and d > 0
            assert float(got["acceptance_rate"].reshape(-1)[0]) == pytest.approx(a / d, rel=1e-6)
            accepted, drafted = accepted + a, drafted + d
    rate = accepted / drafted
    print(
        f"\nINT4 AWQ draft, num_draft_tokens {K}, {len(PROMPTS)} prompts x 40 tokens: {accepted}/{drafted} = {rate:.3f}"
    )
    assert 0.0 < rate < 1.0  # the INT4 draft's argmax is not always the target's, nor never
