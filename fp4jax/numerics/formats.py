"""Block-scaled low-precision formats: MX (OCP v1.0), NVFP4 and FP8.

A tensor is cut into blocks of `block` consecutive elements along one axis
(the whole tensor for per-tensor FP8); each block shares a scale and its
elements are rounded onto a small float grid:

  mx*     E8M0 scale 2^e per block, e from a scale rule (fp4jax.numerics.scales)
  nvfp4   E4M3 scale per 16-block, (block amax / 6) / global_scale rounded
          to nearest E4M3, times an FP32 per-tensor global_scale
          amax / (6*448) (amax over finite values; 1 if that is 0)
  fp8_*   FP32 scale amax / max per tensor (or per block if block_size is set)

A block whose scale is zero (all zeros, or a scale below the scale format's
range) quantizes to zeros.

(Divisions by constants c are computed as x * float32(1/c); elements are x
divided by the scale, exactly for MX's powers of two.)

Dequantization is (values * scales) * global_scale, in float32. Blocks whose
amax is NaN or Inf get a NaN scale and dequantize to NaN; all-zero blocks give
zeros. Arithmetic follows the backend: XLA:CPU flushes FP32 subnormals to zero
(inputs and results), so there FP32-subnormal inputs, and blocks with scale
2^-127, dequantize to zero; the E8M0 bits are exact on every backend.

stochastic_dither (Tseng et al. 2025): elements are x / scale * 3/4, rounded
stochastically, which never saturates; "scaled back" means the 4/3 is carried
in `global_scale` (E8M0 cannot hold it) and applied in float32 at
dequantization (a GEMM applies it in its epilogue, 16/9 for two such
operands). Then E[dequantize] = x up to the float32 rounding of x * 3/4 and
of 4/3 (relative 2^-24).
"""

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax.numerics import eden
from fp4jax.numerics import elements
from fp4jax.numerics import four_over_six
from fp4jax.numerics import quest
from fp4jax.numerics import scales as scales_lib
from fp4jax.numerics import tiles
from fp4jax.numerics.elements import ELEMENTS, ElementFormat, round_element
from fp4jax.numerics.scales import block_exponent

# name -> (family, element, default block)
_FORMATS = {
    "mxfp4": ("mx", "e2m1", 32),
    "mxfp6_e2m3": ("mx", "e2m3", 32),
    "mxfp6_e3m2": ("mx", "e3m2", 32),
    "mxfp8_e4m3": ("mx", "e4m3", 32),
    "mxfp8_e5m2": ("mx", "e5m2", 32),
    "nvfp4": ("nvfp4", "e2m1", 16),
    "fp8_e4m3": ("fp8", "e4m3", None),
    "fp8_e5m2": ("fp8", "e5m2", None),
}
FORMATS = tuple(_FORMATS)
SCALE_MODES = ("floor", "ceil", "even", "rceil")
ROUNDINGS = ("nearest", "stochastic", "stochastic_dither")
BLOCK_SCALES = ("amax", "quest", "four_over_six", "ms_eden")
NVFP4_GLOBAL_DIVISOR = 6.0 * 448.0  # E2M1 max * E4M3 max


def _check_name(kind, value, allowed):
  if value not in allowed:
    raise ValueError(f"unknown {kind} {value!r}; valid: {', '.join(allowed)}")


