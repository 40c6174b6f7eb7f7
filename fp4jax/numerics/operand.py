"""One GEMM operand before its GEMM: zero-padded, rotated and fake-quantized along its contraction axis.

`rotation` is anything with a `block` (the Hadamard size: recipes.Hadamard) or
None; `signs` None or a +-1 vector of that size; `axis` the operand's
(flattened) contraction axis.
"""

import jax.numpy as jnp
from jax import lax

from fp4jax.numerics import formats
from fp4jax.numerics import hadamard


def as_stored(x):
  """x exactly as its dtype holds it: arrays narrower than float32 pass through
  an optimization barrier, float32 and wider as they are.

  XLA:CPU computes bfloat16 elementwise work in float32 and, by default
  (xla_allow_excess_precision), drops a bfloat16 rounding that a cast back to
  float32 follows. Without the barrier a quantizer that widens its bfloat16
  input (an MLP's silu(gate) * up, a cotangent) would quantize the unrounded
  float32 values inside a compiled train step, though not in a program that
  receives the operand as an argument (tests/test_stored_operands.py).
  """
  if jnp.finfo(jnp.result_type(x)).bits < 32:
    return lax.optimization_barrier(x)
  return x


def pad_axis(x, axis, multiple):
  """x zero-padded at the end of `axis` to a multiple of `multiple`."""
  pad = -x.shape[axis] % multiple
  if not pad:
    return x
  return jnp.pad(x, [(0, pad if d == axis else 0) for d in range(x.ndim)])


def rotate_padded(x, rotation, signs, axis):
  """x as stored (as_stored), zero-padded along `axis` to a multiple
  of rotation.block and rotated with `signs` (None or a +-1 vector), x's dtype;
  x as stored when rotation is None."""
  x = as_stored(x)
  if rotation is None:
    return x
  return hadamard.rotate(pad_axis(x, axis, rotation.block), rotation.block, axis, signs)


def fake_quantize_operand(x, spec, rotation, signs, axis, key):
  """x rotated and fake-quantized along `axis`, factors included, in x's dtype."""
  x = rotate_padded(x, rotation, signs, axis)
  return x if spec is None else formats.fake_quantize(x, spec, axis, key)
