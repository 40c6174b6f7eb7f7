"""An independent NumPy reference quantizer, written from the definitions.

It shares no code with fp4jax: element grids are enumerated from (ebits,
mbits, bias, max), rounding searches the grid, scale exponents come from
frexp and exact float64 comparisons. Where the library's definition fixes a
float32 operation order (NVFP4 and FP8 scales, the 3/4 of stochastic_dither),
the reference performs the same float32 operations with NumPy (a division
by a constant c is a product with float32(1/c), as XLA computes it).
"""

import numpy as np
import ml_dtypes

# name -> (ebits, mbits, bias, max)
ELEMENT_PARAMS = {
    "e2m1": (2, 1, 1, 6.0),
    "e2m3": (2, 3, 1, 7.5),
    "e3m2": (3, 2, 3, 28.0),
    "e4m3": (4, 3, 7, 448.0),
    "e5m2": (5, 2, 15, 57344.0),
}
# fmt -> (family, element, default block)
FORMAT_PARAMS = {
    "mxfp4": ("mx", "e2m1", 32),
    "mxfp6_e2m3": ("mx", "e2m3", 32),
    "mxfp6_e3m2": ("mx", "e3m2", 32),
    "mxfp8_e4m3": ("mx", "e4m3", 32),
    "mxfp8_e5m2": ("mx", "e5m2", 32),
    "nvfp4": ("nvfp4", "e2m1", 16),
    "fp8_e4m3": ("fp8", "e4m3", None),
    "fp8_e5m2": ("fp8", "e5m2", None),
}
F32 = np.float32


def element_grid(elem):
  """Non-negative representable values, ascending, float64. Index parity is
  the parity of the mantissa's last bit (consecutive codes)."""
  ebits, mbits, bias, vmax = ELEMENT_PARAMS[elem]
  values = []
  for code in range(2**(ebits + mbits)):
    e, m = code >> mbits, code & (2**mbits - 1)
    if e == 0:
      v = m / 2**mbits * 2.0**(1 - bias)
    else:
      v = (1 + m / 2**mbits) * 2.0**(e - bias)
    if v <= vmax:
      values.append(v)
  return np.array(values)


def round_nearest(v, elem):
  """Nearest grid value, ties to the even code, saturating; NaN stays NaN."""
  grid = element_grid(elem)
  a = np.abs(v)
  hi = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)
  lo = hi - 1
  d_lo, d_hi = a - grid[lo], grid[hi] - a
  pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
  r = np.where(pick_hi, grid[hi], grid[lo])
  r = np.where(a >= grid[-1], grid[-1], r)
  return np.where(np.isnan(v), np.nan, np.sign(v) * r)


def round_stochastic(v, elem, bits, sr_bits=24, sr_round_up_scale=1.0):
  """Rounds to the grid neighbour above (towards +inf) with probability frac,
  the distance from the one below in units of their gap, taken as
  u = (bits >> 8) / 2^24 < frac; saturating; NaN stays NaN. Other sr_bits or
  sr_round_up_scale: round_magnitude_stochastic."""
  if (sr_bits, sr_round_up_scale) != (24, 1.0):
    return round_magnitude_stochastic(v, elem, bits, sr_bits, sr_round_up_scale)
  grid = element_grid(elem)
  full = np.concatenate([-grid[:0:-1], grid])
  hi = np.clip(np.searchsorted(full, v), 1, len(full) - 1)
  lo = hi - 1
  frac = (v - full[lo]) / (full[hi] - full[lo])
  u = (bits >> np.uint32(8)).astype(np.float64) / 2**24
  r = np.where(u < frac, full[hi], full[lo])
  r = np.where(v == full[lo], full[lo], r)
  return np.where(np.isnan(v), np.nan, np.clip(r, full[0], full[-1]))


def round_magnitude_stochastic(v, elem, bits, sr_bits, sr_round_up_scale):
  """|v| moves up to its grid neighbour above with probability p, else down:
  p = the distance from the neighbour below in units of their gap, truncated
  to sr_bits bits, times sr_round_up_scale (in float32), taken as
  u = (bits >> (32 - sr_bits)) / 2^sr_bits < p; sign kept; saturating."""
  grid = element_grid(elem)
  a = np.abs(v)
  hi = np.clip(np.searchsorted(grid, a, side="right"), 1, len(grid) - 1)
  lo = hi - 1
  p = np.floor((a - grid[lo]) / (grid[hi] - grid[lo]) * 2.0**sr_bits) / 2.0**sr_bits
  p = (p.astype(F32) * F32(sr_round_up_scale)).astype(np.float64)
  u = (bits >> np.uint32(32 - sr_bits)).astype(np.float64) / 2**sr_bits
  r = np.where(a >= grid[-1], grid[-1], np.where(u < p, grid[hi], grid[lo]))
  return np.where(np.isnan(v), np.nan, np.copysign(r, v))