@dataclasses.dataclass(frozen=True)
class QuantSpec:
  """How to quantize one operand.

  fmt: one of FORMATS. block_size: elements per scale (None: 32 for MX, 16 for
  NVFP4, whole tensor for FP8). scale_mode: E8M0 rule, MX only (one of
  SCALE_MODES). rounding: one of ROUNDINGS. block_2d: blocks are square
  tiles of block x block elements over the quantized axis and all other axes
  flattened (fp4jax.numerics.blocks2d), so a matrix and its transpose quantize alike;
  blocked formats only. block_scale, one of BLOCK_SCALES: "amax" (the scale
  rule on the block maximum) or "quest" (mxfp4, nearest, floor only: the
  scale from the block RMS with clipping, fp4jax.numerics.quest; dot_general then
  zeroes the gradient of clipped Fprop elements) or "four_over_six" (nvfp4,
  nearest or stochastic: each block scaled to a max of 6 or 4, whichever
  errs less, fp4jax.numerics.four_over_six) or "ms_eden" (nvfp4, rounding
  "stochastic": elements round to nearest, the EDEN-corrected block scales
  stochastically; fp4jax.numerics.eden).
  sr_bits (1..24, default 24) and sr_round_up_scale (in [0, 1], default 1):
  how a random rounding rounds, random roundings only
  (fp4jax.numerics.elements.stochastic_round): the random bits used per
  element, and a factor on the probability of rounding a magnitude up (0.5
  halves it: a biased SR). The defaults are unbiased SR.
  """
  fmt: str
  block_size: int | None = None
  scale_mode: str = "floor"
  rounding: str = "nearest"
  block_2d: bool = False
  block_scale: str = "amax"
  sr_bits: int = elements.SR_BITS
  sr_round_up_scale: float = 1.0

  def __post_init__(self):
    _check_name("format", self.fmt, FORMATS)
    _check_name("scale_mode", self.scale_mode, SCALE_MODES)
    _check_name("rounding", self.rounding, ROUNDINGS)
    if self.block_size is not None:
      if isinstance(self.block_size, bool) or not isinstance(self.block_size,
                                                             int):
        raise TypeError(f"block_size must be an int or None, got "
                        f"{self.block_size!r}")
      if self.block_size <= 0:
        raise ValueError(f"block_size must be positive, got {self.block_size}")
    if self.family != "mx" and self.scale_mode != "floor":
      raise ValueError(f"scale_mode={self.scale_mode!r} applies to MX formats "
                       f"(E8M0 scales) only; {self.fmt} scales are not E8M0")
    if not isinstance(self.block_2d, bool):
      raise TypeError(f"block_2d must be a bool, got {self.block_2d!r}")
    if self.block_2d and self.block is None:
      raise ValueError(f"block_2d=True needs a blocked format; {self.fmt} has "
                       "one scale per tensor")
    _check_name("block_scale", self.block_scale, BLOCK_SCALES)
    if self.block_scale == "quest" and (self.fmt, self.scale_mode, self.rounding) != (
        "mxfp4", "floor", "nearest"):
      raise ValueError(f"block_scale='quest' is QuEST's forward quantizer: fmt='mxfp4', "
                       f"scale_mode='floor', rounding='nearest'; got fmt={self.fmt!r}, "
                       f"scale_mode={self.scale_mode!r}, rounding={self.rounding!r}")
    if self.block_scale == "ms_eden" and (self.fmt, self.rounding) != ("nvfp4", "stochastic"):
      raise ValueError(f"block_scale='ms_eden' needs fmt='nvfp4' and rounding='stochastic' "
                       f"(its randomness is in the scales); got fmt={self.fmt!r}, "
                       f"rounding={self.rounding!r}")
    self._check_sr()
    if self.block_scale == "four_over_six" and (
        self.fmt != "nvfp4" or self.rounding == "stochastic_dither"):
      raise ValueError(f"block_scale='four_over_six' needs fmt='nvfp4' and nearest or "
                       f"stochastic rounding; got fmt={self.fmt!r}, "
                       f"rounding={self.rounding!r}")

  def _check_sr(self):
    """ValueError for sr_bits / sr_round_up_scale out of range, or set on a nearest rounding."""
    bits, scale = self.sr_bits, self.sr_round_up_scale
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= elements.SR_BITS:
      raise ValueError(f"sr_bits must be an int in [1, {elements.SR_BITS}], got {bits!r}")
    if (isinstance(scale, bool) or not isinstance(scale, (int, float))
        or not 0.0 <= scale <= 1.0):
      raise ValueError(f"sr_round_up_scale must be a number in [0, 1], got {scale!r}")
    if not self.is_random and (bits, scale) != (elements.SR_BITS, 1.0):
      raise ValueError(f"sr_bits={bits!r}, sr_round_up_scale={scale!r} set how a random "
                       f"rounding rounds; rounding={self.rounding!r} is not random (use "
                       f"'stochastic' or 'stochastic_dither')")

  @property
  def sr(self) -> dict:
    """round_element's keyword arguments for this spec's random rounding."""
    return dict(sr_bits=self.sr_bits, sr_round_up_scale=self.sr_round_up_scale)

  @property
  def family(self) -> str:
    """'mx', 'nvfp4' or 'fp8'."""
    return _FORMATS[self.fmt][0]

  @property
  def element(self) -> ElementFormat:
    return ELEMENTS[_FORMATS[self.fmt][1]]

  @property
  def block(self) -> int | None:
    """Resolved block size; None means one scale for the whole tensor."""
    return self.block_size if self.block_size is not None else _FORMATS[
        self.fmt][2]

  @property
  def is_random(self) -> bool:
    return self.rounding != "nearest"

  @property
  def is_plain_blocks(self) -> bool:
    """True for 1D blocks scaled from their amax (what fp4jax.kernels implement)."""
    return not self.block_2d and self.block_scale == "amax"

  @property
  def has_trust_mask(self) -> bool:
    """True when the gradient of clipped elements is zeroed (QuEST)."""
    return self.block_scale == "quest"

  @property
  def element_dtype(self):
    """Storage dtype of QArray.values (float8_e4m3fn holds MXFP6 values)."""
    return self.element.dtype

  @property
  def element_max(self) -> float:
    return self.element.max

  @property
  def scale_dtype(self):
    return {"mx": jnp.float8_e8m0fnu, "nvfp4": jnp.float8_e4m3fn,
            "fp8": jnp.float32}[self.family]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["values", "scales", "global_scale"],
                   meta_fields=["spec", "axis"])
