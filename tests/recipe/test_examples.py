"""Every example recipe validates, through the library and through `trtpipe validate`."""

from __future__ import annotations

import pytest

from trtpipe.errors import RecipeError
from trtpipe.recipe.rules import load_model_info
from trtpipe.app.validation import load_recipe

from recipe_helpers import RECIPES, run_cli

# example recipes, not what builds write under a recipe's work dir (e.g. an llmapi build's YAML)
EXAMPLES = sorted(p for p in RECIPES.rglob("*.yaml") if "work" not in p.relative_to(RECIPES).parts)
REQUIRED = {
    "llama70b-fp8",
    "llama3-8b-int4-awq",
    "llama2-13b-int8-sq",
    "mixtral-8x7b-fp8",
    "stories-fp16",
    "stories-fp8",
    "stories-int8-sq",
    "stories-int4-awq",
    "stories-tp2",
}

# Example recipes another area's rule rejects today (reported to the lead; strict: this fails once it validates).
KNOWN_REJECTED: dict[str, str] = {}  # stem -> expected error, for a recipe a rule is known to refuse


def _param(path):
    reason = KNOWN_REJECTED.get(path.stem)
    marks = (
        [pytest.mark.xfail(raises=RecipeError, strict=True, reason=f"trtpipe/quant/rules.py: {reason}")]
        if reason
        else []
    )
    return pytest.param(path, id=path.stem, marks=marks)


def test_the_issue_lists_are_all_there():
    assert REQUIRED <= {p.stem for p in EXAMPLES}


@pytest.mark.parametrize("path", [_param(p) for p in EXAMPLES])
def test_example_validates(path):
    recipe = load_recipe(path)
    assert recipe.name == path.stem
    model, findings = load_model_info(recipe)
    assert findings == [] and model is not None  # the model config was really read, not skipped


def test_validate_all_examples_in_one_call():
    result = run_cli("validate", *map(str, EXAMPLES))
    assert result.stdout.splitlines() == [f"{p}: ok" for p in EXAMPLES if p.stem not in KNOWN_REJECTED]
    assert result.exit_code == (2 if KNOWN_REJECTED else 0), result.stderr
    for stem, reason in KNOWN_REJECTED.items():
        assert reason in result.stderr


def test_llama70b_is_what_the_issue_asks():
    r = load_recipe(RECIPES / "llama70b-fp8.yaml")
    model, _ = load_model_info(r)
    assert (r.quantization.algo, r.quantization.kv_cache, r.parallel.tp, r.engine.gpu) == (
        "fp8",
        "fp8",
        4,
        "h100-sxm-80gb",
    )
    assert (model.num_layers, model.num_heads, model.num_kv_heads, model.hidden_size) == (80, 64, 8, 8192)


def test_tiny_recipes_use_the_model_in_the_repository(stories_dir):
    for name, algo, tp in [
        ("stories-fp16", "none", 1),
        ("stories-fp8", "fp8", 1),
        ("stories-int8-sq", "int8_sq", 1),
        ("stories-int4-awq", "int4_awq", 1),
        ("stories-tp2", "none", 2),
    ]:
        r = load_recipe(RECIPES / f"{name}.yaml")
        assert r.resolve(r.model.source) == stories_dir.resolve()
        assert (r.quantization.algo, r.parallel.tp, r.model.dtype) == (algo, tp, "float16")
        assert r.work_path.is_relative_to(RECIPES)  # inside recipes/work/, which .gitignore ignores
