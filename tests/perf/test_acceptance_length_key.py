"""``speculative.acceptance_length`` (trtpipe's own key): the acceptance length ``trtpipe plan`` and ``trtpipe predict``
use when no ``--acceptance-length`` is given (the flag overrides it); out of [1, max_draft_len + 1] it is one line
naming the key. The numbers equal the step model's (trtpipe/perf/speculative.py) for the recipe's deployment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from trtpipe.app.validation import check_recipe, load_recipe
from trtpipe.cli import main
from trtpipe.perf.speculative import speculative_step

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
LLAMA70B = RECIPES / "llama-3.1-70b-fp8-llmapi.yaml"
NGRAM = ("--set", "speculative.decoding_type=NGram")
KEY = ("--set", "speculative.acceptance_length=1.8")


def _run(*args: str):
    return CliRunner().invoke(main, [args[0], str(LLAMA70B), *args[1:]])


def _expected(batch: int, kv_len: int, al: float) -> float:
    from trtpipe.app import predictor as P
    from trtpipe.perf.fit import load_constants

    setup = P.recipe_setup(LLAMA70B)
    return round(speculative_step(setup.deployment, load_constants()["pytorch"], batch, kv_len, 3, al).speedup, 3)


def test_predict_reads_the_key_and_the_flag_overrides_it():
    base = ("predict", "--isl", "256", "--osl", "32", "--concurrency", "2", "--json", *NGRAM, *KEY)
    res = _run(*base)
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)["speculative"]
    assert (got["acceptance_length"], got["decode_speedup"]) == (1.8, _expected(2, 272, 1.8))
    res = _run(*base, "--acceptance-length", "2.5")
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)["speculative"]
    assert (got["acceptance_length"], got["decode_speedup"]) == (2.5, _expected(2, 272, 2.5))


def test_plan_adds_the_decode_speedup_of_the_key():
    res = _run("plan", "--json", *NGRAM, *KEY)
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    batch = got["max_batch_size"]
    v = got["speculative"]
    assert (v["acceptance_length"], v["batch"], v["kv_len"]) == (1.8, batch, 1024 + 128)
    assert v["decode_speedup"] == _expected(batch, 1152, 1.8)
    text = _run("plan", *NGRAM, *KEY, "--acceptance-length", "2")
    assert text.exit_code == 0, text.output
    assert f"speculative NGram k=3, acceptance length 2: decode step x{_expected(batch, 1152, 2.0):.2f}" in text.output
    plain = _run("plan", "--json")  # no key, no flag: no speculative block
    assert "speculative" not in json.loads(plain.output)


@pytest.mark.parametrize(
    "sets, expected",
    [
        (
            ("speculative.decoding_type=NGram", "speculative.acceptance_length=4.5"),
            "speculative.acceptance_length: 4.5 is outside [1, max_draft_len + 1 = 4]: it counts the accepted drafts "
            "plus the target's own token per target forward",
        ),
        (
            ("speculative.decoding_type=NGram", "speculative.acceptance_length=0.5"),
            "speculative.acceptance_length: 0.5 is outside [1, max_draft_len + 1 = 4]: it counts the accepted drafts "
            "plus the target's own token per target forward",
        ),
        (
            ("speculative.acceptance_length=2",),
            "speculative.acceptance_length: set without speculative decoding (decoding_type none): remove it",
        ),
        (  # a tree accepts one path: 4 nodes of depth 2 give at most 3 tokens per forward, not 5
            (
                "speculative.decoding_type=medusa",
                "speculative.max_draft_len=4",
                "speculative.medusa_choices=[[0],[1],[0,0],[1,0]]",
                "speculative.acceptance_length=3.5",
            ),
            "speculative.acceptance_length: 3.5 is outside [1, the depth of medusa_choices + 1 = 3]: it counts the "
            "accepted drafts plus the target's own token per target forward",
        ),
        (  # lookahead accepts at most N - 1 tokens of one n-gram although it verifies 15
            (
                "speculative.decoding_type=lookahead_decoding",
                "speculative.max_draft_len=15",
                "speculative.acceptance_length=3.5",
            ),
            "speculative.acceptance_length: 3.5 is outside [1, max_ngram_size = 3]: it counts the accepted drafts "
            "plus the target's own token per target forward",
        ),
    ],
    ids=["above-k-plus-1", "below-1", "without-speculation", "medusa-tree-depth", "lookahead-ngram"],
)
def test_an_acceptance_length_out_of_range_is_one_line_naming_the_key(sets, expected):
    problems = [f"{p.key}: {p.message}" for p in check_recipe(load_recipe(LLAMA70B, list(sets), check_rules=False))]
    assert expected in problems, problems


def test_no_stage_key_depends_on_the_acceptance_length():
    """It informs plan and predict only: changing it rebuilds nothing (schema: keyed false); max_draft_len still
    changes the keys of the stages that take the speculative section."""
    from trtpipe.app.stage_table import STAGES
    from trtpipe.pipeline.keys import stage_key

    def keys(*sets):
        r = load_recipe(LLAMA70B, ["speculative.decoding_type=NGram", *sets], check_rules=False)
        return {s.name: stage_key(s, r, {})[0] for s in STAGES if "speculative" in s.sections}

    base = keys()
    assert base and keys("speculative.acceptance_length=2.5") == base
    assert all(keys("speculative.max_draft_len=4")[name] != key for name, key in base.items())