@dataclasses.dataclass(frozen=True)
class QArray:
  """A quantized array.

  values: x.shape, spec.element_dtype. scales: x.shape with `axis` replaced by
  ceil(n / block) (shape () for per-tensor FP8), spec.scale_dtype.
  global_scale: float32 scalar (NVFP4 per-tensor scale, times 4/3 for
  stochastic_dither) or None. axis: the blocked axis (non-negative).
  """
  values: jax.Array
  scales: jax.Array
  global_scale: jax.Array | None
  spec: QuantSpec
  axis: int

  def dequantize(self, dtype=jnp.float32):
    """(values * scales) * global_scale as `dtype`, shape values.shape."""
    q = self.values.astype(jnp.float32)
    n = q.shape[self.axis] if q.ndim else 1
    if self.spec.family == "mx":
      s = scales_lib.exp2(scales_lib.from_e8m0(self.scales))
    else:
      s = self.scales.astype(jnp.float32)
    block = self.spec.block
    if block is None:
      y = q * s
    else:
      qb, _ = _to_blocks(q, self.axis, block)
      y = _from_blocks(qb * jnp.expand_dims(s, self.axis + 1), self.axis, n)
    if self.global_scale is not None:
      y = y * self.global_scale
    return y.astype(dtype)


def _to_blocks(x, axis, block):
  """Pads `axis` to a multiple of block with zeros and splits it in place:
  [..., n, ...] -> [..., n_blocks, block, ...]. Returns (blocks, n)."""
  n = x.shape[axis]
  pad = -n % block
  if pad:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    x = jnp.pad(x, widths)
  shape = x.shape[:axis] + ((n + pad) // block, block) + x.shape[axis + 1:]
  return x.reshape(shape), n


def _from_blocks(xb, axis, n):
  """Inverse of _to_blocks: merges axes (axis, axis+1) and trims to n."""
  shape = xb.shape[:axis] + (xb.shape[axis] * xb.shape[axis + 1],)
  x = xb.reshape(shape + xb.shape[axis + 2:])
  return lax.slice_in_dim(x, 0, n, axis=axis) if x.shape[axis] != n else x


def _check_axis(axis, ndim):
  """axis as a non-negative index; TypeError when not an int, ValueError
  when out of range."""
  allowed = f"an int in [{-ndim}, {ndim})"
  try:
    if isinstance(axis, bool):
      raise TypeError
    axis = operator.index(axis)
  except TypeError:
    raise TypeError(f"axis must be {allowed} for an array of rank {ndim}, "
                    f"got {axis!r} ({type(axis).__name__})") from None
  if not -ndim <= axis < ndim:
    raise ValueError(f"axis {axis} out of range for an array of rank {ndim}; "
                     f"allowed: {allowed}")
  return axis % ndim


def _check_input(x, spec, axis, key):
  if not isinstance(spec, QuantSpec):
    raise TypeError(f"spec must be a QuantSpec, got {type(spec).__name__}")
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"can only quantize real floating arrays, got dtype "
                    f"{dtype}")
  if spec.block is not None:
    axis = _check_axis(axis, jnp.ndim(x))
  if spec.is_random and key is None:
    raise ValueError(f"rounding={spec.rounding!r} needs a PRNG key; got None")
  return axis


