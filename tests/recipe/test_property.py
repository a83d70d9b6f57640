"""Property: whatever is in a recipe file (or an override), load_recipe returns a Recipe or raises RecipeError.

Three generators: structured mutations of a valid recipe (delete / insert / retype keys and values at any
depth), text edits of a valid recipe's YAML, and arbitrary text. Any other exception is a bug.
"""

from __future__ import annotations

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from recipe_helpers import RECIPES

from trtpipe.errors import RecipeError
from trtpipe.recipe import Recipe
from trtpipe.app.validation import load_recipe

BASE_TEXT = (RECIPES / "stories-fp8.yaml").read_text()
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))

KEYS = st.sampled_from(
    [
        "name",
        "model",
        "source",
        "tp",
        "pp",
        "algo",
        "engine",
        "kv_cache",
        "plugins",
        "overrides",
        "exclude",
        "calibration",
        "dataset",
        "bind",
        "http_port",
        "group_size",
        "max_seq_len",
    ]
) | st.text(max_size=8)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**60), max_value=10**60)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(["self", "fp8", "int8", "none", "~nobody/x", "hf://a", "../..", "/", "0.0.0.0", "a" * 300])
)
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3), max_leaves=8
)


def _base(stories_dir) -> dict:
    data = yaml.safe_load(BASE_TEXT)
    data["model"]["source"] = str(stories_dir)
    return data


def _paths(node, prefix=()):
    """Every (path to a mapping or list) in the data, so a mutation can land at any depth."""
    yield prefix
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        if isinstance(v, (dict, list)):
            yield from _paths(v, prefix + (k,))


@st.composite
def mutated(draw, stories_dir):
    data = _base(stories_dir)
    for _ in range(draw(st.integers(1, 4))):
        paths = list(_paths(data))
        path = draw(st.sampled_from(paths))
        node = data
        for k in path:
            node = node[k]
        op = draw(st.sampled_from(["delete", "insert", "replace"]))
        if isinstance(node, dict):
            if op == "delete" and node:
                del node[draw(st.sampled_from(sorted(node, key=str)))]
            elif op == "replace" and node:
                node[draw(st.sampled_from(sorted(node, key=str)))] = draw(VALUES)
            else:
                node[draw(KEYS | st.integers() | st.booleans())] = draw(VALUES)
        elif isinstance(node, list):
            if op == "delete" and node:
                node.pop(draw(st.integers(0, len(node) - 1)))
            else:
                node.append(draw(VALUES))
    return data


def _check(path, overrides=()):
    try:
        result = load_recipe(path, overrides)
    except RecipeError as exc:
        assert exc.problems and all(str(p) for p in exc.problems)
        assert "\n" not in "".join(p.message for p in exc.problems)  # one line per problem
    else:
        assert isinstance(result, Recipe)


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory):
    return tmp_path_factory.mktemp("prop") / "recipe.yaml"


@SETTINGS
@given(data=st.data())
def test_mutated_recipes_raise_only_recipe_error(data, recipe_path, stories_dir):
    recipe = data.draw(mutated(stories_dir))
    recipe_path.write_text(yaml.safe_dump(recipe, allow_unicode=True))
    _check(recipe_path)


@SETTINGS
@given(
    pos=st.integers(0, len(BASE_TEXT)),
    cut=st.integers(0, 40),
    insert=st.text(max_size=30)
    | st.sampled_from(
        [":", "- ", "\t", "{", "[", "&a", "*a", "!!python/name:os.system", "<<: *a", "\n  ", "? ", "%YAML 9", "---"]
    ),
)
def test_edited_yaml_text_raises_only_recipe_error(pos, cut, insert, recipe_path, stories_dir):
    text = BASE_TEXT.replace("../models/stories260k", str(stories_dir))
    pos = min(pos, len(text))
    recipe_path.write_text(text[:pos] + insert + text[pos + cut :], encoding="utf-8")
    _check(recipe_path)


