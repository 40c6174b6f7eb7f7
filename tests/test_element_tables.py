"""Exhaustive element tables, enumerated from ml_dtypes' bit patterns.

For every element format: each representable value rounds to itself (alone
and inside a quantized block with scale 1), each midpoint between neighbours
rounds to the neighbour with the even code, and values beyond max saturate.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp4jax.numerics import formats

# MX format -> (ml_dtypes type, number of codes)
TABLES = {
    "mxfp4": (ml_dtypes.float4_e2m1fn, 16),
    "mxfp6_e2m3": (ml_dtypes.float6_e2m3fn, 64),
    "mxfp6_e3m2": (ml_dtypes.float6_e3m2fn, 64),
    "mxfp8_e4m3": (ml_dtypes.float8_e4m3fn, 256),
    "mxfp8_e5m2": (ml_dtypes.float8_e5m2, 256),
}


def _table(fmt):
  """(values, codes) of all finite non-negative values, ascending."""
  dtype, n = TABLES[fmt]
  codes = np.arange(n, dtype=np.uint8)
  values = codes.view(dtype).astype(np.float64)
  keep = np.isfinite(values) & (np.signbit(values) == 0)
  order = np.argsort(values[keep])
  return values[keep][order], codes[keep][order]


_round = jax.jit(formats.round_to_element, static_argnums=1)


@pytest.mark.parametrize("fmt", TABLES)
def test_round_trip_every_value(fmt):
  values, _ = _table(fmt)
  spec = formats.QuantSpec(fmt)
  both = np.concatenate([values, -values]).astype(np.float32)
  got = np.asarray(_round(jnp.asarray(both), spec))
  np.testing.assert_array_equal(got, both)
  assert values[-1] == spec.element_max


@pytest.mark.parametrize("fmt", TABLES)
def test_round_trip_through_quantize(fmt):
  """A block holding every value (max included, so the scale is 1 for every
  scale mode but ceil) dequantizes to itself; values cast exactly."""
  values, _ = _table(fmt)
  x = jnp.asarray(np.concatenate([values, -values]).astype(np.float32))
  for mode in ("floor", "even", "rceil"):
    spec = formats.QuantSpec(fmt, block_size=x.size, scale_mode=mode)
    q = formats.quantize(x, spec)
    assert int(q.scales.view(jnp.uint8)[0]) == 127
    np.testing.assert_array_equal(np.asarray(q.values, np.float32), x)
    np.testing.assert_array_equal(q.dequantize(), x)


@pytest.mark.parametrize("fmt", TABLES)
def test_midpoints_round_to_even(fmt):
  values, codes = _table(fmt)
  mid = (values[:-1] + values[1:]) / 2
  even = np.where(codes[:-1] % 2 == 0, values[:-1], values[1:])
  spec = formats.QuantSpec(fmt)
  got = np.asarray(_round(jnp.asarray(np.concatenate([mid, -mid]),
                                      jnp.float32), spec))
  np.testing.assert_array_equal(got, np.concatenate([even, -even]))
  # Just off the midpoint, the nearer neighbour wins.
  for sign in (1, -1):
    off = (mid + sign * (values[1:] - values[:-1]) / 8).astype(np.float32)
    got = np.asarray(_round(jnp.asarray(off), spec))
    np.testing.assert_array_equal(got, values[1:] if sign > 0 else
                                  values[:-1])


@pytest.mark.parametrize("fmt", TABLES)
def test_beyond_max_saturates(fmt):
  vmax = formats.QuantSpec(fmt).element_max
  big = np.array([vmax * 1.01, vmax * 1.125, vmax * 1.5, vmax * 2, 1e30,
                  np.finfo(np.float32).max, np.inf], np.float32)
  got = np.asarray(_round(jnp.asarray(np.concatenate([big, -big])),
                          formats.QuantSpec(fmt)))
  np.testing.assert_array_equal(got, np.repeat([vmax, -vmax], big.size))
  assert np.isnan(np.asarray(_round(jnp.float32(np.nan),
                                    formats.QuantSpec(fmt))))


def test_round_half_even_forms_match_jnp_round():
  """The Triton-friendly floor-and-compare rounding (Pallas kernels) and the
  lax.round one (XLA paths) equal jnp.round bit for bit: ties, near-ties,
  integers up to 2^23, huge values, signed zeros, subnormals, Inf and NaN."""
  from fp4jax.numerics import elements
  ties = np.arange(-8192, 8193, dtype=np.float32) / 2
  big = np.float32(2.0**23) - np.arange(4, dtype=np.float32)
  rng = np.random.default_rng(0)
  t = np.concatenate([ties, np.nextafter(ties, np.float32(np.inf)),
                      np.nextafter(ties, np.float32(-np.inf)), big, -big,
                      rng.uniform(-70, 70, 20000).astype(np.float32),
                      np.array([-0.0, 0.0, -0.3, 3e38, -3e38, np.inf, -np.inf, np.nan,
                                1e-40, -1e-40], np.float32)])
  want = np.asarray(jnp.round(jnp.asarray(t)))
  for form in (elements.round_half_even_by_floor, elements.round_half_even):
    got = np.asarray(jax.jit(form)(jnp.asarray(t)))
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)],
                                  want.view(np.uint32)[~np.isnan(want)])
    assert np.isnan(got[np.isnan(want)]).all()
