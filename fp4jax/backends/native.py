"""The native backend: each GEMM as one block-scaled GEMM on real low-precision arrays.

Both operands are rotated exactly as in the xla backend, quantized to a QArray
(fp4jax.numerics.formats.quantize: float4_e2m1fn / float8 elements, float8_e8m0fnu or,
for NVFP4, float8_e4m3fn block scales), laid out as [B, rows, K] with scales
[B, rows, K / block], passed together through `lax.optimization_barrier` (so
that no XLA pass folds a `f32 -> e2m1 -> f32` round trip and hides the dtype
the GEMM runs in) and multiplied by one block-scaled op that accumulates in
float32; the float32 per-tensor factors (NVFP4's global scales,
stochastic_dither's 4/3) are applied to the float32 output, as the hardware's
epilogue does. MXFP6 elements travel in float8_e4m3fn, which holds every E2M3
and E3M2 value exactly (a GPU runs them as MXFP8 E4M3 with the same values).
Needs jax >= 0.11 (fp4jax.backends.MIN_JAX). `precision` is not used.

Takes every GEMM whose two operands are MX or NVFP4 with the same block size.
Per-tensor FP8 (a float32 scale, no block scales) and unquantized operands are
run by the xla backend (fp4jax.backends.for_gemm).

Routes (the recipe's `native_route`; `route_for` picks "auto"), by the formats
that XLA's GPU compiler maps to block-scaled hardware:
- "scaled_matmul" (`jax.nn.scaled_matmul`): on CUDA the custom call
  `__op$block_scaled_dot`, which XLA's BlockScalingRewriter hands to cuDNN for
  MXFP8 (E4M3/E5M2 elements, E8M0 scales, block 32) and NVFP4 (E2M1, E4M3
  scales, block 16) and expands into a dequantize and a plain dot for anything
  else (MXFP4 among them); on ROCm jax lowers it to `lax.scaled_dot`.
  "auto" takes it for NVFP4 and for float8 elements on both sides in blocks
  of 32.
- "scaled_dot" (`lax.scaled_dot`): the `xla.scaled_dot` composite, which XLA's
  GPU CompositeRewriter turns into a Triton `dot_scaled` for F4E2M1FN / F8E4M3FN
  / F8E5M2 elements with E8M0 scales of block 16 or 32 (one contracting, one
  batch dimension: the layout above). "auto" takes it for the rest: MXFP4,
  FP4 x FP8 mixes, MX blocks of 16.
The platform needs no rule of its own: on ROCm both routes are the same
composite, and on the CPU both decompose into convert, multiply and a dot.

What is checked, and how: docs/performance.md, "Bit status of `native`".

`unsupported_device()` says why a device has no block-scaled matrix units
(what backend "auto" asks before it picks this backend).
"""

import dataclasses
import math

import jax
from jax import lax
import jax.numpy as jnp

from fp4jax.numerics import formats
from fp4jax.numerics import operand
from fp4jax.backends import apply_factors, cuda_capability

MIN_CAPABILITY = (10, 0)
# fp4jax.backends: every operand is quantized in the GEMM's layout (real arrays).
QUANTIZES_WHOLE_TENSOR_FIRST = False
# fp4jax.backends: jnp quantization and a GEMM XLA partitions (lax.scaled_dot is an HLO
# op; jax.nn.scaled_matmul's cuDNN call carries jax's own custom_partitioning rule).
PARTITIONED_BY_XLA = True


def route_for(lhs, rhs, route="auto"):
  """The op ("scaled_matmul" or "scaled_dot") for a GEMM of QuantSpecs lhs and rhs:
  `route` when forced, else the one XLA's GPU compiler maps to block-scaled units
  for these formats (module docstring)."""
  if route != "auto":
    return route
  fp8_elements = all(jnp.dtype(s.element_dtype) != jnp.float4_e2m1fn for s in (lhs, rhs))
  cudnn = "nvfp4" in (lhs.family, rhs.family) or (fp8_elements and lhs.block == 32)
  return "scaled_matmul" if cudnn else "scaled_dot"