def block_amax(xb, axis):
  """max |x| over `axis` (all axes if None), keepdims, via the integer max of
  the magnitude bits: NaN (bits above Inf) always wins, which XLA:CPU's float
  max reduction does not guarantee, and FP32 subnormals are kept exactly."""
  mag = lax.bitcast_convert_type(jnp.abs(xb), jnp.int32)
  return lax.bitcast_convert_type(jnp.max(mag, axis=axis, keepdims=True),
                                  jnp.float32)


def exponent_amax(xb, axis):
  """max |x| over `axis` (an int), keepdims, as exact as an E8M0 shared
  exponent needs: scales.block_exponent gives every block the exponent it gives
  from block_amax. Along the last axis, where XLA:CPU's integer max runs
  several times slower than its float max, a float max with NaN counted as
  +Inf (the float max may drop NaN; a NaN and an Inf amax both give the NaN
  scale; an amax below 2^-126 may come back as another such value or 0 where
  subnormals are flushed, and every MX element format, emax >= 2, gives all of
  them exponent -127); along any other axis block_amax itself."""
  if axis != xb.ndim - 1:
    return block_amax(xb, axis)
  mag = jnp.abs(xb)
  return jnp.max(jnp.where(jnp.isnan(mag), jnp.inf, mag), axis=axis, keepdims=True)


def per_block(values):
  """float32 `values`, unchanged, computed once per block.

  XLA:CPU fuses cheap per-block work (exponent to scale) into the element pass
  that broadcasts it and redoes it for every element (lax.optimization_barrier
  does not stop that); it does not duplicate an integer division into its
  consumers, so dividing the bits by a 1 it cannot fold (clz < 64) keeps
  `values` once per block."""
  bits = lax.bitcast_convert_type(values, jnp.int32)
  return lax.bitcast_convert_type(lax.div(bits, (lax.clz(bits) >> 6) | 1), jnp.float32)


def _recip(c):
  """float32 1/c. Constant divisors are written as this product because XLA
  rewrites x / c into x * (1/c) anyway; spelling it out keeps the definition
  the same on every backend and in the NumPy reference."""
  return jnp.float32(1.0 / c)


QUANTIZE_SCOPE = "fp4jax_quantize:"  # + repr(spec): the name fp4jax.audit finds quantizers by


def _named_by_spec(fn):
  """fn(x, spec, ...) inside jax.named_scope(QUANTIZE_SCOPE + repr(spec)); names only."""
  @functools.wraps(fn)
  def named(x, spec, *args):
    with jax.named_scope(f"{QUANTIZE_SCOPE}{spec!r}"):
      return fn(x, spec, *args)
  return named


