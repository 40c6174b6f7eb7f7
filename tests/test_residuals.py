"""Quantized residuals (Recipe.residuals="quantized"): the same bits, fewer bytes.

Bitwise against the default (residuals="original") on every backend: xla and
pallas here, native where jax >= 0.11 (CI's Python 3.12 run).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import backends, dot, recipes, residuals, sharding
from fp4jax.numerics import formats
from fp4jax.llama import model
from fp4jax.bench import memory

DENSE = (((2,), (0,)), ((), ()))
KEY = jax.random.key(5)
# MX FP4 with nearest and stochastic rounding, NVFP4 with 2D weights, SR, a
# fixed-sign H16 and a per-tensor factor, per-layer signs, MS-EDEN's randomly
# rounded scales (quartet2) and per-tensor FP8.
PRESETS = ["mxfp4-dh16", "mxfp4-sr", "nvfp4", "mxfp4-lh16", "quartet2", "fp8"]
NEW_JAX = backends.jax_version() >= backends.MIN_JAX["native"]


def _quantized(r, **changes):
  return dataclasses.replace(r, residuals="quantized", **changes)


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _assert_bitwise(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(_bits(g), _bits(w))


def _quantized_and_default(r, x, w, dy, dims):
  """((y, dx, dw) with residuals="quantized", (y, dx, dw) of `r`), both from one
  jitted program: one compile instead of two."""
  def y_and_grads(r, x, w, dy):
    y, vjp = jax.vjp(lambda x, w: dot.dot_general(r)(x, w, dims, key=KEY,
                                                     layer_key=jax.random.key(7)), x, w)
    return (y,) + vjp(dy)
  return jax.jit(lambda *args: (y_and_grads(_quantized(r), *args), y_and_grads(r, *args)))(
      x, w, dy)


def _normal(seed, shape, dtype):
  """Standard normal data from NumPy (nothing for JAX to compile per shape)."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


@pytest.mark.parametrize("name", PRESETS)
def test_dense_outputs_and_gradients_are_bitwise_the_default(name):
  r = recipes.recipe(name)
  x, w = _normal(0, (2, 32, 96), jnp.bfloat16), _normal(1, (96, 48), jnp.bfloat16)
  dy = _normal(2, (2, 32, 48), jnp.bfloat16)
  _assert_bitwise(*_quantized_and_default(r, x, w, dy, DENSE))


@pytest.mark.parametrize("backend", ["pallas"] + (["native"] if NEW_JAX else []))
@pytest.mark.parametrize("name", ["mxfp4-sr", "nvfp4"])
def test_other_backends_take_the_saved_operand_bitwise(name, backend):
  """The restored Wgrad lhs is the operand each backend's own quantize gives
  (native: jax >= 0.11 only, where it exists)."""
  r = dataclasses.replace(recipes.recipe(name), backend=backend)
  x, w = _normal(0, (2, 24, 96), jnp.float32), _normal(1, (96, 40), jnp.float32)
  dy = _normal(2, (2, 24, 40), jnp.float32)
  _assert_bitwise(*_quantized_and_default(r, x, w, dy, DENSE))


@pytest.mark.parametrize("name,dtype", [("mxfp4", jnp.float32), ("mxfp4-rh16", jnp.bfloat16)])
def test_odd_token_count_and_two_contraction_axes(name, dtype):
  """33 tokens (an odd packed length without rotation; padded to 48 with H16),
  and an `o`-style DenseGeneral contracting (heads, head_dim)."""
  r = recipes.recipe(name)
  x, w = _normal(0, (3, 11, 96), dtype), _normal(1, (96, 40), dtype)
  dy = _normal(2, (3, 11, 40), dtype)
  _assert_bitwise(*_quantized_and_default(r, x, w, dy, DENSE))
  dims = (((2, 3), (0, 1)), ((), ()))
  x, w = _normal(3, (2, 16, 4, 32), dtype), _normal(4, (4, 32, 64), dtype)
  dy = _normal(5, (2, 16, 64), dtype)
  _assert_bitwise(*_quantized_and_default(r, x, w, dy, dims))