def shared_exponent(amax, elem, mode):
  """Unbiased E8M0 exponent of a block with max magnitude amax (float64), or
  None for NaN/Inf."""
  if not np.isfinite(amax):
    return None
  _, mbits, _, vmax = ELEMENT_PARAMS[elem]
  emax = int(np.floor(np.log2(vmax)))
  if amax == 0:
    return -127
  mant, ex = np.frexp(amax)  # amax = mant * 2^ex, mant in [0.5, 1)
  fl = ex - 1
  if mode == "floor":
    e = fl - emax
  elif mode == "ceil":
    e = (fl if mant == 0.5 else fl + 1) - emax
  elif mode == "even":
    sig = mant * 2  # in [1, 2)
    r = np.round(sig * 2**mbits) / 2**mbits  # half to even
    e = (fl + 1 if r >= 2 else fl) - emax
  elif mode == "rceil":
    e = fl - emax - 1
    while vmax * 2.0**e < amax:
      e += 1
  else:
    raise ValueError(mode)
  return int(np.clip(e, -127, 127))


def _blocks(x, axis, block):
  n = x.shape[axis]
  pad = -n % block
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  xp = np.pad(x, widths)
  nb = xp.shape[axis] // block
  shape = xp.shape[:axis] + (nb, block) + xp.shape[axis + 1:]
  return xp.reshape(shape), n


def quantize(x, fmt, block_size=None, scale_mode="floor", rounding="nearest",
             axis=-1, bits=None, sr_bits=24, sr_round_up_scale=1.0):
  """Reference quantize + dequantize.

  x: NumPy float array (f32 or bf16). bits: uint32 array of the blocked padded
  shape ([..., n_blocks, block, ...], or x.shape per tensor) for random
  roundings, which sr_bits and sr_round_up_scale shape as QuantSpec's do. Returns dict(q=elements f64 (x.shape), scale=per-block scales
  (exponents for MX, None entries as NaN), y=dequantized float32 (x.shape)).
  """
  family, elem, default_block = FORMAT_PARAMS[fmt]
  block = block_size if block_size is not None else default_block
  vmax = ELEMENT_PARAMS[elem][3]
  x32 = np.asarray(x).astype(F32)
  axis %= x32.ndim
  if block is None:
    xb, n, red = x32, None, None
  else:
    xb, n = _blocks(x32, axis, block)
    red = axis + 1
  amax = np.max(np.abs(xb), axis=red, keepdims=True).astype(F32)
  g = None
  with np.errstate(all="ignore"):
    if family == "mx":
      exps = np.vectorize(lambda a: shared_exponent(float(a), elem, scale_mode)
                          if np.isfinite(a) else 128, otypes=[np.int64])(amax)
      s = np.where(exps == 128, np.nan, np.ldexp(1.0, np.minimum(exps, 127)))
      v = xb.astype(np.float64) / s
      scale_out = exps
    elif family == "nvfp4":
      finite = np.isfinite(amax)
      g_amax = F32(np.max(np.where(finite, amax, F32(0))))
      g = F32(g_amax * F32(1 / 2688.0))
      g = g if g > 0 else F32(1.0)
      s_raw = (amax * F32(1 / 6.0)).astype(F32) / g
      s = np.where(finite, round_nearest(s_raw.astype(np.float64), "e4m3"),
                   np.nan).astype(F32)
      d = (s * g).astype(F32)
      v = (xb / np.where(d == 0, np.inf, d)).astype(F32).astype(np.float64)
      scale_out = s
    else:
      s = np.where(np.isfinite(amax), (amax * F32(1 / vmax)).astype(F32),
                   np.nan).astype(F32)
      v = (xb / np.where(s == 0, np.inf, s)).astype(F32).astype(np.float64)
      scale_out = s
    if rounding == "stochastic_dither":
      v = (v.astype(F32) * F32(0.75)).astype(np.float64)
      g = F32(F32(4.0 / 3.0) * (F32(1.0) if g is None else g))
    if rounding == "nearest":
      q = round_nearest(v, elem)
    else:
      q = round_stochastic(v, elem, bits.reshape(v.shape), sr_bits, sr_round_up_scale)
    y = (q * s).astype(F32)
    if g is not None:
      y = (y * g).astype(F32)
  if block is not None:
    merged = y.shape[:axis] + (-1,) + y.shape[axis + 2:]
    y = np.take(y.reshape(merged), np.arange(n), axis=axis)
    q = np.take(q.reshape(merged), np.arange(n), axis=axis)
    scale_out = np.squeeze(scale_out, red)
  else:
    scale_out = scale_out.reshape(())
  return dict(q=q, scale=scale_out, global_scale=g,
              y=y.astype(np.asarray(x).dtype))


def bf16(a):
  return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)