@_named_by_spec
def _element_values(x, spec, axis, key):
  """Core of quantize/fake_quantize on float32 x.

  Returns (q, s, stored_scales, global_scale, n): q the rounded elements
  (float32, blocked when spec.block is set), s the float32 block scales
  broadcastable against q, stored_scales s in spec.scale_dtype (blocks axis
  squeezed), global_scale float32 scalar or None, n the original axis length.
  """
  block = spec.block
  if block is None:
    xb, n, red = x, None, None
  else:
    xb, n = _to_blocks(x, axis, block)
    red = axis + 1
  g = None
  four_six = spec.block_scale == "four_over_six"
  if spec.family == "mx":
    e = (quest.block_exponent(xb, red, spec) if spec.block_scale == "quest" else
         block_exponent(exponent_amax(xb, red), spec))
    s = scales_lib.exp2(e)
    inv = scales_lib.exp2(jnp.where(e == scales_lib.E8M0_NAN, e, -e))
    s, inv = per_block(s), per_block(inv)
    v = xb * inv
    stored = scales_lib.to_e8m0(e)
  elif spec.family == "nvfp4":
    amax = block_amax(xb, red)
    finite = jnp.isfinite(amax)
    g_amax = jnp.max(jnp.where(finite, amax, 0.0))
    divisor, peak = {"four_over_six": (four_over_six.GLOBAL_DIVISOR, spec.element.max),
                     "ms_eden": (eden.GLOBAL_DIVISOR, eden.PEAK)}.get(
                         spec.block_scale, (NVFP4_GLOBAL_DIVISOR, spec.element.max))
    g = g_amax * _recip(divisor)
    g = jnp.where(g > 0, g, 1.0)  # all-zero tensor, or underflow
    s, v = _nvfp4_scaled(xb, amax, finite, g, peak)
    stored = s.astype(jnp.float8_e4m3fn)
  else:  # fp8: float32 scale amax / max
    amax = block_amax(xb, red)
    s = jnp.where(jnp.isfinite(amax), amax * _recip(spec.element.max), jnp.nan)
    v = xb / jnp.where(s == 0, jnp.inf, s)  # zero (or underflowed) scale -> 0
    stored = s
  if block is not None:
    stored = jnp.squeeze(stored, red)
  else:
    stored = stored.reshape(())
  if spec.block_scale == "ms_eden":
    q = round_element(v, spec.element)
    s = round_element(eden.corrected_scales(v, q, s, red), ELEMENTS["e4m3"],
                      jax.random.bits(key, s.shape, jnp.uint32), **spec.sr)
    return q, s, jnp.squeeze(s.astype(jnp.float8_e4m3fn), red), g, n
  bits = None
  if spec.is_random:
    bits = jax.random.bits(key, v.shape, jnp.uint32)
  if spec.rounding == "stochastic_dither":
    v = v * 0.75
    g = jnp.float32(4.0 / 3.0) * (1.0 if g is None else g)
  q = round_element(v, spec.element, bits, **spec.sr)
  if four_six:
    s4, v4 = _nvfp4_scaled(xb, amax, finite, g, four_over_six.SMALL_PEAK)
    q4 = round_element(v4, spec.element, bits, **spec.sr)
    q, s = four_over_six.select(xb, (q, s), (q4, s4), g, red)
    stored = jnp.squeeze(s.astype(jnp.float8_e4m3fn), red)
  return q, s, stored, g, n


def _nvfp4_scaled(xb, amax, finite, g, peak):
  """(s, v): E4M3 block scales mapping each block's amax to `peak`, as float32
  (NaN for non-finite blocks), and the blocks divided by s * g (0 where that
  is 0)."""
  s = per_block(jnp.where(finite, round_element(amax * _recip(peak) / g, ELEMENTS["e4m3"]),
                          jnp.nan))
  d = per_block(s * g)
  return s, xb / jnp.where(d == 0, jnp.inf, d)


def quantize(x, spec: QuantSpec, axis: int = -1, key=None, values_dtype=None) -> QArray:
  """Quantizes x (any float dtype) along `axis` (ignored for per-tensor FP8).

  key: PRNG key for random roundings (the same key gives the same bits);
  ignored for nearest. values_dtype: dtype of QArray.values (default
  spec.element_dtype); float32 holds the same element values and skips the
  float4 conversion, which XLA:CPU runs slowly.
  """
  x = jnp.asarray(x)
  axis = _check_input(x, spec, axis, key)
  if spec.block_2d:
    raise ValueError("quantize returns 1D blocks; quantize a block_2d spec with "
                     "fp4jax.numerics.blocks2d.quantize_tiles")
  q, _, stored, g, n = _element_values(x.astype(jnp.float32), spec, axis, key)
  if n is not None:
    q = _from_blocks(q, axis, n)
  return QArray(q.astype(values_dtype or spec.element_dtype), stored, g, spec,
                axis if spec.block is not None else 0)


def _block_dequantize(x, spec, axis, key):
  """(q * s as float32 in x's shape, global_scale float32 scalar or None)."""
  q, s, _, g, n = _element_values(x.astype(jnp.float32), spec, axis, key)
  y = q * s
  if n is not None:
    y = _from_blocks(y, axis, n)
  return y, g


def _fake_quantize(x, spec, axis, key):
  y, g = _block_dequantize(x, spec, axis, key)
  if g is not None:
    y = y * g
  return y.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _fake_quantize_ste(x, spec, axis, key):
  return _fake_quantize(x, spec, axis, key)


def _ste_fwd(x, spec, axis, key):
  return _fake_quantize(x, spec, axis, key), None


def _ste_bwd(spec, axis, _, g):
  del spec, axis
  return g, None


_fake_quantize_ste.defvjp(_ste_fwd, _ste_bwd)


