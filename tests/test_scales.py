"""Golden E8M0 codes of the four scale rules on hand-picked block maxima.

Codes are biased exponents (0x7F = 2^0, 0xFF = NaN), worked out by hand from
the definitions in docs/numerics.md ("Scale rules").
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.bench import hlo_stats
from fp4jax.numerics import formats
from fp4jax.numerics import scales

F32_MAX = float(np.finfo(np.float32).max)
BELOW_8 = float(np.nextafter(np.float32(8.0), np.float32(0.0)))

# (fmt, amax, {mode: code}); modes in the order floor, ceil, even, rceil.
GOLDEN = [
    # E2M1: emax 2, max 6 = 1.5 * 2^2, 1 mantissa bit.
    ("mxfp4", 4.0, (0x7F, 0x7F, 0x7F, 0x7F)),       # exact power of two
    ("mxfp4", 6.0, (0x7F, 0x80, 0x7F, 0x7F)),       # = max
    ("mxfp4", 6.5, (0x7F, 0x80, 0x7F, 0x80)),       # 1.625: rceil goes up
    ("mxfp4", 7.0, (0x7F, 0x80, 0x80, 0x80)),       # significand 1.75
    ("mxfp4", BELOW_8, (0x7F, 0x80, 0x80, 0x80)),   # just below 2^3
    ("mxfp4", 1.0, (0x7D, 0x7D, 0x7D, 0x7D)),
    ("mxfp4", 1.5, (0x7D, 0x7E, 0x7D, 0x7D)),       # 1.5/6 = 2^-2 exactly
    ("mxfp4", 0.0, (0x00, 0x00, 0x00, 0x00)),       # zero block
    ("mxfp4", 1e-40, (0x00, 0x00, 0x00, 0x00)),     # FP32 subnormal
    ("mxfp4", 2.0**-149, (0x00, 0x00, 0x00, 0x00)),  # smallest subnormal
    ("mxfp4", 2.0**-126, (0x00, 0x00, 0x00, 0x00)),  # saturates at 2^-127
    ("mxfp4", 1.75 * 2.0**-125, (0x00, 0x01, 0x01, 0x01)),
    ("mxfp4", 2.0**-124, (0x01, 0x01, 0x01, 0x01)),
    ("mxfp4", 2.0**127, (0xFC, 0xFC, 0xFC, 0xFC)),   # near the top
    ("mxfp4", F32_MAX, (0xFC, 0xFD, 0xFD, 0xFD)),
    ("mxfp4", float("nan"), (0xFF, 0xFF, 0xFF, 0xFF)),
    ("mxfp4", float("inf"), (0xFF, 0xFF, 0xFF, 0xFF)),
    # E4M3: emax 8, max 448 = 1.75 * 2^8, 3 mantissa bits.
    ("mxfp8_e4m3", 448.0, (0x7F, 0x80, 0x7F, 0x7F)),
    ("mxfp8_e4m3", 480.0, (0x7F, 0x80, 0x7F, 0x80)),  # 1.875 fits 3 bits
    ("mxfp8_e4m3", 496.0, (0x7F, 0x80, 0x80, 0x80)),  # 1.9375: tie -> 2
    ("mxfp8_e4m3", 256.0, (0x7F, 0x7F, 0x7F, 0x7F)),
    ("mxfp8_e4m3", 1e-40, (0x00, 0x00, 0x00, 0x00)),
    # E5M2: emax 15, max 57344 = 1.75 * 2^15, 2 mantissa bits.
    ("mxfp8_e5m2", 57344.0, (0x7F, 0x80, 0x7F, 0x7F)),
    ("mxfp8_e5m2", 61440.0, (0x7F, 0x80, 0x80, 0x80)),  # 1.875: tie -> 2
    ("mxfp8_e5m2", 1.0, (0x70, 0x70, 0x70, 0x70)),
    # E2M3: emax 2, max 7.5 = 1.875 * 2^2, 3 mantissa bits.
    ("mxfp6_e2m3", 7.5, (0x7F, 0x80, 0x7F, 0x7F)),
    ("mxfp6_e2m3", 7.75, (0x7F, 0x80, 0x80, 0x80)),
    # E3M2: emax 4, max 28 = 1.75 * 2^4, 2 mantissa bits.
    ("mxfp6_e3m2", 28.0, (0x7F, 0x80, 0x7F, 0x7F)),
    ("mxfp6_e3m2", 30.0, (0x7F, 0x80, 0x80, 0x80)),
]


MODES = list(enumerate(formats.SCALE_MODES))


def _codes(e):
  return np.asarray(scales.to_e8m0(e).view(jnp.uint8)).tolist()


@pytest.mark.parametrize("fmt", sorted({g[0] for g in GOLDEN}))
@pytest.mark.parametrize("mode_index,mode", MODES)
def test_block_exponent_golden(fmt, mode_index, mode):
  rows = [g for g in GOLDEN if g[0] == fmt]
  amax = jnp.asarray([r[1] for r in rows], jnp.float32)
  spec = formats.QuantSpec(fmt, scale_mode=mode)
  got = _codes(scales.block_exponent(amax, spec))
  want = [r[2][mode_index] for r in rows]
  assert got == want, [(r[1], g, w) for r, g, w in zip(rows, got, want)
                       if g != w]


@pytest.mark.parametrize("mode_index,mode", MODES)
def test_quantize_scales_golden(mode_index, mode):
  """quantize puts the same codes in QArray.scales: each golden amax becomes
  the largest magnitude of its own 32-block (with a negative sign)."""
  rows = [g for g in GOLDEN if g[0] == "mxfp4"]
  x = np.zeros((len(rows), 32), np.float32)
  for i, r in enumerate(rows):
    x[i, 5] = -r[1]
    x[i, 6] = r[1] / 3 if np.isfinite(r[1]) else 1.0
  q = formats.quantize(jnp.asarray(x), formats.QuantSpec("mxfp4",
                                                         scale_mode=mode))
  got = np.asarray(q.scales.view(jnp.uint8))[:, 0].tolist()
  assert got == [r[2][mode_index] for r in rows]


def test_special_blocks_dequantize():
  """NaN/Inf block -> all NaN; zero block -> zeros; others untouched."""
  x = np.ones((4, 32), np.float32)
  x[0, 3] = np.nan
  x[1, 7] = -np.inf
  x[2] = 0.0
  ys = jax.jit(lambda x: [formats.fake_quantize(
      x, formats.QuantSpec("mxfp4", scale_mode=m))
                           for m in formats.SCALE_MODES])(jnp.asarray(x))
  for y in map(np.asarray, ys):
    assert np.isnan(y[:2]).all()
    np.testing.assert_array_equal(y[2], 0.0)
    np.testing.assert_array_equal(y[3], 1.0)


def test_subnormal_inputs():
  """A block of FP32 subnormals gets scale 2^-127 and finite output.

  The element values follow the backend: exact where subnormals are kept,
  zero where XLA flushes them (CPU)."""
  x = jnp.full((32,), 3e-39, jnp.float32).at[0].set(-1e-40)
  spec = formats.QuantSpec("mxfp8_e5m2")
  q, y = jax.jit(lambda x: (formats.quantize(x, spec),
                            formats.fake_quantize(x, spec)))(x)
  assert int(q.scales.view(jnp.uint8)[0]) == 0
  y = np.asarray(y)
  flushes = float(jax.jit(lambda a: a * 2.0)(jnp.float32(1e-40))) == 0.0
  if flushes:
    np.testing.assert_array_equal(y, 0.0)
  else:
    np.testing.assert_allclose(y, np.asarray(x), rtol=2**-2)


def _special_blocks(dtype, rng):
  """float32 [64, 96] holding `dtype` values: heavy-tailed normals, one special
  value in each of rows 0-7 (NaN, -Inf, 0, FP32 subnormal, bf16 subnormal,
  2^-126, just below 2^-126, the dtype's largest value), a zero block, a block
  of FP32 subnormals and one of subnormals topped by 2^-126 (blocks of 32 along
  axis 1; along axis 0 the special rows share a block)."""
  x = rng.standard_normal((64, 96)) * np.exp(3 * rng.standard_normal((64, 96)))
  tiny = float(np.finfo(np.float32).tiny)  # 2^-126
  specials = [np.nan, -np.inf, 0.0, 1e-40, -2.0**-133, tiny, -np.nextafter(tiny, 0),
              float(jnp.finfo(dtype).max)]
  x[:len(specials), 5] = specials
  x[2, :32] = 0.0
  x[3, :32] = 1e-40
  x[4, 32:64] = [2.0**-133] * 31 + [tiny]
  return jnp.asarray(x.astype(np.float32)).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3",
                                 "mxfp8_e5m2"])
def test_exponent_amax_gives_block_amax_exponents(fmt, dtype):
  """The float amax the MX quantizer uses gives every block the exponent the
  NaN-exact integer amax gives, under all four rules, blocks along the last
  axis (the float max vectorizes) and along the first, with NaN, Inf, zero,
  subnormal and largest-value blocks."""
  x = _special_blocks(dtype, np.random.default_rng(1)).astype(jnp.float32)

  @functools.partial(jax.jit, static_argnums=1)
  def both(x, axis):
    xb, _ = formats._to_blocks(x, axis, 32)
    return formats.exponent_amax(xb, axis + 1), formats.block_amax(xb, axis + 1)

  for axis in (0, 1):
    fast, exact = both(x, axis)
    assert np.isnan(np.asarray(exact)).any()
    for mode in formats.SCALE_MODES:
      spec = formats.QuantSpec(fmt, scale_mode=mode)
      np.testing.assert_array_equal(np.asarray(scales.block_exponent(fast, spec)),
                                    np.asarray(scales.block_exponent(exact, spec)),
                                    err_msg=f"axis {axis}, {mode}")


def test_per_block_returns_its_input_bit_for_bit():
  """formats.per_block is the identity on every float32 bit pattern class:
  signed zeros, subnormals, normals, the extremes, Inf and NaN payloads."""
  bits = np.array([0, 0x80000000, 1, 0x807FFFFF, 0x00800000, 0x3F800000, 0xBF800000,
                   0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000,
                   0xFFC00001, 0x7F800001], np.uint32)
  x = bits.view(np.float32).reshape(2, 7)
  got = np.asarray(jax.jit(formats.per_block)(jnp.asarray(x)))
  np.testing.assert_array_equal(got.view(np.uint32), x.view(np.uint32))


def _elements(line):
  """Number of elements of an HLO instruction line's array shape (0 for others)."""
  m = hlo_stats._SHAPED.match(line)
  return int(np.prod([int(d) for d in m.group(3).split(",") if d])) if m else 0


def _per_block_ops_in_element_pass(fmt, axis, shape=(256, 384)):
  """Opcodes of smaller-than-element shape (other than broadcasts, bitcasts,
  reshapes, constants, parameters) inside the fused computations whose root
  writes all [256, 384] fake-quantized values, in XLA's optimized CPU HLO."""
  spec = formats.QuantSpec(fmt)
  f = jax.jit(lambda v: formats.fake_quantize_unscaled(v, spec, axis)[0].astype(jnp.bfloat16))
  entry, comps = hlo_stats._computations(
      f.lower(jnp.zeros(shape, jnp.bfloat16)).compile().as_text())
  n = int(np.prod(shape))
  passes = [ops for name, ops in comps.items()
            if name != entry and any(" ROOT " in line and _elements(line) == n for _, line in ops)]
  assert passes, "no computation writes the quantized values"
  return [op for ops in passes for op, line in ops
          if op not in ("parameter", "constant", "bitcast", "broadcast", "reshape")
          and 1 < _elements(line) < n]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks XLA:CPU's fusion")
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("axis", [0, 1])
def test_block_scales_are_computed_once_per_block(fmt, axis):
  """Speed, not bits: the element pass reads each block's scale and inverse
  scale; the work from exponent (or amax) to scale stays outside it
  (formats.per_block), where XLA:CPU would otherwise redo it per element. The
  bit reinterpretation of the per-block result may remain inside, and with it
  (jax 0.12.1's XLA:CPU, NVFP4) the one compare and select that guard it."""
  assert set(_per_block_ops_in_element_pass(fmt, axis)) <= {"bitcast-convert", "compare", "select"}
