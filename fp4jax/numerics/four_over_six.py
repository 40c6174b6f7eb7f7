"""Four over Six: NVFP4 blocks scaled to a maximum of 6 or of 4, whichever errs less.

Cook et al., "Four Over Six: More Accurate NVFP4 Quantization with Adaptive
Block Scaling" (arXiv 2512.02010): E2M1 has no value between 4 and 6, so a
block whose large values land there rounds them coarsely; scaling the block
so that its maximum maps to 4 instead (a 1.5x larger E4M3 block scale) puts
them on the finer 0..4 part of the grid. Each 16-element block is quantized
both ways and keeps the candidate with the smaller squared error
sum((dequantized - x)^2); a tie keeps 6. To leave room for the larger
scales, the per-tensor scale is amax / (6 * 256) instead of amax / (6 * 448),
so block scales stay <= 256 * 1.5 = 384 <= 448 (the E4M3 maximum).

fp4jax.numerics.formats computes the two candidates (same random bits for both under
stochastic rounding); this module holds the constants and the choice.
"""

import jax.numpy as jnp

GLOBAL_DIVISOR = 6.0 * 256.0  # E2M1 max * the E4M3 scale budget of the 6-candidate
SMALL_PEAK = 4.0  # the other candidate maps the block maximum to 4


def select(xb, six, four, global_scale, axis):
  """(q, s) of the candidate with the smaller squared error per block.

  xb: float32 blocks (elements along `axis`); six, four: (q, s) pairs, q the
  rounded elements like xb, s the float32 E4M3 block scales (keepdims);
  global_scale: the float32 per-tensor scale.
  """
  def error(q, s):
    return jnp.sum(jnp.square((q * s) * global_scale - xb), axis=axis, keepdims=True)
  use_four = error(*four) < error(*six)
  return jnp.where(use_four, four[0], six[0]), jnp.where(use_four, four[1], six[1])