def test_saved_bytes_are_packed_codes_and_scales():
  """The residuals of a quantized-residual linear: X as 0.5 + 1/32 bytes per
  element (<= 0.3x of bf16), the weight as the argument it is."""
  x = jax.ShapeDtypeStruct((4, 64, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
  r = recipes.recipe("mxfp4-dh16")
  counts = {n: memory.linear_residual_bytes(rr, x, w, DENSE)
            for n, rr in (("original", r), ("quantized", _quantized(r)))}
  assert counts["original"] == 4 * 64 * 256 * 2
  assert counts["quantized"] == 4 * 64 * 256 * (0.5 + 1 / 32)
  saved = residuals.save(jnp.ones((256, 66)), r.wgrad.lhs, 1)  # 66 codes padded to 96
  assert saved.values.shape == (256, 48) and saved.values.dtype == jnp.uint8
  assert saved.scales.shape == (256, 3) and saved.scales.dtype == jnp.float8_e8m0fnu


def test_restore_inverts_save_on_every_e2m1_code():
  """All 16 codes (both zeros, NaN-free), at each of the 32 positions of a block."""
  grid = jnp.asarray([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
  x = jnp.stack([jnp.roll(jnp.tile(grid, 4), i) for i in range(32)])  # [32, 64], amax 6
  spec = recipes.recipe("mxfp4").wgrad.lhs
  got = jax.jit(lambda x: residuals.restore(residuals.save(x, spec, 1)))(x)
  want = jax.jit(lambda x: formats.quantize(x, spec, 1))(x)
  np.testing.assert_array_equal(_bits(got.values), _bits(want.values.astype(jnp.float32)))
  np.testing.assert_array_equal(_bits(got.dequantize()), _bits(x))


def test_recipes_the_backward_cannot_take_saved_are_refused():
  with pytest.raises(ValueError, match="residuals='quantized' needs a quantized Wgrad lhs"):
    _quantized(recipes.recipe("bf16"))
  nvfp4 = recipes.recipe("nvfp4")
  tiled = dataclasses.replace(nvfp4.wgrad, lhs=dataclasses.replace(nvfp4.wgrad.lhs,
                                                                   block_2d=True))
  with pytest.raises(ValueError, match="quantizes wgrad.lhs in 2D tiles"):
    _quantized(nvfp4, wgrad=tiled)
  with pytest.raises(ValueError, match="QuEST's trust mask, which needs the original X"):
    _quantized(recipes.recipe("quartet"))
  cfg = recipes.recipe("mxfp4-dh16").to_config()
  cfg.residuals, cfg.wgrad.lhs.fmt = "quantized", "none"
  with pytest.raises(ValueError, match="leaves wgrad.lhs unquantized"):
    recipes.from_config(cfg)
  with pytest.raises(ValueError, match=r"residuals 'packed' not in \('original', 'quantized'\)"):
    dataclasses.replace(recipes.recipe("mxfp4"), residuals="packed")


def test_config_override_and_round_trip():
  cfg = recipes.config_template("mxfp4-dh16")
  cfg.residuals = "quantized"
  r = recipes.from_config(cfg)
  assert r.residuals == "quantized" and r.name == "mxfp4-dh16[residuals=quantized]"
  assert recipes.from_config(r.to_config()) == r
  assert recipes.from_config(recipes.config_template("mxfp4")).residuals == "original"


# ----------------------------------------------------------------- the model

MICRO = dict(vocab_size=64, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=96,
             dtype="bfloat16")


def _model_grads(cfg, r, tokens, mesh=None):
  m = model.Llama(cfg, r)
  params = nn.unbox(jax.jit(m.init)({"params": jax.random.key(0), "quant": KEY}, tokens)["params"])

  def loss(p, t):
    return m.apply({"params": p}, t, rngs={"quant": KEY}).astype(jnp.float32).var()

  grad = jax.jit(jax.grad(loss))
  if mesh is None:
    return grad(params, tokens)
  with sharding.use_mesh(mesh):
    return grad(params, jax.device_put(tokens, sharding.batch_sharding(mesh)))


def test_llama_gradients_under_scan_remat_and_a_two_device_mesh():
  """nn.scan, full remat (the forward saves again in the backward) and two devices."""
  mesh = sharding.make_mesh(sharding.mesh_config(), jax.devices()[:2])
  cfg = model.model_config("tiny", **MICRO, scan_layers=True, remat="full")
  tokens = jax.random.randint(jax.random.key(1), (4, 32), 0, 64)
  r = recipes.recipe("mxfp4-dh16")
  _assert_bitwise(_model_grads(cfg, _quantized(r), tokens, mesh),
                  _model_grads(cfg, r, tokens, mesh))
