"""E8M0 shared exponents of MX blocks, from the float32 bits of the block amax.

With amax = (1 + f) * 2^e (f the 23-bit fraction, FP32 subnormals normalised
first) and the element's largest binade emax and largest value
max = (1 + f_max) * 2^emax, the four rules (sources: docs/numerics.md, "Scale rules") are, exactly:

  floor  2^(floor(log2 amax) - emax)         = e - emax
  ceil   2^(ceil(log2 amax) - emax)          = e + (f > 0) - emax
  even   amax rounded to mbits, then floor   = e + (f >= 1-2^-(mbits+1)) - emax
  rceil  2^ceil(log2(amax / max))            = e + (f > f_max) - emax

("even": the rounding only changes the binade when the top mbits + 1 fraction
bits are all ones; ties there go up under both half-even and half-up.
"rceil": equal to rounding the f32 quotient amax / max up to a power of two, as
cuBLAS and JAX do, because for every element max here the quotient never
rounds onto a power of two from either side.)

Results saturate to the E8M0 range [-127, 127]; a NaN or Inf amax gives 128,
the exponent of the E8M0 NaN code 0xFF. Zero and FP32-subnormal amax give -127.
"""

import jax.numpy as jnp
from jax import lax

E8M0_NAN = 128  # unbiased exponent whose biased code is 0xFF


def block_exponent(amax, spec):
  """Unbiased shared exponent (int32, in [-127, 127] or E8M0_NAN) of each block.

  amax: float32 array of block maxima (>= 0 or NaN). spec: an MX QuantSpec.
  """
  if spec.family != "mx":
    raise ValueError(f"block_exponent is for MX formats (E8M0 scales); got "
                     f"fmt={spec.fmt!r}")
  elem = spec.element
  bits = lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.int32)
  bits = bits & 0x7FFFFFFF
  biased = bits >> 23
  frac = bits & 0x7FFFFF
  # FP32 subnormals: shift the leading one into the implicit-bit position.
  shift = lax.clz(frac) - 8
  is_sub = biased == 0
  e = jnp.where(is_sub, -126 - shift, biased - 127)
  frac = jnp.where(is_sub, (frac << jnp.maximum(shift, 0)) & 0x7FFFFF, frac)
  mode = spec.scale_mode
  if mode == "floor":
    up = jnp.zeros_like(e)
  elif mode == "ceil":
    up = (frac > 0).astype(jnp.int32)
  elif mode == "even":
    up = (frac >= (1 << 23) - (1 << (22 - elem.mbits))).astype(jnp.int32)
  else:  # rceil
    frac_max = int(round((elem.max / 2.0**elem.emax - 1) * 2**23))
    up = (frac > frac_max).astype(jnp.int32)
  e = jnp.clip(e + up - elem.emax, -127, 127)
  return jnp.where(biased == 255, E8M0_NAN, e)


def exp2(e):
  """2^e as float32 for int32 e in [-127, 127]; NaN for E8M0_NAN.

  2^-127 is an FP32 subnormal, built from its bits (0x00400000).
  """
  biased = e + 127
  bits = jnp.where(biased <= 0, 0x00400000, biased << 23)
  bits = jnp.where(e == E8M0_NAN, 0x7FC00000, bits)
  return lax.bitcast_convert_type(bits, jnp.float32)


def to_e8m0(e):
  """E8M0 codes (float8_e8m0fnu) of exponents from block_exponent."""
  return lax.bitcast_convert_type((e + 127).astype(jnp.uint8),
                                  jnp.float8_e8m0fnu)


def from_e8m0(s):
  """Unbiased int32 exponents (E8M0_NAN for 0xFF) of E8M0 scales."""
  return lax.bitcast_convert_type(s, jnp.uint8).astype(jnp.int32) - 127
