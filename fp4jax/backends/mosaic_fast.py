"""The Hopper backend's fast mode: one promotion per 128 elements of K, not per 32.

Operands are quantized as the `mosaic` backend quantizes them (its `quantize`
and `from_qarray`, the same elements and scales). At the GEMM, an MX operand
(power-of-two 32-block scales 2^e) is folded per 128-element chunk of K
(`fold`): each row's (column's) chunk gets the exponent E = max e - 6 over its
blocks that are not all zero, and each element becomes the E4M3 value
v x 2^(e - E). E4M3 holds 2^s x v exactly for every E2M1 value v and s in
[-8, 6], so a chunk whose blocks span at most 14 binades folds exactly; in one
that spans more, the blocks more than 14 binades below its largest lose values
(rounded to E4M3, often to zero: `fold` counts them). Other MX element
formats (MXFP6, MXFP8) would not fit E4M3 once shifted and run the exact kernel. The kernel
(fp4jax.kernels.hopper_gemm with block=CHUNK) then runs one chain of four
64 x 128 x 32 FP8 wgmmas per chunk into a fresh accumulator and adds it to the
float32 output times 2^(Ea[m] + Eb[n]): one FMUL and one FFMA per output
element per 128 of K instead of per 32. Per-tensor FP8 (the fp8 recipes) runs
the same chains without scales (one FADD per element per chunk). NVFP4 (E4M3
block scales, not powers of two) runs the exact kernel, as `mosaic` runs it.

Not bit-exact: the FP8 tensor core accumulates a chain in reduced precision
(about 14 bits: DeepSeek-V3's measurement on Hopper), so a chunk's sum is
truncated at about 2^-13 of its magnitude at each of its 4 wgmma steps: per
chunk |error| <= 4 x 2^-13 x sum |a_k b_k| (scaled), a model of that
measurement, not a measured bound. The CPU program computes each chunk's sum in
float32 (hopper_gemm.reference: no truncation), so it differs from the GPU's by
at most that bound; tests/test_hopper_gemm.py checks the backend against the
exact one within it, forward and backward.
"""

import jax
import jax.numpy as jnp

from fp4jax.backends import mosaic
from fp4jax.kernels import hopper_gemm
from fp4jax.numerics import operand

CAPABILITY_MAJOR = mosaic.CAPABILITY_MAJOR
QUANTIZES_WHOLE_TENSOR_FIRST = mosaic.QUANTIZES_WHOLE_TENSOR_FIRST
PARTITIONED_BY_XLA = mosaic.PARTITIONED_BY_XLA
SHARD_LOCAL_MATMUL = mosaic.SHARD_LOCAL_MATMUL
unsupported_device = mosaic.unsupported_device
unsupported = mosaic.unsupported
E4M3_SHIFTS = (-8, 6)  # 2^s x E2M1 is an E4M3 value for every s in this range
BLOCKS_PER_CHUNK = hopper_gemm.CHUNK // hopper_gemm.BLOCK
FOLDABLE = "mxfp4"  # E2M1 elements, E8M0 scales (wider elements would not fit E4M3)
_NO_BLOCK = -1024  # the exponent of an all-zero block: never a chunk's largest


class PowerOfTwoScaled(mosaic.Operand):
  """A mosaic.Operand of E2M1 elements with power-of-two block scales: foldable."""
  __slots__ = ()


def quantize(x, spec, rotation, signs, axis, key, compute_dtype, layout=None):
  """mosaic.quantize, marked foldable for MXFP4."""
  return _mark(mosaic.quantize(x, spec, rotation, signs, axis, key, compute_dtype, layout),
               spec)


def from_qarray(q, dtype, compute_dtype):
  """mosaic.from_qarray, marked foldable for MXFP4."""
  return _mark(mosaic.from_qarray(q, dtype, compute_dtype), q.spec)


def _mark(op, spec):
  return PowerOfTwoScaled(*op) if spec.fmt == FOLDABLE and op.scales is not None else op


def matmul(a, b, dims, precision, out_sharding, route=None, plan=None):
  """mosaic.matmul with one promotion per 128 of K where both operands allow it:
  both MX (folded) or both per-tensor FP8; otherwise the exact kernel."""
  del precision, route
  foldable = isinstance(a, PowerOfTwoScaled) and isinstance(b, PowerOfTwoScaled)
  unscaled = a.scales is None and b.scales is None
  return mosaic.run(a, b, dims, out_sharding, plan,
                    gemm if foldable or unscaled else mosaic.gemm)


def gemm(av, bv, asc, bsc):
  """The fast GEMM of [B, rows, K] values and [B, K / 32, rows] power-of-two scales
  (or both None): float32 [B, M, N]."""
  if asc is None:
    pad = lambda v: operand.pad_axis(v, 2, hopper_gemm.CHUNK)
    return mosaic.gemm(pad(av), pad(bv), None, None, block=hopper_gemm.CHUNK)
  (av, asc, _), (bv, bsc, _) = fold(av, asc), fold(bv, bsc)
  return mosaic.gemm(av, bv, asc, bsc, block=hopper_gemm.CHUNK)


def fold(values, scales):
  """values [B, R, K] FP8 (E4M3 / E5M2 elements, K a multiple of 32) and scales
  [B, K / 32, R] float32 powers of two -> (float8_e4m3fn [B, R, K'] with each
  block's scale folded in relative to its chunk's exponent, float32 chunk scales
  [B, K' / 128, R], int32 count of nonzero elements the fold changed); K' is K
  rounded up to whole 128-chunks (zero blocks)."""
  values = operand.pad_axis(values, 2, hopper_gemm.CHUNK)
  b, r, k = values.shape
  blocks = values.astype(jnp.float32).reshape(b, r, k // hopper_gemm.BLOCK, hopper_gemm.BLOCK)
  exponents = jnp.frexp(scales)[1] - 1  # scales are 2^e: frexp gives 0.5 x 2^(e + 1)
  exponents = jnp.swapaxes(operand.pad_axis(exponents, 1, BLOCKS_PER_CHUNK), 1, 2)
  exponents = jnp.where(jnp.any(blocks != 0, axis=-1), exponents, _NO_BLOCK)
  chunk_max = jnp.max(exponents.reshape(b, r, -1, BLOCKS_PER_CHUNK), axis=-1)
  base = jnp.where(chunk_max == _NO_BLOCK, 0, chunk_max - E4M3_SHIFTS[1])
  shifts = exponents - jnp.repeat(base, BLOCKS_PER_CHUNK, axis=-1)
  wanted = jnp.ldexp(blocks, jnp.maximum(shifts, _NO_BLOCK)[..., None])
  folded = wanted.astype(jnp.float8_e4m3fn)
  lost = jnp.sum(folded.astype(jnp.float32) != wanted, dtype=jnp.int32)
  chunk_scales = jnp.swapaxes(jnp.ldexp(jnp.float32(1), base), 1, 2)
  return folded.reshape(b, r, k), chunk_scales, lost

