"""One GEMM operand before its GEMM: zero-padded, rotated and fake-quantized along its contraction axis.

`rotation` is anything with a `block` (the Hadamard size: recipes.Hadamard) or
None; `signs` None or a +-1 vector of that size; `axis` the operand's
(flattened) contraction axis.
"""

import jax.numpy as jnp

from fp4jax.numerics import formats
from fp4jax.numerics import hadamard


def pad_axis(x, axis, multiple):
  """x zero-padded at the end of `axis` to a multiple of `multiple`."""
  pad = -x.shape[axis] % multiple
  if not pad:
    return x
  return jnp.pad(x, [(0, pad if d == axis else 0) for d in range(x.ndim)])


def rotate_padded(x, rotation, signs, axis):
  """x zero-padded along `axis` to a multiple of rotation.block and rotated with
  `signs` (None or a +-1 vector), x's dtype; x itself when rotation is None."""
  if rotation is None:
    return x
  return hadamard.rotate(pad_axis(x, axis, rotation.block), rotation.block, axis, signs)


def fake_quantize_operand(x, spec, rotation, signs, axis, key):
  """x rotated and fake-quantized along `axis`, factors included, in x's dtype."""
  x = rotate_padded(x, rotation, signs, axis)
  return x if spec is None else formats.fake_quantize(x, spec, axis, key)
