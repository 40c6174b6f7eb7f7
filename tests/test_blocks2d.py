"""2D (square-tile) block scaling: transpose symmetry, a tile-by-tile NumPy
reference on padded shapes and heavy-tailed data, and the dot_general hook."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import dot, recipes
from fp4jax.numerics import blocks2d
from fp4jax.numerics import formats
from fp4jax.numerics import hadamard
from tests import numpy_reference as ref

F32 = np.float32
# Eager dispatch of the quantizer's many small ops is slow on CPU: jit them.
_fq = jax.jit(formats.fake_quantize, static_argnums=(1, 2))
_qt = jax.jit(blocks2d.quantize_tiles, static_argnums=(1,))
_dq = jax.jit(blocks2d.dequantize_tiles)


def _student_t(shape, seed, df=3):
  rng = np.random.default_rng(seed)
  x = rng.standard_t(df, shape) * 2.0**rng.integers(-8, 8)
  x[rng.random(shape) < 0.03] = 0.0
  return x.astype(F32)


def reference_tiles(x, fmt, scale_mode="floor"):
  """Tile-by-tile quantize + dequantize of the matrix x [R, C], written from the
  definition: each t x t tile (t the format's block) shares one scale set from
  its own amax; NVFP4's tensor scale is amax(x) / 2688. float32 result."""
  family, elem, t = ref.FORMAT_PARAMS[fmt]
  vmax = ref.ELEMENT_PARAMS[elem][3]
  g = None
  if family == "nvfp4":
    g = F32(np.max(np.abs(x)) * F32(1 / 2688.0))
    g = g if g > 0 else F32(1.0)
  y = np.zeros_like(x, F32)
  for i in range(0, x.shape[0], t):
    for j in range(0, x.shape[1], t):
      tile = x[i:i + t, j:j + t].astype(F32)
      amax = F32(np.max(np.abs(tile)))
      if family == "mx":
        s = np.ldexp(1.0, ref.shared_exponent(float(amax), elem, scale_mode))
        q = ref.round_nearest(tile.astype(np.float64) / s, elem)
        y[i:i + t, j:j + t] = (q * s).astype(F32)
      else:
        s = F32(ref.round_nearest(np.float64((amax * F32(1 / vmax)) / g), "e4m3"))
        d = F32(s * g)
        v = (tile / d).astype(F32) if d != 0 else np.zeros_like(tile)
        q = ref.round_nearest(v.astype(np.float64), elem)
        y[i:i + t, j:j + t] = ((q * s).astype(F32) * g).astype(F32)
  return y


CASES = [("nvfp4", "floor", (37, 50)), ("mxfp4", "floor", (45, 70)),
         ("mxfp4", "even", (64, 33)), ("mxfp8_e4m3", "rceil", (31, 96))]


@pytest.mark.parametrize("fmt,mode,shape", CASES)
def test_matches_tile_reference_on_padded_heavy_tailed_data(fmt, mode, shape):
  x = _student_t(shape, seed=shape[0])
  kw = dict(scale_mode=mode) if fmt.startswith("mx") else {}
  spec = formats.QuantSpec(fmt, block_2d=True, **kw)
  want = reference_tiles(x, fmt, mode)
  got = np.asarray(_fq(jnp.asarray(x), spec, 0))
  np.testing.assert_array_equal(got, want)
  tiled = _qt(jnp.asarray(x), spec)
  np.testing.assert_array_equal(np.asarray(_dq(tiled)), want)
  t = spec.block
  assert tiled.scales.shape == (-(-shape[0] // t), -(-shape[1] // t))


@pytest.mark.parametrize("fmt,mode,shape", CASES)
def test_quantize_of_transpose_is_transpose_of_quantize(fmt, mode, shape):
  x = jnp.asarray(_student_t(shape, seed=7))
  kw = dict(scale_mode=mode) if fmt.startswith("mx") else {}
  spec = formats.QuantSpec(fmt, block_2d=True, **kw)
  a, b = _qt(x, spec), _qt(x.T, spec)
  bits = lambda v: np.asarray(v).view(np.uint8)
  np.testing.assert_array_equal(bits(a.values).T, bits(b.values))
  np.testing.assert_array_equal(bits(a.scales).T, bits(b.scales))
  np.testing.assert_array_equal(np.asarray(a.global_scale), np.asarray(b.global_scale))
  # Along either axis of the same weight (Fprop: K, Dgrad: N): the same numbers.
  np.testing.assert_array_equal(np.asarray(_fq(x, spec, 0)),
                                np.asarray(_fq(x, spec, 1)))


def test_rank3_flattens_the_other_axes_in_order():
  x = jnp.asarray(_student_t((40, 3, 24), seed=3))
  spec = formats.QuantSpec("nvfp4", block_2d=True)
  got = _fq(x, spec, 0)
  want = reference_tiles(np.asarray(x).reshape(40, 72), "nvfp4").reshape(40, 3, 24)
  np.testing.assert_array_equal(np.asarray(got), want)
  # Dgrad's view: the (3, 24) axes flattened into one contraction axis.
  got_t = _fq(x.reshape(40, 72), spec, 1)
  np.testing.assert_array_equal(np.asarray(got_t).reshape(40, 3, 24), want)


def test_fprop_and_dgrad_use_the_same_quantized_weight():
  w = jnp.asarray(_student_t((48, 40), seed=11))
  x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 48)), jnp.float32)
  dy = jnp.asarray(np.random.default_rng(2).standard_normal((5, 40)), jnp.float32)
  spec = formats.QuantSpec("nvfp4", block_2d=True)
  rec = recipes.Recipe("w2d", fprop=recipes.Gemm(None, spec), dgrad=recipes.Gemm(None, spec),
                       compute_dtype="float32")
  fn = dot.dot_general(rec)
  y, vjp = jax.vjp(jax.jit(lambda a: fn(a, w, (((1,), (0,)), ((), ())))), x)
  wq = jnp.asarray(reference_tiles(np.asarray(w), "nvfp4"))
  hi = jax.lax.Precision.HIGHEST
  np.testing.assert_allclose(np.asarray(y), np.asarray(jnp.dot(x, wq, precision=hi)),
                             rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(y))))
  (dx,) = vjp(dy)
  np.testing.assert_allclose(np.asarray(dx), np.asarray(jnp.dot(dy, wq.T, precision=hi)),
                             rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(dx))))


