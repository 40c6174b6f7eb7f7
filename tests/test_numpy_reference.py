"""fp4jax.numerics.formats against the independent NumPy reference, bit for bit."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.numerics import formats
from tests import numpy_reference as ref
from tests.helpers import row_scaled_normal

SHAPES_AXES = [((8, 64), -1), ((64, 24), 0), ((3, 40, 5), 1), ((2, 6, 48), 2),
               ((100,), 0), ((5, 33), -1)]


def _cases():
  """(fmt, scale_mode) pairs, each with a shape, axis and dtype from a cycle."""
  cases = []
  for fmt in formats.FORMATS:
    modes = formats.SCALE_MODES if fmt.startswith("mx") else ("floor",)
    for mode in modes:
      i = len(cases)
      shape, axis = SHAPES_AXES[i % len(SHAPES_AXES)]
      dtype = (jnp.float32, jnp.bfloat16)[(i // 3) % 2]
      cases.append((fmt, mode, shape, axis, dtype))
  return cases


def _blocked_shape(shape, axis, block):
  if block is None:
    return shape
  axis %= len(shape)
  nb = -(-shape[axis] // block)
  return shape[:axis] + (nb, block) + shape[axis + 1:]


@pytest.mark.parametrize("fmt,mode,shape,axis,dtype", _cases())
def test_matches_reference(fmt, mode, shape, axis, dtype):
  """All three roundings of one (format, scale mode): values, scales,
  global scale and fake_quantize output equal the reference exactly."""
  specs = [formats.QuantSpec(fmt, scale_mode=mode, rounding=r)
           for r in formats.ROUNDINGS]
  # A seed fixed per case (Python's hash() of strings changes with every process).
  x = jnp.asarray(row_scaled_normal(shape, zlib.crc32(f"{fmt} {mode}".encode())), dtype)
  key = jax.random.key(7)
  bits_shape = _blocked_shape(shape, axis, specs[0].block)

  @jax.jit
  def run(x):
    return [(formats.quantize(x, s, axis, key),
             formats.fake_quantize(x, s, axis, key)) for s in specs
           ], jax.random.bits(key, bits_shape, jnp.uint32)

  results, bits = run(x)
  for spec, (q, y) in zip(specs, results):
    want = ref.quantize(np.asarray(x), fmt, None, mode, spec.rounding, axis,
                        np.asarray(bits))
    np.testing.assert_array_equal(np.asarray(y, np.float32),
                                  np.asarray(want["y"], np.float32))
    np.testing.assert_array_equal(np.asarray(q.values, np.float64), want["q"])
    if spec.family == "mx":
      got_scale = np.asarray(
          jax.lax.bitcast_convert_type(q.scales, jnp.uint8), np.int64) - 127
    else:
      got_scale = np.asarray(q.scales, np.float32)
    np.testing.assert_array_equal(got_scale, want["scale"])
    if want["global_scale"] is None:
      assert q.global_scale is None
    else:
      assert np.float32(q.global_scale) == want["global_scale"]


# NVFP4 left out: XLA computes its elements as x * (1 / d) where the reference
# divides, one float32 ulp apart at times (x = 22057.395, d = 448 * 8.205876:
# 6.0 against 5.9999995), which a biased SR rounds differently.
@pytest.mark.parametrize("fmt", [f for f in formats.FORMATS if f != "nvfp4"])
def test_few_bit_and_biased_sr_match_reference(fmt):
  """Stochastic rounding with 8 and 16 random bits and with its round-up
  probability scaled (0.5, 0.3), alone and together: elements equal the
  reference's sign-magnitude rule exactly."""
  variants = [dict(sr_bits=8), dict(sr_bits=16), dict(sr_round_up_scale=0.5),
              dict(sr_round_up_scale=0.3), dict(sr_bits=8, sr_round_up_scale=0.5)]
  specs = [formats.QuantSpec(fmt, rounding="stochastic", **v) for v in variants]
  shape, axis = (6, 64), -1
  x = jnp.asarray(row_scaled_normal(shape, 5))
  key = jax.random.key(3)
  q = jax.jit(lambda x: [formats.quantize(x, s, axis, key).values for s in specs])(x)
  bits = np.asarray(jax.random.bits(key, _blocked_shape(shape, axis, specs[0].block),
                                    jnp.uint32))
  for v, got in zip(variants, q):
    want = ref.quantize(np.asarray(x), fmt, None, "floor", "stochastic", axis, bits, **v)
    np.testing.assert_array_equal(np.asarray(got, np.float64), want["q"], err_msg=str(v))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_e5m2"])
def test_special_blocks_match_reference(fmt):
  """NaN, Inf, zero and tiny blocks next to ordinary ones."""
  x = row_scaled_normal((4, 64), 3)
  x[0, 3] = np.nan
  x[1, 40] = -np.inf
  x[2, :32] = 0.0
  x[3, :16] *= 2.0**-100
  spec = formats.QuantSpec(fmt, block_size=32 if fmt == "fp8_e5m2" else None)
  want = ref.quantize(x, fmt, spec.block_size, axis=-1)
  y = jax.jit(formats.fake_quantize, static_argnums=1)(jnp.asarray(x), spec)
  np.testing.assert_array_equal(np.asarray(y), want["y"])
