"""Flax adapters for the quantized dot_general.

Linen: `nn.Dense(..., dot_general_cls=DotGeneral.partial(recipe=r))` (or
`functools.partial(DotGeneral, recipe=r)`); the module draws its key from the
rng stream "quant" only when the recipe is random. For deterministic recipes
`nn.Dense(..., dot_general=fp4jax.dot_general(r))` works as well.

NNX: `nnx.Linear(din, dout, dot_general=fp4jax.dot_general(r), rngs=rngs)` for
deterministic recipes; for random ones pass `NNXDotGeneral(r, rngs)`, which
draws a fresh key from the `rngs.quant` stream on every call.

Einsum layers: `jnp.einsum(..., _dot_general=fp4jax.dot_general(r))`, e.g.
`nnx.Einsum(..., einsum_op=einsum_op(r))`. Linen's nn.Einsum (flax 0.12.8)
calls jnp.einsum without a dot_general hook, so it cannot be quantized.
"""

import functools

import flax.linen as nn
from flax import nnx
import jax.numpy as jnp

from fp4jax import dot
from fp4jax.recipes import Recipe


class DotGeneral(nn.Module):
  """Linen drop-in for lax.dot_general (use as `dot_general_cls`).

  capture=True sows `lhs` and `rhs` into "intermediates" and passes the output
  through `self.perturb("out", y)`, so the gradient with respect to the
  "perturbations" collection is the layer's output gradient dY.
  """

  recipe: Recipe
  capture: bool = False

  @classmethod
  def partial(cls, **fields):
    """A `dot_general_cls` factory: DotGeneral.partial(recipe=r)."""
    return functools.partial(cls, **fields)

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, out_sharding=None):
    key = self.make_rng("quant") if self.recipe.is_random else None
    if self.capture:
      self.sow("intermediates", "lhs", lhs)
      self.sow("intermediates", "rhs", rhs)
    y = dot.dot_general(self.recipe)(lhs, rhs, dimension_numbers, precision,
                                     preferred_element_type, out_sharding=out_sharding, key=key)
    return self.perturb("out", y) if self.capture else y


class NNXDotGeneral(nnx.Module):
  """NNX drop-in for lax.dot_general that draws keys from `rngs.quant` (random recipes)."""

  def __init__(self, recipe: Recipe, rngs: nnx.Rngs):
    self.recipe = recipe
    self.rngs = rngs

  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, out_sharding=None):
    key = self.rngs.quant() if self.recipe.is_random else None
    return dot.dot_general(self.recipe)(lhs, rhs, dimension_numbers, precision,
                                        preferred_element_type, out_sharding=out_sharding, key=key)


def einsum_op(recipe: Recipe, key=None):
  """jnp.einsum with the recipe's dot_general (for nnx.Einsum's `einsum_op`)."""
  return functools.partial(jnp.einsum, _dot_general=functools.partial(
      dot.dot_general(recipe), key=key))
