"""Four over Six (NVFP4 blocks scaled to a max of 6 or 4) against a NumPy
reference written from arXiv 2512.02010's description."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.numerics import formats
from tests import numpy_reference as ref

F32 = np.float32
_fq = jax.jit(formats.fake_quantize, static_argnums=(1, 2))
_q = jax.jit(formats.quantize, static_argnums=(1, 2))


def _student_t(shape, seed, df=3):
  rng = np.random.default_rng(seed)
  x = (rng.standard_t(df, shape) * 2.0**rng.integers(-6, 6)).astype(F32)
  x.reshape(-1)[:16] = 0.0  # an all-zero block
  return x


def reference_four_over_six(x, axis, bits=None, peaks=(6.0, 4.0)):
  """(dequantized float32, chose_four bool per block) along `axis`: tensor scale
  g = amax / 1536; per 16-block both E4M3 scales (amax/6)/g and (amax/4)/g, the
  elements rounded under each, and the one with the smaller squared error."""
  xm = np.moveaxis(x, axis, -1).astype(F32)
  n = xm.shape[-1]
  xp = np.pad(xm, [(0, 0)] * (xm.ndim - 1) + [(0, -n % 16)])
  xb = xp.reshape(xp.shape[:-1] + (-1, 16))
  amax = np.max(np.abs(xb), axis=-1, keepdims=True)
  g = F32(np.max(amax) * F32(1 / 1536.0))
  g = g if g > 0 else F32(1.0)
  ys, errs = [], []
  for peak in peaks:
    s = ref.round_nearest(((amax * F32(1 / peak)).astype(F32) / g).astype(np.float64),
                          "e4m3").astype(F32)
    d = (s * g).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
      v = np.where(d == 0, 0, xb / d).astype(F32).astype(np.float64)
    q = ref.round_nearest(v, "e2m1") if bits is None else ref.round_stochastic(
        v, "e2m1", bits.reshape(v.shape))
    y = ((q * s).astype(F32) * g).astype(F32)
    ys.append(y)
    errs.append(np.sum((y.astype(np.float64) - xb)**2, axis=-1, keepdims=True))
  four = errs[-1] < errs[0]
  y = np.where(four, ys[-1], ys[0])
  back = np.moveaxis(y.reshape(xp.shape)[..., :n], -1, axis)
  return back, four[..., 0]


SPEC = formats.QuantSpec("nvfp4", block_scale="four_over_six")


@pytest.mark.parametrize("shape,axis", [((9, 100), -1), ((37, 5), 0), ((3, 4, 30), 1)])
def test_matches_the_reference_on_padded_heavy_tailed_data(shape, axis):
  x = _student_t(shape, seed=sum(shape))
  want, four = reference_four_over_six(x, axis)
  np.testing.assert_array_equal(np.asarray(_fq(jnp.asarray(x), SPEC, axis)), want)
  q = _q(jnp.asarray(x), SPEC, axis)
  np.testing.assert_array_equal(np.asarray(q.dequantize()), want)
  assert four.any() and not four.all()  # both candidates occur
  assert float(jnp.max(q.scales.astype(jnp.float32))) <= 384.0


def test_stochastic_rounding_uses_one_draw_for_both_candidates():
  x = _student_t((6, 64), seed=3)
  spec = formats.QuantSpec("nvfp4", rounding="stochastic", block_scale="four_over_six")
  key = jax.random.key(1)
  bits = np.asarray(jax.random.bits(key, (6, 4, 16), jnp.uint32))
  want, _ = reference_four_over_six(x, -1, bits)
  got = jax.jit(formats.fake_quantize, static_argnums=(1, 2))(jnp.asarray(x), spec, -1, key)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_error_is_never_above_scaling_every_block_to_six():
  """Per block, the choice can only lower the error of the 6-candidate."""
  x = _student_t((64, 256), seed=5)
  err = lambda y: ((np.asarray(y, np.float64) - x)**2).reshape(64, 16, 16).sum(-1)
  e46 = err(_fq(jnp.asarray(x), SPEC, -1))
  e6 = err(reference_four_over_six(x, -1, peaks=(6.0,))[0])
  assert (e46 <= e6).all() and (e46 < e6).any()


@pytest.mark.parametrize("kwargs", [dict(fmt="mxfp4"), dict(fmt="nvfp4", rounding="stochastic_dither")])
def test_needs_nvfp4(kwargs):
  with pytest.raises(ValueError, match="block_scale='four_over_six'"):
    formats.QuantSpec(block_scale="four_over_six", **kwargs)
