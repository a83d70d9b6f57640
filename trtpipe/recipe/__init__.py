"""Recipe schema and loading. Only this package and ``trtpipe.cli`` know about YAML."""

from trtpipe.errors import RecipeError
from trtpipe.recipe.loader import parse_recipe
from trtpipe.recipe.schema import Recipe

__all__ = ["Recipe", "RecipeError", "parse_recipe"]