@SETTINGS
@given(text=st.text(max_size=200) | st.binary(max_size=200))
def test_arbitrary_files_raise_only_recipe_error(text, recipe_path):
    if isinstance(text, bytes):
        recipe_path.write_bytes(text)
    else:
        recipe_path.write_text(text, encoding="utf-8", errors="surrogatepass")
    _check(recipe_path)


@SETTINGS
@given(
    overrides=st.lists(
        st.text(max_size=30)
        | st.builds(
            lambda k, v: f"{k}={v}",
            st.sampled_from(
                [
                    "parallel.tp",
                    "engine",
                    "engine.kv_cache.max_tokens",
                    "quantization.exclude",
                    "name",
                    "model.source",
                    "x.y.z",
                    "",
                ]
            ),
            st.text(max_size=15),
        ),
        max_size=4,
    )
)
def test_overrides_raise_only_recipe_error(overrides, stories_dir):
    _check(RECIPES / "stories-fp8.yaml", overrides)


MODEL_DIRS = [RECIPES / "configs" / m for m in ("llama-3.1-70b", "llama-3-8b", "llama-2-13b", "mixtral-8x7b")]
VALID_SHAPED = st.fixed_dictionaries(
    {
        "name": st.just("p"),
        "model": st.fixed_dictionaries(
            {
                "source": st.sampled_from(["STORIES"] + [str(d) for d in MODEL_DIRS]),
                "dtype": st.sampled_from(["auto", "float16", "bfloat16", "float32"]),
            }
        ),
        "quantization": st.fixed_dictionaries(
            {
                "algo": st.sampled_from(["none", "fp8", "int8_sq", "int8_wo", "int4_wo", "int4_awq", "w4a8_awq"]),
                "kv_cache": st.sampled_from(["none", "fp8", "int8"]),
                "group_size": st.sampled_from([32, 64, 128, 256]),
            }
        ),
        "parallel": st.fixed_dictionaries(
            {
                "tp": st.sampled_from([1, 2, 4, 8]),
                "pp": st.integers(1, 6),
                "moe_ep": st.sampled_from([-1, 1, 2]),
                "moe_tp": st.sampled_from([-1, 1, 2]),
            }
        ),
        "engine": st.fixed_dictionaries(
            {
                "gpu": st.sampled_from(
                    ["h100-sxm-80gb", "a100-sxm-80gb", "l4-24gb", "b200-180gb", "a10g-24gb", "no-such-gpu"]
                ),
                "max_batch_size": st.integers(1, 4096),
                "max_input_len": st.integers(1, 10**6),
                "max_seq_len": st.none() | st.integers(2, 10**6),
                "max_num_tokens": st.integers(1, 10**6),
                "max_beam_width": st.integers(1, 16),
                "workers": st.integers(1, 8),
                "plugins": st.sampled_from(["auto", "no-such-preset"]),
                "kv_cache": st.fixed_dictionaries(
                    {
                        "tokens_per_block": st.sampled_from([1, 8, 32, 64, 1024]),
                        "free_gpu_memory_fraction": st.floats(0.01, 0.99),
                        "max_tokens": st.none() | st.integers(1, 2**31 - 1),
                        "enable_reuse": st.booleans(),
                    }
                ),
            }
        ),
        "triton": st.fixed_dictionaries(
            {
                "max_batch_size": st.integers(1, 4096),
                "streaming": st.booleans(),
                "bls": st.booleans(),
                "batching_strategy": st.sampled_from(["inflight_fused_batching", "inflight_batching", "v1"]),
            }
        ),
    }
)


@SETTINGS
@given(recipe=VALID_SHAPED)
def test_schema_valid_recipes_never_crash_a_rule(recipe, recipe_path, stories_dir):
    """Every rule of trtpipe.app.validation.RULES (the recipe's, quantization's, the engine's, the export's) on
    in-range values of every kind."""
    if recipe["model"]["source"] == "STORIES":
        recipe["model"]["source"] = str(stories_dir)
    recipe_path.write_text(yaml.safe_dump(recipe))
    _check(recipe_path)
