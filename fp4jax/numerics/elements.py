"""Element formats (E2M1, E2M3, E3M2, E4M3, E5M2) and rounding onto their grids.

Rounding works on float32 values with integer operations on the bit pattern:
the grid spacing of the element format at a value v is
ulp(v) = 2^(max(floor(log2 |v|), emin) - mbits), a power of two built from
v's exponent field, so v * (1 / ulp) and the multiply back are exact.
"""

import dataclasses

import jax.numpy as jnp
from jax import lax
import numpy as np


@dataclasses.dataclass(frozen=True)
class ElementFormat:
  """A small float format without infinities (all OCP MX element types)."""
  name: str
  ebits: int
  mbits: int
  bias: int
  max: float  # largest finite magnitude
  dtype: type  # JAX storage dtype (a container when JAX lacks the type)

  @property
  def emax(self) -> int:
    """Exponent of the largest binade: floor(log2(max))."""
    return int(np.floor(np.log2(self.max)))

  @property
  def emin(self) -> int:
    """Exponent of the smallest normal binade (1 - bias)."""
    return 1 - self.bias


# XLA in jax 0.10 cannot convert to float6 types, so MXFP6 values are stored in
# float8_e4m3fn, which holds every E2M3 and E3M2 value exactly.
ELEMENTS = {
    "e2m1": ElementFormat("e2m1", 2, 1, 1, 6.0, jnp.float4_e2m1fn),
    "e2m3": ElementFormat("e2m3", 2, 3, 1, 7.5, jnp.float8_e4m3fn),
    "e3m2": ElementFormat("e3m2", 3, 2, 3, 28.0, jnp.float8_e4m3fn),
    "e4m3": ElementFormat("e4m3", 4, 3, 7, 448.0, jnp.float8_e4m3fn),
    "e5m2": ElementFormat("e5m2", 5, 2, 15, 57344.0, jnp.float8_e5m2),
}


def _pow2(biased_exp):
  """2^(biased_exp - 127) as float32, for int32 biased exponents in [1, 254]."""
  return lax.bitcast_convert_type(biased_exp << 23, jnp.float32)


def round_half_even(t):
  """Rounds float32 `t` to the nearest integer, ties to even, keeping -0 (one
  round-to-nearest-even instruction where the CPU has one)."""
  return lax.round(t, lax.RoundingMethod.TO_NEAREST_EVEN)


def round_half_even_by_floor(t):
  """round_half_even written with floor and compares, for Pallas' Triton
  lowering, which has no `round`; bit-identical to round_half_even."""
  fl = jnp.floor(t)
  frac = t - fl
  odd = fl - 2.0 * jnp.floor(fl * 0.5)
  up = (frac > 0.5) | ((frac == 0.5) & (odd == 1.0))
  r = fl + up.astype(t.dtype)
  sign = lax.bitcast_convert_type(t, jnp.int32) & jnp.int32(-2**31)
  return lax.bitcast_convert_type(
      lax.bitcast_convert_type(r, jnp.int32) | sign, jnp.float32)


SR_BITS = 24  # random bits per element of the default stochastic rounding


def round_element(v, elem: ElementFormat, random_bits=None, nearest=round_half_even,
                  sr_bits=SR_BITS, sr_round_up_scale=1.0):
  """Rounds float32 `v` onto `elem`'s grid, saturating at +-elem.max.

  random_bits None: round to nearest, ties to even, with `nearest` (float32 ->
  nearest integer, ties to even: round_half_even, or round_half_even_by_floor
  inside a Triton kernel). Otherwise a uint32 array of v's shape: stochastic
  rounding (stochastic_round). NaN stays NaN; +-Inf saturates.
  """
  m = elem.mbits
  exp_v = (lax.bitcast_convert_type(v, jnp.int32) >> 23) & 0xFF
  exp_v = jnp.clip(exp_v, elem.emin + 127, 254)
  inv_ulp = _pow2(254 + m - exp_v)
  ulp = _pow2(exp_v - m)
  t = v * inv_ulp
  if random_bits is None:
    r = nearest(t)
  else:
    r = stochastic_round(t, random_bits, sr_bits, sr_round_up_scale)
  return jnp.clip(r * ulp, -elem.max, elem.max)


def stochastic_round(t, random_bits, sr_bits=SR_BITS, sr_round_up_scale=1.0):
  """float32 `t` (in ulps of the grid) to an integer neighbour, from uint32
  `random_bits` of t's shape, of which the top `sr_bits` (1..24) are used,
  as k = bits >> (32 - sr_bits), u = k / 2^sr_bits.

  Default (24 bits, scale 1): floor(t) + [u < t - floor(t)], up with
  probability equal to the distance from the integer below (exact whenever
  that fraction is a multiple of 2^-24, i.e. always in the normal range of
  the element format). Otherwise, in sign-magnitude as a hardware converter
  rounds: the magnitude |t| moves away from zero iff u < p, where p is the
  fraction |t| - floor(|t|) truncated to `sr_bits` bits (fewer random bits:
  a shrink toward zero below 2^-sr_bits ulps) times `sr_round_up_scale`
  (in [0, 1]; 0.5 halves the round-up probability, a bias toward zero of
  half the fraction).
  """
  u = (random_bits >> (32 - sr_bits)).astype(jnp.int32).astype(jnp.float32) * 2.0**-sr_bits
  if (sr_bits, sr_round_up_scale) == (SR_BITS, 1.0):
    fl = jnp.floor(t)
    return fl + (u < t - fl).astype(jnp.float32)
  a = jnp.abs(t)
  fl = jnp.floor(a)
  p = a - fl
  if sr_bits < SR_BITS:
    p = jnp.floor(p * 2.0**sr_bits) * 2.0**-sr_bits
  p = p * jnp.float32(sr_round_up_scale)
  return jnp.copysign(fl + (u < p).astype(jnp.float32), t)


def e2m1_codes(q):
  """4-bit E2M1 codes (uint8) of float32 values on the E2M1 grid.

  Bit arithmetic that Triton can lower; equal to
  bitcast(q.astype(float4_e2m1fn), uint4) including -0 and NaN (code 8, as
  XLA's conversion gives).
  """
  bits = lax.bitcast_convert_type(q, jnp.int32)
  sign = (bits >> 28) & 8
  mag = bits & 0x7FFFFFFF
  # |q| >= 1: code = 2 * (exponent + 1) + top mantissa bit; 0.5 -> 1; 0 -> 0.
  code = jnp.where(mag >= 0x3F800000, (mag >> 22) - 252,
                   (mag >= 0x3F000000).astype(jnp.int32))
  code = jnp.where(jnp.isnan(q), 8, sign | code)
  return code.astype(jnp.uint8)


def e2m1_values(codes):
  """Float32 values of 4-bit E2M1 codes (int32 0..15): the inverse of e2m1_codes.

  Bit arithmetic that Triton can lower; equal to
  bitcast(codes.astype(uint4), float4_e2m1fn).astype(float32).
  """
  mag = codes & 7
  # mag >= 2: 2^(mag // 2 - 1) * (1 + (mag & 1) / 2); 1 -> 0.5; 0 -> 0.
  bits = jnp.where(mag >= 2, (((mag >> 1) + 126) << 23) | ((mag & 1) << 22),
                   jnp.where(mag == 1, 0x3F000000, 0))
  return lax.bitcast_convert_type(bits | ((codes & 8) << 28), jnp.float32)
