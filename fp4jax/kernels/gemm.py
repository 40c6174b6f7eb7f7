"""MXFP4 x MXFP4 GEMM that reads packed operands: C[M, N] = A[M, K] B[N, K]^T.

Both operands come from quantize.quantize_packed along K: uint8 codes [., K/2]
(two E2M1 per byte) and E8M0 scales [., K/32], a quarter of the bytes of bf16
operands. Each program owns one [tile_m, tile_n] block of C and walks K in
slabs of tile_k: it unpacks and scales the two slabs in registers to bf16
(exact: every E2M1 value times a power of two is a bf16) and multiplies them
with float32 accumulation. The result equals dequantize-then-dot up to the
float32 summation order. M and N are zero-padded to whole tiles and the
output cut back (Triton does not mask loads and stores at an array's edge;
fp4jax.kernels.quantize says what that did).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fp4jax.numerics import operand
from fp4jax.numerics import scales as scales_lib
from fp4jax.kernels import target
from fp4jax.numerics.elements import e2m1_values

BLOCK = 32  # MXFP4 elements per E8M0 scale
TILE = (64, 64, 128)  # [tile_m, tile_n, tile_k]


def _dequantize_slab(codes_u8, biased_u8):
  """[r, c/2] packed codes, [r, c/32] biased exponents -> [r, c] bf16."""
  codes = codes_u8.astype(jnp.int32)
  r, half = codes.shape
  # Element 2i is the low nibble: interleave (low, high) along the last axis.
  codes = jnp.stack([codes & 15, codes >> 4], axis=-1).reshape(r, 2 * half)
  values = e2m1_values(codes).reshape(r, 2 * half // BLOCK, BLOCK)
  scale = scales_lib.exp2(biased_u8.astype(jnp.int32) - 127)
  return (values * scale[:, :, None]).reshape(r, 2 * half).astype(jnp.bfloat16)


def _kernel(a_ref, sa_ref, b_ref, sb_ref, c_ref, *, k, tile_k):
  def step(i, acc):
    codes = pl.ds(i * (tile_k // 2), tile_k // 2)
    scales = pl.ds(i * (tile_k // BLOCK), tile_k // BLOCK)
    a = _dequantize_slab(a_ref[:, codes], sa_ref[:, scales])
    b = _dequantize_slab(b_ref[:, codes], sb_ref[:, scales])
    return acc + lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)

  acc = lax.fori_loop(0, k // tile_k, step, jnp.zeros(c_ref.shape, jnp.float32))
  c_ref[...] = acc.astype(c_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "tile"))
def matmul_packed(a_codes, a_scales, b_codes, b_scales, *, out_dtype=jnp.float32,
                  interpret=None, tile=None):
  """C[M, N] = A B^T from packed MXFP4 operands quantized along K.

  a_codes uint8 [M, K/2], a_scales float8_e8m0fnu [M, K/32]; b_codes [N, K/2],
  b_scales [N, K/32]; K a multiple of 32. tile_k defaults to the largest power
  of two <= 128 dividing K.
  tile: optional (tile_m, tile_n, tile_k), powers of two, tile_k >= 32.
  """
  m, half_k = a_codes.shape
  n, k = b_codes.shape[0], 2 * half_k
  if b_codes.shape != (n, half_k) or a_scales.shape != (m, k // BLOCK) or (
      b_scales.shape != (n, k // BLOCK)):
    raise ValueError(f"packed operands do not match: codes {a_codes.shape}, "
                     f"{b_codes.shape}; scales {a_scales.shape}, {b_scales.shape}")
  tm, tn, tk = tile or (TILE[0], TILE[1], min(TILE[2], k & -k))
  if k % tk or tk % BLOCK or tk & (tk - 1):
    raise ValueError(f"K = {k} must be a multiple of tile_k = {tk}, a power of "
                     f"two >= {BLOCK}")
  pm, pn = target.whole_tiles(m, tm), target.whole_tiles(n, tn)
  biased = lambda s: lax.bitcast_convert_type(s, jnp.uint8)
  rows = lambda t, width: pl.BlockSpec((t, width), lambda i, j: (i, 0))
  cols = lambda t, width: pl.BlockSpec((t, width), lambda i, j: (j, 0))
  c = target.pallas_call(
      functools.partial(_kernel, k=k, tile_k=tk),
      out_shape=jax.ShapeDtypeStruct((pm, pn), out_dtype),
      grid=(pm // tm, pn // tn),
      in_specs=[rows(tm, half_k), rows(tm, k // BLOCK),
                cols(tn, half_k), cols(tn, k // BLOCK)],
      out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3),
      name="fp4jax_matmul_packed",
  )(*(operand.pad_axis(a, 0, tile) for a, tile in (
      (a_codes, tm), (biased(a_scales), tm), (b_codes, tn), (biased(b_scales), tn))))
  return target.cut_to(c, (m, n))
