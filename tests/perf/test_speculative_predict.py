"""The speculative step model (trtpipe/perf/speculative.py) and ``trtpipe predict --acceptance-length``.

Checked by construction: a verification reads the same weights and KV as a plain step and does (k + 1) x its GEMM
work; the speed-up is AL x plain / (verify + draft); a head is one target-shaped layer over the draft vocabulary;
k draft forwards cost k x one draft step. The CLI's block equals the library's numbers for the recipe's drafter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from trtpipe.cli import main
from trtpipe.errors import TrtpipeError
from trtpipe.formats.gpus import get_gpu
from trtpipe.perf.cost import Constants, Deployment, group_terms, step_time
from trtpipe.perf.models import published_spec
from trtpipe.perf.speculative import draft_deployment, head_spec, speculative_step, verify_terms

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
LLAMA70B = RECIPES / "llama-3.1-70b-fp8-llmapi.yaml"
C = Constants()


@pytest.fixture(scope="module")
def d70():
    return Deployment(published_spec("Llama 3.3 70B"), get_gpu("h100-sxm-80gb"), "fp8", "fp8", 4)


def test_a_verification_reads_what_a_plain_step_reads_and_computes_k_plus_1_tokens(d70):
    plain = group_terms(d70, [], [(1024, 8)], 8)
    v = verify_terms(d70, 8, 1024, 3)
    assert (v.mem, v.kv) == (plain.mem, plain.kv)
    assert v.gemm == pytest.approx(4 * plain.gemm)  # dense GEMMs and lm_head rows both scale with the tokens
    assert v.attn > 4 * plain.attn  # each of the k + 1 queries also attends to the drafts before it


def test_speedup_is_acceptance_length_times_plain_over_verify_and_draft(d70):
    s = speculative_step(d70, C, 4, 1024, 3, 2.5)
    assert s.draft_s == 0.0  # n-gram style: no drafter
    assert s.plain_s == pytest.approx(float(step_time(group_terms(d70, [], [(1024, 4)], 4), C)))
    assert s.verify_s == pytest.approx(float(step_time(verify_terms(d70, 4, 1024, 3), C)))
    assert s.speedup == pytest.approx(2.5 * s.plain_s / s.verify_s)
    assert speculative_step(d70, C, 4, 1024, 3, 1.0).speedup < 1  # nothing accepted: verification only costs


def test_a_head_is_one_target_layer_over_the_draft_vocabulary_and_k_drafts_cost_k_steps(d70):
    head = head_spec(d70.model, vocab=32000)
    assert (head.num_layers, head.vocab, head.hidden) == (1, 32000, 8192)
    assert head.layers[0].attn_params == d70.model.layers[0].attn_params
    drafter = draft_deployment(d70, "Eagle3", draft_vocab=32000)
    one = float(step_time(group_terms(drafter, [], [(1024, 2)], 2), C))
    assert speculative_step(d70, C, 2, 1024, 5, 3.0, drafter).draft_s == pytest.approx(5 * one)
    assert draft_deployment(d70, "NGram") is None
    with pytest.raises(TrtpipeError, match="draft model's config is needed"):
        draft_deployment(d70, "DraftTarget")


@pytest.mark.parametrize("al", [0.5, 4.5])
def test_an_acceptance_length_outside_1_to_k_plus_1_is_refused(d70, al):
    with pytest.raises(TrtpipeError, match=r"outside \[1, max_draft_len \+ 1 = 4\]"):
        speculative_step(d70, C, 1, 1024, 3, al)


def _predict(*args: str):
    return CliRunner().invoke(main, ["predict", str(LLAMA70B), "--isl", "256", "--osl", "32", *args])


def test_predict_adds_the_speculative_block_of_the_recipe():
    from trtpipe.app import predictor as P
    from trtpipe.perf.fit import load_constants

    res = _predict(
        "--set", "speculative.decoding_type=NGram", "--concurrency", "2", "--acceptance-length", "1.8", "--json"
    )
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)["speculative"]
    setup = P.recipe_setup(LLAMA70B)
    s = speculative_step(setup.deployment, load_constants()["pytorch"], 2, 256 + 16, 3, 1.8)
    assert (got["decoding_type"], got["max_draft_len"], got["batch"], got["kv_len"]) == ("NGram", 3, 2, 272)
    assert got["decode_speedup"] == round(s.speedup, 3)
    assert got["draft_ms"] == 0.0


def test_predict_acceptance_length_without_speculation_is_one_line():
    res = _predict("--acceptance-length", "2")
    assert res.exit_code != 0
    assert (
        res.output.strip()
        .splitlines()[-1]
        .endswith("--acceptance-length: the recipe has no speculative decoding (set speculative.decoding_type)")
    )


def test_medusa_heads_run_inside_the_verification_not_as_draft_forwards(d70):
    """Upstream computes the Medusa heads in the verification forward (GenericMedusaForCausalLM.forward,
    tensorrt_llm/models/medusa/model.py@02499765): no draft forwards; the verification reads the heads' 16-bit
    weights once (split over tp) and runs their GEMMs over all batch x (k + 1) positions."""
    from trtpipe.perf.cost import GB, TERA
    from trtpipe.perf.speculative import medusa_terms

    assert draft_deployment(d70, "medusa") is None
    m, g = d70.model, d70.gpu
    t = medusa_terms(d70, 8 * 64, num_heads=4, num_layers=1)
    params = 4 * (m.hidden * m.hidden + m.hidden + m.hidden * m.vocab) / d70.tp
    assert t.mem == pytest.approx(params * 2 / (g.bandwidth_gbs * GB))
    assert t.gemm == pytest.approx(2 * 8 * 64 * params / (g.tflops_16 * TERA))
    plain = speculative_step(d70, C, 8, 1024, 63, 3.0)
    s = speculative_step(d70, C, 8, 1024, 63, 3.0, None, medusa_heads=4)
    assert s.draft_s == 0.0
    assert s.verify_s == pytest.approx(float(step_time(verify_terms(d70, 8, 1024, 63) + t, C)))
    assert s.verify_s > plain.verify_s  # the heads are not free: they add to the one forward
    # a sequential-forward model would have cost k = 63 target-shaped layers; the heads cost less than one plain step
    assert s.verify_s - plain.verify_s < s.plain_s


def test_the_recipe_names_how_many_medusa_heads_the_verification_runs():
    from trtpipe.app.spec_prediction import medusa_heads
    from trtpipe.app.validation import load_recipe

    def recipe(*sets):
        return load_recipe(LLAMA70B, ["speculative.decoding_type=medusa", *sets], check_rules=False)

    r = recipe("speculative.max_draft_len=4", "speculative.medusa_choices=[[0],[1],[0,0],[0,0,0]]")
    assert medusa_heads(r) == (3, 1)  # no readable heads config: the depth of the choices
    assert medusa_heads(recipe("speculative.max_draft_len=3", "speculative.num_medusa_heads=4")) == (4, 1)
    assert medusa_heads(load_recipe(LLAMA70B, ["speculative.decoding_type=NGram"], check_rules=False)) == (0, 1)


def test_an_eagle_tree_drafts_one_forward_per_level():
    """engine-path EAGLE: one EagleNet per level of eagle_choices (num_eagle_layers), so a 4-node tree of depth 2
    costs 2 head steps, where a chain of 4 costs 4 (the predictor's block for the recipe, from the library: the CLI
    validates the head directory first)."""
    from trtpipe.app import predictor as P
    from trtpipe.app.spec_prediction import drafter, speculative_block
    from trtpipe.app.validation import load_recipe
    from trtpipe.perf.fit import load_constants

    sets = ["speculative.decoding_type=eagle", "speculative.max_draft_len=4"]
    tree = [*sets, "speculative.eagle_choices=[[0], [1], [0, 0], [1, 0]]"]
    setup = P.recipe_setup(LLAMA70B)
    c = load_constants()["pytorch"]
    summary = {"ttft_ms": {"p50": 50.0}, "itl_ms": {"p50": 10.0}, "output_tok_s": 100.0}
    got = speculative_block(LLAMA70B, tree, setup.deployment, c, summary, 1, 256, 32, 2.0)
    head = drafter(load_recipe(LLAMA70B, tree, check_rules=False), setup.deployment)
    s = speculative_step(setup.deployment, c, 1, 256 + 16, 4, 2.0, head, draft_forwards=2)
    assert (got["draft_forwards"], got["draft_ms"]) == (2, round(s.draft_s * 1e3, 3))
    chain = speculative_block(LLAMA70B, sets, setup.deployment, c, summary, 1, 256, 32, 2.0)
    assert chain["draft_forwards"] == 4 and chain["draft_ms"] == pytest.approx(2 * got["draft_ms"], rel=1e-3)


def test_an_eagle3_tree_drafts_one_forward_per_level_too():
    """llmapi EAGLE-3 with eagle_choices drafts level by level as the engine's EagleNets do (the twin's tree
    drafter, trtpipe/serving/eagle1.py): a 4-node tree of depth 2 costs 2 head forwards, the chain of 4 costs 4;
    n-gram drafts cost no forward at all."""
    from trtpipe.app import predictor as P
    from trtpipe.app.spec_prediction import speculative_block
    from trtpipe.perf.fit import load_constants

    sets = ["speculative.decoding_type=Eagle3", "speculative.max_draft_len=4", "speculative.eagle3_one_model=false"]
    tree = [*sets, "speculative.eagle_choices=[[0], [1], [0, 0], [1, 0]]"]
    setup = P.recipe_setup(LLAMA70B)
    c = load_constants()["pytorch"]
    summary = {"ttft_ms": {"p50": 50.0}, "itl_ms": {"p50": 10.0}, "output_tok_s": 100.0}
    got = speculative_block(LLAMA70B, tree, setup.deployment, c, summary, 1, 256, 32, 2.0)
    chain = speculative_block(LLAMA70B, sets, setup.deployment, c, summary, 1, 256, 32, 2.0)
    assert (got["draft_forwards"], chain["draft_forwards"]) == (2, 4)
    assert chain["draft_ms"] == pytest.approx(2 * got["draft_ms"], rel=1e-3)
    ngram = speculative_block(
        LLAMA70B, ["speculative.decoding_type=NGram"], setup.deployment, c, summary, 1, 256, 32, 2.0
    )
    assert (ngram["draft_forwards"], ngram["draft_ms"]) == (0, 0.0)


def test_the_dynamic_tree_drafts_one_forward_per_layer_and_verifies_all_its_tokens():
    """EAGLE-3's dynamic tree (llmapi 1.3, one model): max_draft_len is its depth D (upstream's meaning), so D head
    forwards per step, and the verification carries max_total_draft_tokens + 1 rows per request."""
    from trtpipe.app import predictor as P
    from trtpipe.app.spec_prediction import speculative_block
    from trtpipe.perf.fit import load_constants

    sets = [
        "speculative.decoding_type=Eagle3",
        "speculative.max_draft_len=3",
        "speculative.eagle3_one_model=true",
        "speculative.use_dynamic_tree=true",
        "speculative.dynamic_tree_max_top_k=3",
        "speculative.max_total_draft_tokens=8",
    ]
    setup = P.recipe_setup(LLAMA70B)
    c = load_constants()["pytorch"]
    summary = {"ttft_ms": {"p50": 50.0}, "itl_ms": {"p50": 10.0}, "output_tok_s": 100.0}
    got = speculative_block(LLAMA70B, sets, setup.deployment, c, summary, 1, 256, 32, 2.0)
    assert (got["draft_forwards"], got["max_draft_len"]) == (3, 8)
    with pytest.raises(TrtpipeError, match=r"outside \[1, max_draft_len \+ 1 = 4\]"):
        speculative_block(LLAMA70B, sets, setup.deployment, c, summary, 1, 256, 32, 4.5)
