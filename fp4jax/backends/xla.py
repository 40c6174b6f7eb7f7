"""The reference backend: jnp fake quantization, then one GEMM in the compute dtype.

An operand, as stored, is rotated (float32 accumulation, result in its dtype)
and fake-quantized in float32 (fp4jax.numerics.operand,
fp4jax.numerics.formats), split into its block-dequantized values and its
float32 per-tensor factor (NVFP4's global scale, stochastic_dither's 4/3; None
for plain MX), and the values are cast to the recipe's compute dtype. MX and
NVFP4 values (elements times E8M0 / E4M3 block scales) are exact in bf16; the
factors are applied to the float32 GEMM output, as hardware applies them in its
epilogue. Per-tensor FP8 values carry their float32 scale (there are no block
scales) and stay in the input's dtype, as fake_quantize returns them (rounded to
it: bf16 for a bf16 model, exact in float32 for a float32 one); the GEMM runs in
the wider of its operands' dtypes, so bf16 FP8 operands take the bf16 GEMM,
whose float32 accumulation may order its sums differently from a float32 GEMM's
(the operand values are the same).
"""

import dataclasses
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from fp4jax.numerics import formats
from fp4jax.numerics.operand import rotate_padded
from fp4jax.backends import apply_factors, fence_dot_output

# fp4jax.backends: FP8 per-tensor operands are quantized before their layout changes.
QUANTIZES_WHOLE_TENSOR_FIRST = True
# fp4jax.backends: jnp only, which XLA's SPMD partitioner splits.
PARTITIONED_BY_XLA = True


class Operand(NamedTuple):
  """values: the rotated, block-dequantized operand (compute dtype, or float32);
  factor: float32 scalar for the GEMM's output, or None."""
  values: jax.Array
  factor: jax.Array | None


def unsupported(gemm):
  """The xla backend runs every GEMM: None."""
  del gemm


def quantize(x, spec, rotation, signs, axis, key, compute_dtype):
  """See fp4jax.backends; returns an Operand."""
  x = rotate_padded(x, rotation, signs, axis)
  if spec is None:
    return Operand(x.astype(compute_dtype), None)
  if spec.family == "fp8":
    return Operand(formats.fake_quantize(x, spec, axis, key), None)
  values, factor = formats.fake_quantize_unscaled(x, spec, axis, key)
  return Operand(values.astype(compute_dtype), factor)


def from_qarray(q, dtype, compute_dtype):
  """See fp4jax.backends; returns the Operand `quantize` gives, bit for bit."""
  if q.spec.family == "fp8":
    return Operand(q.dequantize(dtype), None)
  values = dataclasses.replace(q, global_scale=None).dequantize(jnp.float32)
  return Operand(values.astype(compute_dtype), q.global_scale)


def matmul(a, b, dims, precision, out_sharding, route=None):
  """The GEMM in the wider of the operands' dtypes, float32 accumulation, then
  the operands' factors (`route` is the native backend's)."""
  del route
  dtype = jnp.promote_types(a.values.dtype, b.values.dtype)
  y = lax.dot_general(a.values.astype(dtype), b.values.astype(dtype), dims, precision,
                      jnp.float32, out_sharding=out_sharding)
  return apply_factors(fence_dot_output(y, dtype), a.factor, b.factor)