def unsupported_device(device=None):
  """Why `device` (default: the first device) has no block-scaled FP4 matrix units
  that jax.nn.scaled_matmul reaches (NVIDIA compute capability >= 10), or None."""
  device = jax.devices()[0] if device is None else device
  capability = cuda_capability(device)
  if isinstance(capability, str):
    return capability
  if capability < MIN_CAPABILITY:
    return (f"{device.device_kind} has compute capability {device.compute_capability} < "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: no block-scaled FP4 units")
  return None


def unsupported(gemm):
  """Why this backend cannot run `gemm` (a recipes.Gemm), or None."""
  for side in ("lhs", "rhs"):
    spec = getattr(gemm, side)
    if spec is None:
      return f"its {side} is not quantized"
    if spec.family == "fp8":
      return f"its {side} is per-tensor {spec.fmt} (a float32 scale, no block scales)"
    if not spec.is_plain_blocks:
      return (f"its {side} has block_2d={spec.block_2d}, block_scale={spec.block_scale!r} "
              "(native takes 1D amax-scaled blocks)")
  if gemm.lhs.block != gemm.rhs.block:
    return f"its operands have different block sizes ({gemm.lhs.block}, {gemm.rhs.block})"
  return None


def quantize(x, spec, rotation, signs, axis, key, compute_dtype):
  """See fp4jax.backends; returns a QArray blocked along `axis`, whose length is
  zero-padded to a multiple of spec.block (the quantized values do not change)."""
  del compute_dtype  # the block-scaled GEMM reads the elements as they are
  x = operand.pad_axis(operand.rotate_padded(x, rotation, signs, axis), axis, spec.block)
  return formats.quantize(x, spec, axis, key)


def from_qarray(q, dtype, compute_dtype):
  """See fp4jax.backends; q with its values in the element dtype, zero-padded
  along q.axis to a multiple of the block as `quantize` pads them."""
  del dtype, compute_dtype
  values = operand.pad_axis(q.values.astype(q.spec.element_dtype), q.axis, q.spec.block)
  return dataclasses.replace(q, values=values)


def matmul(a, b, dims, precision, out_sharding, route="auto"):
  """lax.dot_general(a, b, dims)'s float32 result as one block-scaled op, the one
  `route_for(a.spec, b.spec, route)` names."""
  del precision
  (ca, cb), (ba, bb) = dims
  lhs, lhs_scales, lhs_shape = _batch_rows_blocks(a, ca, ba)
  rhs, rhs_scales, rhs_shape = _batch_rows_blocks(b, cb, bb)
  lhs, rhs, lhs_scales, rhs_scales = lax.optimization_barrier((lhs, rhs, lhs_scales, rhs_scales))
  if route_for(a.spec, b.spec, route) == "scaled_matmul":
    y = jax.nn.scaled_matmul(lhs, rhs, lhs_scales, rhs_scales,
                             preferred_element_type=jnp.float32)
  else:  # [B, M, K] x [B, N, K] -> [B, M, N], as scaled_matmul
    y = lax.scaled_dot(lhs, rhs, lhs_scale=lhs_scales, rhs_scale=rhs_scales,
                       dimension_numbers=(((2,), (2,)), ((0,), (0,))),
                       preferred_element_type=jnp.float32)
  y = y.reshape(lhs_shape + rhs_shape[len(bb):])  # dot_general's layout
  if out_sharding is not None:
    y = jax.sharding.reshard(y, out_sharding)
  return apply_factors(y, a.global_scale, b.global_scale)


def _batch_rows_blocks(q, contract, batch):
  """A QArray's values and scales as [B, rows, K] and [B, rows, K / block], with
  the batch dims first, then the free dims (the order dot_general keeps), then
  the contraction axis (`contract` must be (q.axis,)); also the [batch..., free...]
  shape."""
  if tuple(contract) != (q.axis,):
    raise ValueError(f"operand blocked along {q.axis} cannot contract {contract}")
  free = [d for d in range(q.values.ndim) if d != q.axis and d not in batch]
  perm = list(batch) + free + [q.axis]
  values, scales = q.values, q.scales
  if perm != list(range(values.ndim)):
    values, scales = jnp.transpose(values, perm), jnp.transpose(scales, perm)
  shape = values.shape[:-1]
  n_batch = math.prod(shape[:len(batch)])
  rows = math.prod(shape[len(batch):])
  return (values.reshape(n_batch, rows, values.shape[-1]),
          scales.reshape(n_batch, rows, scales.shape[-1]), shape)
