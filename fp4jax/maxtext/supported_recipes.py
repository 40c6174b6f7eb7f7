"""Which fp4jax recipes MaxText can run (imports no MaxText).

Only deterministic recipes: MaxText's step does not hand the layers a
per-step key for stochastic rounding or per-step signs, nor the fixed
per-layer key of per-layer signs.
"""

import dataclasses

from fp4jax import recipes

# MXFP's block: Wgrad's blocks run along the tokens, so MaxText's per-device
# tokens and the dummy forward of its DenseGeneral span whole blocks.
BLOCK_SIZE = 32


def _takes(recipe):
  return not (recipe.is_random or recipe.needs_layer_key)


def recipe_for(name, dtype):
  """The preset `name` computing in `dtype` ("bfloat16" or "float32").

  ValueError (one line) for an unknown name or a recipe that needs keys.
  """
  usable = [n for n in recipes.recipe_names() if _takes(recipes.recipe(n))]
  if name not in recipes.recipe_names():
    raise ValueError(f"unknown recipe {name!r}; recipes MaxText can run: {', '.join(usable)}")
  recipe = recipes.recipe(name)
  if not _takes(recipe):
    what = ("stochastic rounding or per-step signs" if recipe.is_random
            else "per-layer Hadamard signs")
    raise ValueError(f"recipe {name!r} uses {what}, whose keys MaxText's step does not "
                     f"pass to the layers; deterministic recipes: {', '.join(usable)}")
  return dataclasses.replace(recipe, compute_dtype=dtype)
