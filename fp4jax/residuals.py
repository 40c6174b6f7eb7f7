"""Quantized residuals: an operand kept quantized and packed between forward and backward.

With `Recipe.residuals == "quantized"` the dot_general's forward saves the
Wgrad lhs (the activations X, flattened, padded and rotated exactly as the
Wgrad GEMM prepares them) quantized, instead of X itself. `save` quantizes
and packs it; `restore` gives back the QArray that `formats.quantize` of the
same input, spec, axis and key returns (FP4 elements as float32 values on the
E2M1 grid), from which each backend builds its GEMM operand
(`backend.from_qarray`), bit for bit the operand its `quantize` would give.

Storage: FP4 elements (mxfp4, nvfp4) packed two per byte along the quantized
axis (codes j and j + 16 of each 32, see _pack_codes; the axis zero-padded to
a multiple of 32), other formats in their element dtype (one byte); scales in
the format's scale dtype (E8M0 for MX: one byte per block). MXFP4 with
32-blocks: 0.5 + 1/32 bytes per element, 0.27x of bf16.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from fp4jax.numerics import formats
from fp4jax.numerics.elements import e2m1_codes, e2m1_values


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["values", "scales", "global_scale"],
                   meta_fields=["spec", "axis", "length", "dtype"])
@dataclasses.dataclass(frozen=True)
class Saved:
  """A quantized operand as stored between forward and backward.

  values: uint8 [..., 16 * ceil(length / 32), ...] packed E2M1 codes (FP4
  formats), or the element dtype in the operand's shape. scales, global_scale:
  as formats.QArray. axis: the quantized axis; length: its length; dtype: the
  dtype of the operand that was quantized.
  """
  values: jax.Array
  scales: jax.Array
  global_scale: jax.Array | None
  spec: formats.QuantSpec
  axis: int
  length: int
  dtype: jnp.dtype


def _is_fp4(spec) -> bool:
  return spec.element_dtype == jnp.float4_e2m1fn


def save(x, spec: formats.QuantSpec, axis: int, key=None) -> Saved:
  """x quantized along `axis` with `spec` (key: for random roundings), packed."""
  fp4 = _is_fp4(spec)
  q = formats.quantize(x, spec, axis, key, values_dtype=jnp.float32 if fp4 else None)
  values = _pack_codes(q.values, q.axis) if fp4 else q.values
  return Saved(values, q.scales, q.global_scale, spec, q.axis, x.shape[q.axis],
               jnp.dtype(x.dtype))


def restore(saved: Saved) -> formats.QArray:
  """The QArray `save` packed (FP4 values as float32 on the E2M1 grid)."""
  values = saved.values
  if _is_fp4(saved.spec):
    values = _unpack_codes(values, saved.axis, saved.length)
  return formats.QArray(values, saved.scales, saved.global_scale, saved.spec, saved.axis)


# XLA:CPU converts float32 <-> float4_e2m1fn slowly, so FP4 elements travel as
# their 4-bit codes by bit arithmetic (fp4jax.numerics.elements.e2m1_codes /
# e2m1_values, equal to those conversions bit for bit).

_HALF = 16  # codes j and j + 16 of every 32 along the axis share a byte


def _pack_codes(values, axis):
  """float32 E2M1 values [..., n, ...] -> uint8 [..., 16 * ceil(n / 32), ...].

  Element j + 32 b of the axis goes to the low nibble of byte j + 16 b (j <
  16), element j + 16 + 32 b to its high nibble: contiguous runs of 16, which
  XLA:CPU packs much faster than alternate elements (formats.pack_fp4), and
  which stay inside a shard whenever MX blocks do (n a multiple of 32 per shard).
  """
  codes = e2m1_codes(values)
  pad = -codes.shape[axis] % (2 * _HALF)
  if pad:
    codes = jnp.pad(codes, [(0, pad if d == axis else 0) for d in range(codes.ndim)])
  pairs = codes.reshape(codes.shape[:axis] + (-1, 2, _HALF) + codes.shape[axis + 1:])
  lo = jax.lax.index_in_dim(pairs, 0, axis + 1, keepdims=False)
  hi = jax.lax.index_in_dim(pairs, 1, axis + 1, keepdims=False)
  return (lo | (hi << 4)).reshape(codes.shape[:axis] + (-1,) + codes.shape[axis + 1:])


def _unpack_codes(packed, axis, length):
  """Inverse of _pack_codes: uint8 -> float32 E2M1 values with `length` along the axis."""
  groups = packed.reshape(packed.shape[:axis] + (-1, 1, _HALF) + packed.shape[axis + 1:])
  codes = jnp.concatenate([groups & 0xF, groups >> 4], axis=axis + 1).astype(jnp.int32)
  codes = codes.reshape(packed.shape[:axis] + (-1,) + packed.shape[axis + 1:])
  if codes.shape[axis] != length:
    codes = jax.lax.slice_in_dim(codes, 0, length, axis=axis)
  return e2m1_values(codes)