def fake_quantize(x, spec: QuantSpec, axis: int = -1, key=None):
  """quantize(x, spec, axis, key).dequantize(x.dtype), bit for bit, computed
  in float32 without leaving x's layout; straight-through gradient. A
  block_2d spec quantizes square tiles (fp4jax.numerics.tiles)."""
  x = jnp.asarray(x)
  axis = _check_input(x, spec, axis, key)
  if spec.block_2d:
    return tiles.tiled(x, spec, axis,
                       lambda t, s: (_fake_quantize_ste(t, s, t.ndim - 1, key), None))[0]
  return _fake_quantize_ste(x, spec, axis, key)


def clip_mask(x, spec: QuantSpec, axis: int = -1):
  """bool, x.shape: True where quantize(x, spec, axis) leaves the element
  unclipped, |x| <= element max * its block scale (* global scale); NaN is
  False. Random roundings are judged by their nearest-rounding scales (the
  same scales). 1D blocks only."""
  x = jnp.asarray(x)
  spec = dataclasses.replace(spec, rounding="nearest", sr_bits=elements.SR_BITS,
                             sr_round_up_scale=1.0)
  axis = _check_input(x, spec, axis, None)
  if spec.block_2d:
    raise ValueError("clip_mask takes 1D blocks; got a block_2d spec")
  x32 = x.astype(jnp.float32)
  _, s, _, g, n = _element_values(x32, spec, axis, None)
  xb = x32 if n is None else _to_blocks(x32, axis, spec.block)[0]
  limit = s * spec.element_max
  if g is not None:
    limit = limit * g
  ok = jnp.abs(xb) <= limit
  return ok if n is None else _from_blocks(ok, axis, n)
def fake_quantize_unscaled(x, spec: QuantSpec, axis: int = -1, key=None):
  """fake_quantize without the per-tensor factor: (values, global_scale).

  values: float32, x's shape, the elements times their block scales (exact in
  bf16 for MX and NVFP4); global_scale: QArray.global_scale (float32 scalar or
  None), which a GEMM applies to its float32 output. values * global_scale is
  fake_quantize(x, ...) in float32, bit for bit. No gradient rule.
  """
  x = jnp.asarray(x)
  axis = _check_input(x, spec, axis, key)
  if spec.block_2d:
    return tiles.tiled(x, spec, axis,
                       lambda t, s: _block_dequantize(t, s, t.ndim - 1, key))
  return _block_dequantize(x, spec, axis, key)


def round_to_element(x_scaled, spec: QuantSpec, random_bits=None,
                     nearest=elements.round_half_even):
  """Rounds float32 values (already divided by their scale) onto the element
  grid of `spec`: nearest-even (with `nearest`, see round_element), saturating;
  or, for random roundings, stochastically from uint32 `random_bits` of the
  same shape."""
  if spec.is_random != (random_bits is not None):
    raise ValueError(f"rounding={spec.rounding!r} "
                     + ("needs" if spec.is_random else "takes no")
                     + " random_bits")
  return round_element(x_scaled, spec.element, random_bits, nearest, **spec.sr)


def pack_fp4(values, axis=-1):
  """float4_e2m1fn [..., n, ...] -> uint8 [..., n/2, ...]; element 2i in the
  low nibble, 2i+1 in the high nibble."""
  if values.dtype != jnp.float4_e2m1fn:
    raise TypeError(f"pack_fp4 takes float4_e2m1fn values, got {values.dtype}")
  axis = _check_axis(axis, values.ndim)
  if values.shape[axis] % 2:
    raise ValueError(f"pack_fp4 needs an even length along axis {axis}, got "
                     f"{values.shape[axis]}")
  codes = lax.bitcast_convert_type(values, jnp.uint4).astype(jnp.uint8)
  pairs, _ = _to_blocks(codes, axis, 2)
  lo = lax.index_in_dim(pairs, 0, axis + 1, keepdims=False)
  hi = lax.index_in_dim(pairs, 1, axis + 1, keepdims=False)
  return lo | (hi << 4)


def unpack_fp4(packed, axis=-1):
  """Inverse of pack_fp4: uint8 [..., m, ...] -> float4_e2m1fn [..., 2m, ...].
  """
  if packed.dtype != jnp.uint8:
    raise TypeError(f"unpack_fp4 takes uint8, got {packed.dtype}")
  axis = _check_axis(axis, packed.ndim)
  pairs = jnp.stack([packed & 0xF, packed >> 4], axis=axis + 1)
  codes = _from_blocks(pairs, axis, 2 * packed.shape[axis])
  return lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn)
