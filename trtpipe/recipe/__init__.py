"""Recipe schema and loading. Only this package and ``trtpipe.cli`` know about YAML."""

from trtpipe.errors import RecipeError
from trtpipe.recipe.loader import load_recipe, parse_recipe
from trtpipe.recipe.rules import RULES, check_recipe
from trtpipe.recipe.schema import Recipe

__all__ = ["RULES", "Recipe", "RecipeError", "check_recipe", "load_recipe", "parse_recipe"]
