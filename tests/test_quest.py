"""QuEST (Quartet's forward) against a NumPy reference written from the papers'
description: RMS-based E8M0 scale with clipping after H32, and the trust mask
that zeroes the gradient of clipped elements."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import dot, recipes
from fp4jax.numerics import formats
from fp4jax.numerics import hadamard
from fp4jax.numerics import quest
from fp4jax.recipes import Gemm, Hadamard, Recipe
from tests import numpy_reference as ref

QUEST = formats.QuantSpec("mxfp4", block_scale="quest")
ALPHA = 2.92247856  # Quartet's Gaussian clipping level for E2M1, in RMS units
_fq = jax.jit(formats.fake_quantize, static_argnums=(1, 2))
_mask = jax.jit(formats.clip_mask, static_argnums=(1, 2))


def _student_t(shape, seed, df=3):
  rng = np.random.default_rng(seed)
  return (rng.standard_t(df, shape) * 2.0**rng.integers(-6, 6)).astype(np.float32)


def reference_quest(x, axis):
  """(dequantized float32, unclipped bool) of QuEST-MXFP4 along `axis` of x:
  per 32 slots (zero padded) s = 2^floor(log2(alpha * rms / 6)), q = nearest
  E2M1 of x / s saturating at 6; unclipped where |x| <= 6 s."""
  xm = np.moveaxis(x, axis, -1).astype(np.float64)
  n = xm.shape[-1]
  xp = np.pad(xm, [(0, 0)] * (xm.ndim - 1) + [(0, -n % 32)])
  xb = xp.reshape(xp.shape[:-1] + (-1, 32))
  rms = np.sqrt(np.mean(xb**2, axis=-1, keepdims=True))
  with np.errstate(divide="ignore"):
    e = np.where(rms > 0, np.floor(np.log2(rms * ALPHA / 6)), -127)
  s = np.ldexp(1.0, np.clip(e, -127, 127).astype(int))
  y = ref.round_nearest(xb / s, "e2m1") * s
  ok = np.abs(xb) <= 6 * s
  back = lambda a: np.moveaxis(a.reshape(xp.shape)[..., :n], -1, axis)
  return back(y).astype(np.float32), back(ok)


@pytest.mark.parametrize("shape,axis", [((7, 100), -1), ((45, 3), 0), ((2, 5, 70), 2)])
def test_quest_quantizer_and_mask_match_the_reference(shape, axis):
  x = _student_t(shape, seed=sum(shape))
  x[0, :3] = 0.0
  want, ok = reference_quest(x, axis)
  np.testing.assert_array_equal(np.asarray(_fq(jnp.asarray(x), QUEST, axis)), want)
  np.testing.assert_array_equal(np.asarray(_mask(jnp.asarray(x), QUEST, axis)), ok)
  assert 0 < (~ok).sum() < ok.size  # heavy tails: some elements are clipped, most not


def test_gaussian_clip_is_mse_optimal_for_e2m1():
  """The clipping level minimises the E2M1 MSE of unit Gaussian data (continuous
  scale c/6); integrated on a fine grid, the optimum is within 1%."""
  z = np.linspace(-12, 12, 240001)
  pdf = np.exp(-z**2 / 2) / np.sqrt(2 * np.pi)
  def mse(c):
    s = c / 6
    return np.sum((z - ref.round_nearest(z / s, "e2m1") * s)**2 * pdf) * (z[1] - z[0])
  grid = np.linspace(2.5, 3.4, 91)
  best = grid[np.argmin([mse(c) for c in grid])]
  assert abs(best - quest.GAUSSIAN_CLIP) / quest.GAUSSIAN_CLIP < 0.01, best


def _rotation(k):
  """Block-diagonal H32 [Kp, Kp] (no signs) for a length-k axis padded to 32s."""
  kp = -(-k // 32) * 32
  return np.kron(np.eye(kp // 32), np.asarray(hadamard.hadamard_matrix(32), np.float64)), kp


def test_trust_mask_zeroes_the_gradient_of_clipped_elements():
  """Fprop QuEST on both operands (H32), backward unquantized: dX and dW are the
  exact gradients masked in the rotated domain, P^T (mask * P g)."""
  m, k, n = 12, 50, 9  # K pads to 64
  x, w, dy = _student_t((m, k), 1), _student_t((k, n), 2), _student_t((m, n), 3)
  r = Recipe("quest-fwd", fprop=Gemm(QUEST, QUEST, Hadamard(32)), compute_dtype="float32")
  fn = dot.dot_general(r)
  y, vjp = jax.vjp(jax.jit(lambda a, b: fn(a, b, (((1,), (0,)), ((), ())))),
                   jnp.asarray(x), jnp.asarray(w))
  dx, dw = vjp(jnp.asarray(dy))

  rot, kp = _rotation(k)
  xr = np.pad(x.astype(np.float64), ((0, 0), (0, kp - k))) @ rot
  wr = rot.T @ np.pad(w.astype(np.float64), ((0, kp - k), (0, 0)))
  xq, x_ok = reference_quest(xr.astype(np.float32), 1)
  wq, w_ok = reference_quest(wr.astype(np.float32), 0)
  assert (~x_ok).any() and (~w_ok).any()
  close = lambda got, want: np.testing.assert_allclose(
      np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  close(y, xq.astype(np.float64) @ wq)
  dx_raw = np.pad(dy.astype(np.float64) @ w.T.astype(np.float64), ((0, 0), (0, kp - k)))
  close(dx, ((dx_raw @ rot) * x_ok @ rot.T)[:, :k])
  dw_raw = np.pad(x.T.astype(np.float64) @ dy.astype(np.float64), ((0, kp - k), (0, 0)))
  close(dw, (rot @ ((rot.T @ dw_raw) * w_ok))[:k])
  # Without the mask the gradients differ: the test sees it.
  assert np.abs(np.asarray(dx) - dy @ w.T).max() > 1e-3 * np.abs(dy @ w.T).max()


def test_quartet_preset():
  q = recipes.recipe("quartet")
  assert q.fprop == Gemm(QUEST, QUEST, Hadamard(32))
  bwd = formats.QuantSpec("mxfp4", rounding="stochastic_dither")
  assert q.dgrad == q.wgrad == Gemm(bwd, bwd, Hadamard(32, "per-step"))


@pytest.mark.parametrize("kwargs", [dict(fmt="nvfp4"), dict(fmt="mxfp4", rounding="stochastic"),
                                    dict(fmt="mxfp4", scale_mode="even")])
def test_quest_needs_mxfp4_nearest_floor(kwargs):
  with pytest.raises(ValueError, match="block_scale='quest'"):
    formats.QuantSpec(block_scale="quest", **kwargs)
  with pytest.raises(ValueError, match="block_scale"):
    formats.QuantSpec("mxfp4", block_scale="rms")


def test_recipe_wide_scale_mode_leaves_quest_alone():
  cfg = recipes.config_template("quartet")
  cfg.scale_mode = "even"
  r = recipes.from_config(cfg)
  assert r.fprop.lhs == QUEST and r.dgrad.lhs.scale_mode == "even"
  assert r.name == "quartet[scale_mode=even]"
