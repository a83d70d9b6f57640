"""Recipe validation: every cross-field rule in one list, and the recipe loader that runs them.

Each package keeps the rules about its own facts beside them: the recipe's layout and consistency
(``trtpipe/recipe/rules.py``), the quantized layouts (``trtpipe/quant/rules.py``), pre-quantized sources
(``trtpipe/quant/imported/rules.py``), what trtllm-build would refuse
or silently change and the memory plan (``trtpipe/engine/rules.py``), the llmapi target
(``trtpipe/export/rules.py``), the deployment (``trtpipe/deploy/rules.py``). This module is the only one that
knows all of them. It sits above those packages:
each of them imports the recipe schema and none imports this, so the rules are composed here in one visible list,
nothing registers itself on import, and the recipe package never reaches up for them.

``trtpipe validate`` and every command that takes a recipe load it through :func:`load_recipe`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from trtpipe.deploy.rules import DEPLOY_RULES
from trtpipe.engine.lora_build import ENGINE_LORA_RULES
from trtpipe.engine.rules import ENGINE_RULES
from trtpipe.errors import Problem, RecipeError
from trtpipe.export.lora import LORA_RULES
from trtpipe.export.options_rules import OPTIONS_RULES
from trtpipe.export.rules import EXPORT_RULES
from trtpipe.quant.draft_rules import DRAFT_QUANT_RULES
from trtpipe.quant.imported.rules import IMPORT_RULES
from trtpipe.quant.rules import QUANT_RULES
from trtpipe.recipe import rules as recipe_rules
from trtpipe.recipe.guided_rules import GUIDED_RULES
from trtpipe.recipe.loader import parse_recipe
from trtpipe.recipe.rules import RECIPE_RULES, Rule
from trtpipe.recipe.schema import Recipe
from trtpipe.recipe.speculative import SPECULATIVE_RULES

# In this order; problems are reported in file order, and rules that name the same key keep this order.
RULES: tuple[Rule, ...] = (
    *RECIPE_RULES,
    *GUIDED_RULES,
    *SPECULATIVE_RULES,
    *QUANT_RULES,
    *IMPORT_RULES,
    *DRAFT_QUANT_RULES,
    *ENGINE_RULES,
    *EXPORT_RULES,
    *OPTIONS_RULES,
    *LORA_RULES,
    *ENGINE_LORA_RULES,
    *DEPLOY_RULES,
)


def check_recipe(recipe: Recipe) -> list[Problem]:
    """Every problem :data:`RULES` finds in ``recipe``, with the file position of the key each one names."""
    return recipe_rules.check_recipe(recipe, RULES)


def load_recipe(path: str | Path, overrides: Iterable[str] = (), check_rules: bool = True) -> Recipe:
    """Read, validate and cross-check a recipe; raise :class:`RecipeError` with every problem found.

    Args:
        path: the recipe YAML file.
        overrides: ``dotted.key=value`` strings applied on top of the file (``--set``).
        check_rules: also run :data:`RULES` (reads the model's config.json, never its weights).

    Raises:
        RecipeError: one problem per line; nothing else escapes.
    """
    recipe = parse_recipe(path, overrides)
    if check_rules:
        problems = check_recipe(recipe)
        if problems:
            raise RecipeError(problems)
    return recipe
