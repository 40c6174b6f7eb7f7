"""Flax adapters for the quantized dot_general.

Linen: `nn.Dense(..., dot_general_cls=DotGeneral.partial(recipe=r))` (or
`functools.partial(DotGeneral, recipe=r)`); the module draws its key from the
rng stream "quant" only when the recipe is random, and its layer key from the
stream "hadamard" only when the recipe has per-layer Hadamard signs. Pass the
"hadamard" stream the same key on every step (one derived from the run's seed):
make_rng folds in the module's path, so each layer gets its own signs, fixed
for the run (under nn.scan, add "hadamard" to split_rngs). For deterministic
recipes `nn.Dense(..., dot_general=fp4jax.dot_general(r))` works as well.
`switch_wgrad_to` and `wgrad_switched` (a boolean scalar, may be traced) are
passed to dot_general (fp4jax.train.adaptive: a layer's Wgrad switched at run time).

NNX: `nnx.Linear(din, dout, dot_general=fp4jax.dot_general(r), rngs=rngs)` for
deterministic recipes; for random ones pass `NNXDotGeneral(r, rngs)`, which
draws a fresh key from the `rngs.quant` stream on every call and, for per-layer
signs, its layer key from `rngs.hadamard` once, at construction.

Einsum layers: `jnp.einsum(..., _dot_general=fp4jax.dot_general(r))`, e.g.
`nnx.Einsum(..., einsum_op=einsum_op(r))`. Linen's nn.Einsum (flax 0.12.8)
calls jnp.einsum without a dot_general hook, so it cannot be quantized.
"""

import functools
from typing import Any

import flax.linen as nn
from flax import nnx
import jax.numpy as jnp

from fp4jax import dot
from fp4jax.recipes import Gemm, Recipe


class DotGeneral(nn.Module):
  """Linen drop-in for lax.dot_general (use as `dot_general_cls`).

  capture=True sows `lhs` and `rhs` into "intermediates" and passes the output
  through `self.perturb("out", y)`, so the gradient with respect to the
  "perturbations" collection is the layer's output gradient dY. With per-layer
  signs it also sows "layer_key" (the PRNG key this layer passes as
  dot_general's `layer_key`).

  lhs_axes, rhs_axes: the operands' logical axis names (e.g. ("activation_batch",
  "activation_length", "activation_embed") and ("embed", "mlp")); under a mesh
  and Flax logical axis rules (fp4jax.sharding.use_mesh) they become
  dot_general's `specs`, so a kernel backend quantizes and multiplies each
  device's shard (fp4jax.shard_local).
  """

  recipe: Recipe
  capture: bool = False
  switch_wgrad_to: Gemm | None = None
  wgrad_switched: Any = None
  lhs_axes: tuple | None = None
  rhs_axes: tuple | None = None

  @classmethod
  def partial(cls, **fields):
    """A `dot_general_cls` factory: DotGeneral.partial(recipe=r)."""
    return functools.partial(cls, **fields)

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, out_sharding=None):
    key = self.make_rng("quant") if self.recipe.is_random else None
    layer_key = None
    if self.recipe.needs_layer_key:
      if not self.has_rng("hadamard"):
        raise ValueError(f"recipe {self.recipe.name!r} uses per-layer Hadamard signs: pass "
                         "rngs={'hadamard': run_key} (the same key every step) to init/apply")
      layer_key = self.make_rng("hadamard")
    if self.capture:
      self.sow("intermediates", "lhs", lhs)
      self.sow("intermediates", "rhs", rhs)
      if layer_key is not None:
        self.sow("intermediates", "layer_key", layer_key)
    specs = None
    if self.lhs_axes is not None and self.rhs_axes is not None:
      specs = (nn.logical_to_mesh_axes(self.lhs_axes), nn.logical_to_mesh_axes(self.rhs_axes))
    y = dot.dot_general(self.recipe, self.switch_wgrad_to)(
        lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding=out_sharding,
        key=key, layer_key=layer_key, wgrad_switched=self.wgrad_switched, specs=specs)
    return self.perturb("out", y) if self.capture else y


class NNXDotGeneral(nnx.Module):
  """NNX drop-in for lax.dot_general that draws keys from `rngs.quant` (random recipes)."""

  def __init__(self, recipe: Recipe, rngs: nnx.Rngs):
    self.recipe = recipe
    self.rngs = rngs
    self.layer_key = nnx.Variable(rngs.hadamard()) if recipe.needs_layer_key else None

  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, out_sharding=None):
    key = self.rngs.quant() if self.recipe.is_random else None
    layer_key = None if self.layer_key is None else self.layer_key[...]
    return dot.dot_general(self.recipe)(lhs, rhs, dimension_numbers, precision,
                                        preferred_element_type, out_sharding=out_sharding, key=key,
                                        layer_key=layer_key)


def einsum_op(recipe: Recipe, key=None, layer_key=None):
  """jnp.einsum with the recipe's dot_general (for nnx.Einsum's `einsum_op`)."""
  return functools.partial(jnp.einsum, _dot_general=functools.partial(
      dot.dot_general(recipe), key=key, layer_key=layer_key))
