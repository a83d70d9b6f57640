"""Recipe schema and loading. Only this package and ``trtpipe.cli`` know about YAML."""

from trtpipe.recipe.loader import load_recipe
from trtpipe.recipe.schema import Recipe

__all__ = ["Recipe", "load_recipe"]
