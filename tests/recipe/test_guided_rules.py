"""serving.guided_decoding_backend in the recipe: its values, and the combinations TensorRT-LLM refuses only at run
time (feature_combination_matrix.md@116f6ea9; llguidance on the engine target) refused by validate in one line."""

from __future__ import annotations

import pytest
from recipe_helpers import RECIPES

from trtpipe.app.validation import load_recipe
from trtpipe.errors import RecipeError
from trtpipe.recipe.guided_rules import _guided_combinations
from trtpipe.recipe.schema import SpeculativeSection


def test_backend_values():
    assert load_recipe(RECIPES / "stories-fp16.yaml").serving.guided_decoding_backend is None
    r = load_recipe(RECIPES / "stories-fp16.yaml", ["serving.guided_decoding_backend=xgrammar"])
    assert r.serving.guided_decoding_backend == "xgrammar"
    llm = load_recipe(RECIPES / "stories-llmapi-fp8.yaml", ["serving.guided_decoding_backend=llguidance"])
    assert llm.serving.guided_decoding_backend == "llguidance"  # the PyTorch backend takes it
    with pytest.raises(RecipeError, match="serving.guided_decoding_backend"):
        load_recipe(RECIPES / "stories-fp16.yaml", ["serving.guided_decoding_backend=outlines"])


def test_llguidance_on_the_engine_target_is_refused_in_one_line():
    with pytest.raises(RecipeError) as err:
        load_recipe(RECIPES / "stories-fp16.yaml", ["serving.guided_decoding_backend=llguidance"])
    lines = [line for line in str(err.value).splitlines() if "guided_decoding_backend" in line]
    assert len(lines) == 1 and "llguidance runs on the PyTorch backend only" in lines[0], str(err.value)


@pytest.mark.parametrize(
    "spec, refused",
    [
        (dict(decoding_type="MTP", eagle3_one_model=True), "MTP"),
        (dict(decoding_type="Eagle3", eagle3_one_model=True), "EAGLE-3 one-model"),
        (dict(decoding_type="Eagle3", eagle3_one_model=False), None),  # two-model: Yes in the matrix
        (dict(decoding_type="NGram", eagle3_one_model=True), None),
    ],
)
def test_matrix_no_with_speculative(spec, refused):
    """The recipe's speculative section (issue 40), alone: the speculative rules of its own (MTP layers, SM) are not
    this rule's."""
    r = load_recipe(RECIPES / "stories-llmapi-fp8.yaml", ["serving.guided_decoding_backend=xgrammar"])
    r = r.model_copy(update={"speculative": SpeculativeSection(**spec)})
    found = list(_guided_combinations(r, None))
    if refused is None:
        assert found == []
    else:
        assert len(found) == 1 and found[0][0] == "serving.guided_decoding_backend" and refused in found[0][1]
