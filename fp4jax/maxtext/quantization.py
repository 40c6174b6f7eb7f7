"""An fp4jax recipe as a MaxText `Quantization` (maxtext.layers.quantizations).

MaxText's DenseGeneral (NNX) asks `quant.dot_general_cls(mesh_axes)` for a
Linen dot_general module, wraps it in its Linen-to-NNX bridge and runs it
once on `get_block_size()` dummy tokens at construction; every projection of
every decoder layer (attention query, key, value, out; MLP wi_0, wi_1, wo)
then calls fp4jax's DotGeneral with the recipe. MaxText leaves its output
head unquantized, as fp4jax's own model does by default. Recipes: see
fp4jax.maxtext.supported_recipes.
"""

import dataclasses
import functools
from typing import ClassVar

from maxtext.layers import quantizations

from fp4jax.flax import DotGeneral
from fp4jax.maxtext.supported_recipes import BLOCK_SIZE
from fp4jax.recipes import Recipe


@dataclasses.dataclass
class Fp4jaxQuantization(quantizations.Quantization):
  """MaxText quantization whose dot_general is fp4jax's for `recipe` (deterministic)."""

  recipe: Recipe = None
  needs_apply_rngs: ClassVar[bool] = False
  quant_mode = "train"

  def dot_general_cls(self, mesh_axes=()):
    """The Linen module class MaxText instantiates with no arguments.

    mesh_axes (the kernel's logical axes) need nothing here: fp4jax's
    dot_general keeps the shardings that MaxText's logical constraints give
    its operands.
    """
    del mesh_axes
    return functools.partial(DotGeneral, recipe=self.recipe)

  def get_block_size(self):
    return BLOCK_SIZE
