"""QuEST block scales for MXFP4: set from the block's RMS, with clipping.

QuEST (Panferov et al., arXiv 2502.05003) fits the quantization grid to a
Gaussian: after a Hadamard rotation a block is close to Gaussian, so its
MSE-optimal clipping level is a fixed multiple of its RMS. Quartet (Castro,
Panferov et al., arXiv 2505.14669) uses it for the MXFP4 forward pass:

  rms   = sqrt(mean(x^2)) over the block's 32 slots (padding zeros included)
  scale = 2^floor(log2(rms * GAUSSIAN_CLIP / 6))          (an E8M0 power of two)
  q     = nearest E2M1 of x / scale, saturating at +-6:    elements beyond
          6 * scale are clipped

and a trust estimator for the gradient: the gradient of every clipped element
(|x| > 6 * scale) is zeroed (fp4jax.numerics.formats.clip_mask gives the mask;
fp4jax.dot applies it to Dgrad and Wgrad in the rotated layout in which
Fprop quantized the operand).

GAUSSIAN_CLIP = 2.92247856 is the clipping level, in units of the RMS, that
Quartet's public code uses for E2M1. The block exponent is floor(log2 t) of
t = rms * float32(GAUSSIAN_CLIP / 6), computed from t's float32 bits (the
floor scale rule applied to t * 2^emax). Differences from Quartet's kernel:
its scale uses the block's standard deviation (mean removed) and adds 1e-8;
its E2M1 rounding breaks ties downwards where fp4jax rounds to nearest even.
"""

import jax.numpy as jnp

from fp4jax.numerics import scales

GAUSSIAN_CLIP = 2.92247856


def block_exponent(xb, axis, spec):
  """E8M0 exponents (int32, keepdims on `axis`) of QuEST scales of blocks xb.

  xb: float32 blocks with the block elements along `axis`. spec: an E2M1 MX
  QuantSpec (its scale_mode is "floor": the rule is QuEST's own).
  """
  rms = jnp.sqrt(jnp.mean(jnp.square(xb), axis=axis, keepdims=True))
  t = rms * jnp.float32(GAUSSIAN_CLIP / spec.element.max)
  # floor(log2(t * 2^emax)) - emax == floor(log2 t): the floor rule on t * 2^emax.
  return scales.block_exponent(t * jnp.float32(2.0**spec.element.emax), spec)
