"""``--set llmapi.version=1.1`` is YAML's number 1.1: read as the release "1.1" (it was refused with "1.1 is not
allowed (allowed: 1.0, 1.1, 1.2)"); a version that is no release stays refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from trtpipe.app.validation import load_recipe
from trtpipe.errors import RecipeError

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "gpt-oss-20b-mxfp4.yaml"


@pytest.mark.parametrize(
    "value,want", [("1.1", "1.1"), ("1.0", "1.0"), ("'1.2'", "1.2"), ("1.2", "1.2"), ("1.3", "1.3")]
)
def test_a_release_given_as_a_number_is_that_release(value, want):
    assert load_recipe(RECIPE, overrides=[f"llmapi.version={value}"]).llmapi.version == want


@pytest.mark.parametrize("value", ["2", "1.25", "true"])
def test_other_values_stay_refused(value):
    with pytest.raises(RecipeError, match=r"llmapi\.version: .* is not allowed \(allowed: 1\.0, 1\.1, 1\.2"):
        load_recipe(RECIPE, overrides=[f"llmapi.version={value}"])
