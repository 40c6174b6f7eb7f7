"""A linear layer's Fprop operands as fp4jax.dot prepares them, outside a forward.

What an export stores must be what a forward's Fprop GEMM multiplied: its
weight operand (the kernel in the compute dtype, rotated along the
contraction axis when the role rotates, quantized with the role's rhs
QuantSpec in 1D blocks or NVIDIA's square tiles, as the xla backend does),
and what it calibrates, its input as rotated. The model and trainer reach
those numerics through here (the layout rule of tests/test_layout.py).
"""

import functools

import jax

from fp4jax.numerics import blocks2d
from fp4jax.numerics import formats
from fp4jax.numerics import operand

NVFP4_GLOBAL_DIVISOR = formats.NVFP4_GLOBAL_DIVISOR  # NVFP4's per-tensor scale = amax / this


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def weight(x, compute_dtype, spec, rotation):
  """(values, scales, global scale) of a kernel x [K, ...] quantized along axis 0
  (K, the contraction) as Fprop quantizes its rhs; rotation: recipes.Hadamard or None."""
  x = operand.rotate_padded(x.astype(compute_dtype), rotation, None, 0)
  if spec.block_2d:
    q = blocks2d.quantize_tiles(x.reshape(x.shape[0], -1), spec)
  else:
    q = formats.quantize(x, spec, axis=0)
  return q.values, q.scales, q.global_scale


def rotated_input(x, rotation, axis):
  """An input x as Fprop rotates it along its contraction `axis` (no quantization)."""
  return operand.rotate_padded(x, rotation, None, axis)