def test_config_round_trip_and_errors():
  spec = formats.QuantSpec("mxfp4", scale_mode="even", block_2d=True)
  cfg = recipes.config_template("mxfp4")
  cfg.fprop.rhs.block_2d = True
  rec = recipes.from_config(cfg)
  assert rec.fprop.rhs == spec and rec.name == "mxfp4[fprop.rhs.block_2d=True]"
  assert recipes.from_config(rec.to_config()) == rec
  with pytest.raises(ValueError, match="block_2d=True needs a blocked format"):
    formats.QuantSpec("fp8_e4m3", block_2d=True)
  with pytest.raises(TypeError, match="block_2d must be a bool"):
    formats.QuantSpec("mxfp4", block_2d=1)
  with pytest.raises(ValueError, match="blocks2d.quantize_tiles"):
    formats.quantize(jnp.zeros((4, 4)), spec)
  with pytest.raises(ValueError, match="takes a matrix"):
    blocks2d.quantize_tiles(jnp.zeros((2, 3, 4)), spec)


def test_nvfp4_preset_against_reference_on_padded_heavy_tailed_shapes():
  """NVIDIA's recipe (arXiv 2509.25149) by hand: X 1x16 nearest, W in 16x16 tiles
  (the same numbers in Fprop and Dgrad), dY 1x16 with stochastic rounding, and
  a fixed-sign H16 on both Wgrad operands along the M token axis."""
  m, k, n = 40, 50, 37  # every axis pads: 16-blocks, 16x16 tiles, H16 on M
  x, w, dy = (_student_t(s, seed=i) for i, s in enumerate([(m, k), (k, n), (m, n)]))
  key = jax.random.key(5)
  r = recipes.recipe("nvfp4")
  fn = dot.dot_general(r)
  y, vjp = jax.vjp(jax.jit(lambda a, b: fn(a, b, (((1,), (0,)), ((), ())), key=key)),
                   jnp.asarray(x), jnp.asarray(w))
  dx, dw = vjp(jnp.asarray(dy))

  wq = reference_tiles(w, "nvfp4")
  xq = ref.quantize(x, "nvfp4", axis=1)["y"]
  role = lambda i: jax.random.fold_in(key, i)  # documented in fp4jax.dot
  nb = -(-n // 16)
  bits = np.asarray(jax.random.bits(jax.random.fold_in(role(1), 0), (m, nb, 16), jnp.uint32))
  dyq = ref.quantize(dy, "nvfp4", rounding="stochastic", axis=1, bits=bits)["y"]
  f64 = lambda a: np.asarray(a, np.float64)
  _close64 = lambda got, want: np.testing.assert_allclose(
      f64(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  _close64(y, f64(xq) @ f64(wq))
  _close64(dx, f64(dyq) @ f64(wq).T)

  # Wgrad: rotate X^T [K, M] and dY [M, N] along M (padded to 48) with the fixed signs.
  mp = -(-m // 16) * 16
  h = np.asarray(hadamard.hadamard_matrix(16), np.float64)
  signs = np.asarray(hadamard.random_signs(jax.random.key(0), 16), np.float64)
  rot = np.kron(np.eye(mp // 16), signs[:, None] * h)  # [Mp, Mp] block diagonal
  xt = (np.pad(x.T, ((0, 0), (0, mp - m))) @ rot).astype(F32)
  dyr = (rot.T @ np.pad(dy, ((0, mp - m), (0, 0)))).astype(F32)
  xtq = ref.quantize(xt, "nvfp4", axis=1)["y"]
  bits = np.asarray(jax.random.bits(jax.random.fold_in(role(2), 1), (mp // 16, 16, n),
                                    jnp.uint32))
  dyrq = ref.quantize(dyr, "nvfp4", rounding="stochastic", axis=0, bits=bits)["y"]
  np.testing.assert_allclose(f64(dw), f64(xtq) @ f64(dyrq), rtol=1e-4,
                             atol=1e-4 * np.abs(f64(xtq) @ f64(dyrq)).max())
