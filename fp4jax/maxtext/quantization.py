"""An fp4jax recipe as a MaxText `Quantization` (maxtext.layers.quantizations).

MaxText's DenseGeneral (NNX) asks `quant.dot_general_cls(mesh_axes)` for a
Linen dot_general module, wraps it in its Linen-to-NNX bridge and runs it
once on `get_block_size()` dummy tokens at construction; every projection of
every decoder layer (attention query, key, value, out; MLP wi_0, wi_1, wo)
then calls fp4jax's DotGeneral with the recipe. MaxText leaves its output
head unquantized, as fp4jax's own model does by default. Recipes: see
fp4jax.maxtext.supported_recipes.

Sharding: DotGeneral gets the operands' logical names, the kernel's
(`mesh_axes`) and the input's (`input_axes`: the names MaxText's layers
constrain that input to), so under MaxText's mesh (`jax.set_mesh`) and
logical rules a kernel backend (pallas, mosaic) quantizes and multiplies each
device's shard (fp4jax.shard_local) instead of the global batch.
"""

import dataclasses
import functools
from typing import ClassVar

import flax.linen as nn
import jax
from maxtext.layers import quantizations

from fp4jax.flax import DotGeneral
from fp4jax.maxtext.supported_recipes import BLOCK_SIZE
from fp4jax.recipes import Recipe

# The logical names MaxText (0.2.5) constrains a training projection's input
# to, by the kernel's contracted axes: attention's query, key and value; its
# out projection; the MLP's wi_0 and wi_1 (the decoder layer's layout); wo.
INPUT_AXES = {
    ("embed_attn",): ("activation_batch_attn", "activation_input_length_attn",
                      "activation_embed_attn"),
    ("heads", "kv"): ("activation_batch_attn", "activation_length_attn", "activation_heads",
                      "activation_kv"),
    ("embed",): ("activation_batch", "activation_norm_length", "activation_embed"),
    ("mlp",): ("activation_batch", "activation_length", "activation_mlp"),
}


def input_axes(lhs_ndim, dimension_numbers, kernel_axes):
  """The logical names of a DenseGeneral input of rank `lhs_ndim` contracted
  with a kernel named `kernel_axes` along `dimension_numbers`.

  [batch, length, features...] inputs of a projection above get MaxText's
  names; others of that form get ("activation_batch", "activation_length")
  and whole features; any other input (the dummy tokens MaxText runs at
  construction) is left whole (Nones).
  """
  (lhs_contract, rhs_contract), _ = dimension_numbers
  contracted = tuple(kernel_axes[d] if d < len(kernel_axes) else None for d in rhs_contract)
  tokens_first = tuple(lhs_contract) == tuple(range(2, lhs_ndim))
  if not tokens_first:
    return (None,) * lhs_ndim
  names = INPUT_AXES.get(contracted, ())
  if len(names) != lhs_ndim:
    names = ("activation_batch", "activation_length") + (None,) * (lhs_ndim - 2)
  return names


def split_names(names):
  """`names` with None for each logical name whose mesh axes (under the current
  rules and jax.set_mesh mesh) all have one device. MaxText maps a name to
  several mesh axes, most of size 1; fp4jax.shard_local counts any named mesh
  axis as a split, and a token axis split in two dims makes Wgrad gather it."""
  mesh_shape = jax.sharding.get_abstract_mesh().shape

  def splits(name):
    axes = nn.logical_to_mesh_axes((name,))[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return any(mesh_shape.get(axis, 1) > 1 for axis in axes)

  return tuple(name if name is not None and splits(name) else None for name in names)


class MaxTextDotGeneral(nn.Module):
  """fp4jax's DotGeneral for `recipe` with the operands' logical names: the
  kernel's `kernel_axes` and the input's `input_axes` (decided per call)."""

  recipe: Recipe
  kernel_axes: tuple = ()

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, out_sharding=None):
    lhs_axes = input_axes(lhs.ndim, dimension_numbers, self.kernel_axes)
    dot = DotGeneral(self.recipe, lhs_axes=split_names(lhs_axes),
                     rhs_axes=split_names(self.kernel_axes), name="dot")
    return dot(lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding)


@dataclasses.dataclass
class Fp4jaxQuantization(quantizations.Quantization):
  """MaxText quantization whose dot_general is fp4jax's for `recipe` (deterministic)."""

  recipe: Recipe = None
  needs_apply_rngs: ClassVar[bool] = False
  quant_mode = "train"

  def dot_general_cls(self, mesh_axes=()):
    """The Linen module class MaxText instantiates with no arguments;
    mesh_axes: the kernel's logical axes."""
    return functools.partial(MaxTextDotGeneral, recipe=self.recipe,
                             kernel_axes=tuple(mesh_axes))

  def get_block_size(self):
    return BLOCK_SIZE
