"""The quantized dot_general against references written out from fake_quantize and rotate."""

import dataclasses
import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import dot, recipes
from fp4jax.numerics import blocks2d
from fp4jax.numerics import formats
from fp4jax.numerics import hadamard
from fp4jax.recipes import Gemm, Hadamard, Recipe

DENSE = (((2,), (0,)), ((), ()))  # x[B, L, K] . w[K, N]
KEY = jax.random.key(7)
LAYER_KEY = jax.random.key(11)


@functools.lru_cache(maxsize=None)
def _normal_draw(seed, dtype):
  return np.asarray(jax.random.normal(jax.random.key(seed), (2**17,), dtype))


def _normal(seed, shape, dtype=jnp.float32):
  """jax.random.normal(key(seed), shape, dtype), cut from one longer draw per
  seed and dtype: with partitionable threefry (jax's default) an element does
  not depend on the draw's length, and one program serves every shape."""
  return jnp.asarray(_normal_draw(seed, jnp.dtype(dtype))[:math.prod(shape)].reshape(shape))


def _vjp_fn(dg, dims=DENSE):
  """jit of (x, w, dy, key, layer_key) -> (y, dx, dw): dg(x, w) and its vjp with dy."""
  def f(x, w, dy, key, layer_key=None):
    y, vjp = jax.vjp(lambda a, b: dg(a, b, dims, key=key, layer_key=layer_key), x, w)
    return (y,) + vjp(dy)
  return jax.jit(f)


def _vjp(dg, x, w, dy, dims=DENSE, key=KEY, layer_key=LAYER_KEY):
  return _vjp_fn(dg, dims)(x, w, dy, key, layer_key)


@functools.lru_cache(maxsize=None)
def _recipe_vjp_fn(r):
  """_vjp_fn of dot_general(r) on DENSE, one per recipe: the tests that run a
  recipe on _dense_operands' shapes share its compiled program."""
  return _vjp_fn(dot.dot_general(r))


@functools.lru_cache(maxsize=None)
def _reference_fn(r):
  """jit of _reference(r, x, w, dy, key), one per recipe."""
  return jax.jit(functools.partial(_reference, r))


def _dense_operands(sample):
  """x [B=2, L=32, K=96], w [K, N=48], dy [B, L, N], each sample(seed, shape)."""
  return sample(0, (2, 32, 96)), sample(1, (96, 48)), sample(2, (2, 32, 48))


def _close(got, want):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# ------------------------------------------------------------- the reference

def _q(a, spec, h, signs, axis, key, cdt):
  """What the documentation says an operand becomes: (pad,) rotate, quantize, cast.

  Returns (values, factor): the float32 per-tensor factor (NVFP4 global scale,
  dither's 4/3) is left for the GEMM's output; per-tensor FP8 keeps its scale
  in float32 values.
  """
  if h is not None:
    pad = -a.shape[axis] % h.block
    a = jnp.pad(a, [(0, pad if d == axis else 0) for d in range(a.ndim)])
    a = hadamard.rotate(a, h.block, axis, signs)
  if spec is None:
    return a.astype(cdt), None
  if spec.family == "fp8":
    return formats.quantize(a, spec, axis, key).dequantize(a.dtype).astype(jnp.float32), None
  if spec.block_2d:  # the square tiles of a matrix: quantize [axis, other] as tiles
    a2 = jnp.moveaxis(a, axis, 0)
    q = blocks2d.quantize_tiles(a2, spec, key)
    values = blocks2d.dequantize_tiles(dataclasses.replace(q, global_scale=None))
    return jnp.moveaxis(values, 0, axis).astype(cdt), q.global_scale
  q = formats.quantize(a, spec, axis, key)
  return dataclasses.replace(q, global_scale=None).dequantize().astype(cdt), q.global_scale


def _role_keys(gemm, key, layer_key, role):
  """fold_in(key, role) -> (lhs key, rhs key, signs) as documented in fp4jax.dot
  (per-layer signs from fold_in(layer_key, role))."""
  k = jax.random.fold_in(key, role)
  h = gemm.hadamard
  signs = None
  if h is not None and h.signs == "fixed":
    signs = hadamard.random_signs(jax.random.key(h.seed), h.block)
  elif h is not None and h.signs == "per-step":
    signs = hadamard.random_signs(jax.random.fold_in(k, 2), h.block)
  elif h is not None and h.signs == "per-layer":
    signs = hadamard.random_signs(jax.random.fold_in(layer_key, role), h.block)
  return jax.random.fold_in(k, 0), jax.random.fold_in(k, 1), signs


def _reference(r: Recipe, x_MxK, w_KxN, dy_MxN, key, layer_key=LAYER_KEY):
  """(y, dx, dw) of a Dense layer by hand: fprop contracts K, dgrad N, wgrad M.

  As documented, each GEMM's lhs is quantized with its contraction axis last
  (X^T for wgrad); the rhs in its own layout.
  """
  def gemm(role_idx, g, a_FxC, b, b_axis):
    dims = (((1,), (b_axis,)), ((), ()))
    if g.is_plain:
      return lax.dot_general(a_FxC, b, dims)
    ka, kb, signs = _role_keys(g, key, layer_key, role_idx)
    qa, fa = _q(a_FxC, g.lhs, g.hadamard, signs, 1, ka, r.compute_dtype)
    qb, fb = _q(b, g.rhs, g.hadamard, signs, b_axis, kb, r.compute_dtype)
    # Documented: float32 compute with an FP8 operand; factors on the output.
    cdt = jnp.promote_types(qa.dtype, qb.dtype)
    y = lax.dot_general(qa.astype(cdt), qb.astype(cdt), dims, preferred_element_type=jnp.float32)
    for factor in (fa, fb):
      y = y if factor is None else y * factor
    return y

  def trust(g, operand, spec, axis):
    """QuEST: zero the gradient of elements that Fprop's quantization clipped,
    in Fprop's (padded, rotated) layout of the operand."""
    if spec is None or not spec.has_trust_mask:
      return g
    h, n = r.fprop.hadamard, operand.shape[axis]
    signs = _role_keys(r.fprop, key, layer_key, 0)[2]
    p = lambda a: _q(a, None, h, signs, axis, None, jnp.float32)[0]
    mask = formats.clip_mask(p(operand), spec, axis)
    back = p(g) * mask if h is None else hadamard.unrotate(p(g) * mask, h.block, axis, signs)
    return lax.slice_in_dim(back, 0, n, axis=axis)

  y = gemm(0, r.fprop, x_MxK, w_KxN, 0)
  dx = trust(gemm(1, r.dgrad, dy_MxN, w_KxN, 1), x_MxK, r.fprop.lhs, 1)
  dw = trust(gemm(2, r.wgrad, x_MxK.T, dy_MxN, 0), w_KxN, r.fprop.rhs, 0)
  return y, dx, dw


@pytest.mark.parametrize("name", recipes.recipe_names())
def test_every_role_matches_the_hand_written_reference(name):
  _check_against_the_reference(recipes.recipe(name))


def _check_against_the_reference(r):
  """dot_general(r)'s forward and backward on rank-3 activations (B=2, L=32 ->
  M=64 tokens; N=48 pads Hadamard 64) equal _reference's."""
  x, w, dy = _dense_operands(_normal)
  y, dx, dw = _recipe_vjp_fn(r)(x, w, dy, KEY, LAYER_KEY)
  ry, rdx, rdw = _reference_fn(r)(x.reshape(64, 96), w, dy.reshape(64, 48), KEY)
  _close(y.reshape(64, 48), ry)
  _close(dx.reshape(64, 96), rdx)
  _close(dw, rdw)
  assert (y.dtype, dx.dtype, dw.dtype) == (jnp.float32,) * 3


def test_stochastic_per_tensor_operands_take_their_random_bits_in_the_gemm_layout():
  """Per-tensor FP8 with stochastic rounding (no preset has it): each GEMM's
  operand draws its bits in that GEMM's layout (X^T for Wgrad), as documented,
  not in the array's own layout (the deterministic FP8 operands are quantized
  before the layout change; random ones must not be)."""
  sr = formats.QuantSpec("fp8_e4m3", rounding="stochastic")
  _check_against_the_reference(Recipe("fp8-sr", **_same(sr)))


# The paper's stages and the study's contrasts, written out by hand (not from
# fp4jax.recipes): AMD's MXFP4 cast is the even rule with nearest rounding.
_EVEN, _FLOOR = formats.QuantSpec("mxfp4", scale_mode="even"), formats.QuantSpec("mxfp4")
_EVEN_SR = formats.QuantSpec("mxfp4", scale_mode="even", rounding="stochastic")
_FP8_DGRAD = Gemm(formats.QuantSpec("fp8_e5m2"), formats.QuantSpec("fp8_e4m3"))
_FP8_WGRAD = Gemm(formats.QuantSpec("fp8_e4m3"), formats.QuantSpec("fp8_e5m2"))


def _same(spec, h=None):
  return dict(fprop=Gemm(spec, spec, h), dgrad=Gemm(spec, spec, h), wgrad=Gemm(spec, spec, h))


HAND_WRITTEN = {
    "mxfp4-fprop": dict(fprop=Gemm(_EVEN, _EVEN), dgrad=_FP8_DGRAD, wgrad=_FP8_WGRAD),
    "mxfp4-fprop-dgrad": dict(fprop=Gemm(_EVEN, _EVEN), dgrad=Gemm(_EVEN, _EVEN),
                              wgrad=_FP8_WGRAD),
    "mxfp4": _same(_EVEN),
    "mxfp4-sr": dict(fprop=Gemm(_EVEN, _EVEN), dgrad=Gemm(_EVEN_SR, _EVEN_SR),
                     wgrad=Gemm(_EVEN_SR, _EVEN_SR)),
    "mxfp4-rh16": _same(_EVEN, Hadamard(16, "per-step")),
    "mxfp4-dh16": _same(_EVEN, Hadamard(16)),
    "mxfp4-dh32": _same(_EVEN, Hadamard(32)),
    "mxfp4-wdh16": dict(fprop=Gemm(_EVEN, _EVEN), dgrad=Gemm(_EVEN, _EVEN),
                        wgrad=Gemm(_EVEN, _EVEN, Hadamard(16))),
    "mxfp4-lh16": _same(_EVEN, Hadamard(16, "per-layer")),
    "mxfp4-fh16": _same(_EVEN, Hadamard(16, "fixed")),
    "mxfp4-floor": _same(_FLOOR),
    "mxfp4-dh16-floor": _same(_FLOOR, Hadamard(16)),
}


def _with_rule(roles, rule):
  """The hand-written roles with every MX operand's scale rule set to `rule`."""
  def spec(s):
    return dataclasses.replace(s, scale_mode=rule) if s.family == "mx" else s
  return {role: Gemm(spec(g.lhs), spec(g.rhs), g.hadamard) for role, g in roles.items()}


@pytest.mark.parametrize("name", list(HAND_WRITTEN))
def test_staged_presets_match_their_hand_written_roles_and_rule(name):
  """Heavy-tailed data (Student t, 2 dof), where floor and even give different bits:
  the preset equals the hand-written recipe and not its other-rule twin. (The
  shapes of test_every_role_matches_the_hand_written_reference: the preset's
  program and the hand-written reference's are compiled there already.)"""
  x, w, dy = _dense_operands(lambda seed, shape: np.random.default_rng(5 + seed).standard_t(
      2.0, shape).astype(np.float32))
  got = _recipe_vjp_fn(recipes.recipe(name))(x, w, dy, KEY, LAYER_KEY)
  x, dy = x.reshape(64, 96), dy.reshape(64, 48)
  roles = HAND_WRITTEN[name]
  rule = "floor" if name.endswith("-floor") else "even"
  want = _reference_fn(Recipe("hand", **roles))(x, w, dy, KEY)
  other = _reference_fn(Recipe("other", **_with_rule(
      roles, "even" if rule == "floor" else "floor")))(x, w, dy, KEY)
  for role, u, v, t in zip(recipes.ROLES, got, want, other):
    u = u.reshape(v.shape)
    _close(u, v)
    if roles[role].lhs.family == "mx":
      assert not np.allclose(u, t, rtol=1e-3), (name, role)


def test_reference_detects_a_wrong_axis():
  """Guard on the test itself: Wgrad operands blocked along K instead of M differ."""
  spec = recipes.recipe("mxfp4").wgrad.lhs
  x, dy = _normal(0, (64, 96)), _normal(2, (64, 48))

  @functools.partial(jax.jit, static_argnums=0)
  def dw(axis, x, dy):
    q = lambda a: formats.fake_quantize(a, spec, axis).astype(jnp.bfloat16)
    return lax.dot_general(q(x), q(dy), (((0,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)

  with pytest.raises(AssertionError):
    _close(dw(1, x, dy), dw(0, x, dy))


# ------------------------------------------------------------- exactness

def test_bf16_is_lax_dot_general_bitwise():
  dg = dot.dot_general(recipes.recipe("bf16"))
  for dtype, kw in ((jnp.float32, {}), (jnp.bfloat16, {}),
                    (jnp.bfloat16, dict(precision=lax.Precision.HIGHEST,
                                        preferred_element_type=jnp.float32))):
    x, w = _normal(0, (4, 8, 64), dtype), _normal(1, (64, 32), dtype)
    f = lambda a, b: dg(a, b, DENSE, **kw)
    g = lambda a, b: lax.dot_general(a, b, DENSE, **kw)
    # The same program, not only the same bits (where two GEMM routes sum
    # alike, bits alone would not tell them apart).
    assert str(jax.make_jaxpr(f)(x, w)) == str(jax.make_jaxpr(g)(x, w))
    got = jax.vjp(f, x, w)
    want = jax.vjp(g, x, w)
    np.testing.assert_array_equal(got[0], want[0])
    dyk = _normal(2, (4, 8, 32), got[0].dtype)
    for a, b in zip(got[1](dyk), want[1](dyk)):
      assert a.dtype == b.dtype
      np.testing.assert_array_equal(a, b)


def test_plain_route_float32_output_rounds_float32_output_gemms_once():
  """plain_route="float32_output": each of the three GEMMs is a bf16 x bf16 ->
  float32 lax.dot_general rounded to bf16 (in the custom_vjp), bit for bit;
  against autodiff of lax.dot_general, whose bf16 GEMMs sum in another order
  (XLA:CPU's, per CPU and release), fewer than 1 in 10^3 outputs differ, by
  at most two bf16 ulps (one on the AMD EPYC VMs; two, in 0.024% of them, on a
  Xeon with AMX under jax 0.10.2)."""
  dg = dot.dot_general(dataclasses.replace(recipes.recipe("bf16"), plain_route="float32_output"))
  x, w = _normal(0, (4, 64, 384), jnp.bfloat16), _normal(1, (384, 128), jnp.bfloat16)
  dy = _normal(2, (4, 64, 128), jnp.bfloat16)
  jaxpr = str(jax.make_jaxpr(lambda a, b: dg(a, b, DENSE))(x, w))
  assert "custom_vjp_call" in jaxpr and "preferred_element_type=float32" in jaxpr, jaxpr
  wide = lambda a, b, dims: lax.dot_general(a, b, dims, preferred_element_type=jnp.float32
                                            ).astype(jnp.bfloat16)
  want = (wide(x, w, DENSE), wide(dy, w, (((2,), (1,)), ((), ()))),
          wide(x, dy, (((0, 1), (0, 1)), ((), ()))))
  y, pull = jax.vjp(lambda a, b: dg(a, b, DENSE), x, w)
  got = (y, *pull(dy))
  y_lax, pull_lax = jax.vjp(lambda a, b: lax.dot_general(a, b, DENSE), x, w)
  for a, b, c in zip(got, want, (y_lax, *pull_lax(dy))):
    assert a.dtype == b.dtype == c.dtype == jnp.bfloat16
    np.testing.assert_array_equal(a, b)
    bits = lambda t: np.asarray(t).view(np.uint16).astype(np.int32)
    ulps = np.abs(bits(a) - bits(c))
    assert ulps.max() <= 2 and (ulps > 0).mean() < 1e-3, (ulps.max(), (ulps > 0).mean())


def test_plain_route_float32_output_applies_to_a_quantized_recipes_plain_roles():
  """tseng quantizes only Dgrad and Wgrad: its Fprop follows plain_route."""
  x, w = _normal(0, (4, 64, 384), jnp.bfloat16), _normal(1, (384, 128), jnp.bfloat16)
  tseng = recipes.recipe("tseng")
  assert tseng.fprop.is_plain and not tseng.wgrad.is_plain
  wide = dataclasses.replace(tseng, plain_route="float32_output")
  key = jax.random.PRNGKey(0)
  np.testing.assert_array_equal(dot.dot_general(tseng)(x, w, DENSE, key=key),
                                lax.dot_general(x, w, DENSE))
  np.testing.assert_array_equal(
      dot.dot_general(wide)(x, w, DENSE, key=key),
      lax.dot_general(x, w, DENSE, preferred_element_type=jnp.float32).astype(jnp.bfloat16))


def test_deterministic_recipes_are_bitwise_reproducible():
  """Two separate compilations, and a repeated call, give the same bits."""
  x, w, dy = _normal(0, (64, 64)), _normal(1, (64, 32)), _normal(2, (64, 32))
  dims = (((1,), (0,)), ((), ()))
  for name in ("fp8", "mxfp4-dh16"):
    f = _vjp_fn(dot.dot_general(recipes.recipe(name)), dims)
    a, b = f(x, w, dy, None), f(x, w, dy, None)
    c = _vjp(dot.dot_general(recipes.recipe(name)), x, w, dy, dims=dims, key=None)
    for u, v, t in zip(a, b, c):
      np.testing.assert_array_equal(u, v)
      np.testing.assert_array_equal(u, t)


def test_random_recipes_follow_the_key():
  """(On the programs test_every_role_matches_the_hand_written_reference compiled.)"""
  x, w, dy = _dense_operands(_normal)
  for name in ("mxfp4-sr", "mxfp4-rh16", "nvfp4"):  # SR only, signs only, per role
    f = _recipe_vjp_fn(recipes.recipe(name))
    a, b, c = (f(x, w, dy, jax.random.key(k), LAYER_KEY) for k in (1, 1, 2))
    for role, u, v, t in zip(recipes.ROLES, a, b, c):  # y, dx, dw
      np.testing.assert_array_equal(u, v)
      assert np.array_equal(u, t) != getattr(recipes.recipe(name), role).is_random, (name, role)
    with pytest.raises(ValueError, match="needs key"):
      dot.dot_general(recipes.recipe(name))(x, w, DENSE)


def test_rotated_forward_is_the_product_of_rotated_operands():
  """mxfp4-dh16(x, w) == mxfp4(rotate(x), rotate(w)): the GEMM needs no un-rotation."""
  x, w = _normal(0, (64, 96)), _normal(1, (96, 48))
  dims = (((1,), (0,)), ((), ()))
  dh16 = jax.jit(lambda a, b: dot.dot_general(recipes.recipe("mxfp4-dh16"))(a, b, dims))
  mxfp4 = jax.jit(lambda a, b: dot.dot_general(recipes.recipe("mxfp4"))(a, b, dims))
  rotated = dh16(x, w)
  _close(rotated, mxfp4(hadamard.rotate(x, 16, 1), hadamard.rotate(w, 16, 0)))
  assert not np.allclose(rotated, mxfp4(x, w))


# ---------------------------------------- layouts: rotation without quantization

def _rotation_only(signs, block=16):
  g = Gemm(hadamard=Hadamard(block, signs))
  return Recipe("rot", g, g, g, compute_dtype="float32")


LAYOUTS = {  # name: (lhs shape, rhs shape, dimension numbers)
    "dense rank2": ((24, 40), (40, 8), (((1,), (0,)), ((), ()))),
    "dense rank4": ((2, 3, 4, 40), (40, 8), (((3,), (0,)), ((), ()))),
    "dense general": ((2, 6, 4, 8), (4, 8, 12), (((2, 3), (0, 1)), ((), ()))),
    "reversed contraction": ((2, 6, 8, 4), (4, 8, 12), (((3, 2), (0, 1)), ((), ()))),
    "kernel first": ((12, 40), (6, 40), (((1,), (1,)), ((), ()))),
    "attention": ((2, 5, 3, 8), (2, 7, 3, 8), (((3,), (3,)), ((0, 2), (0, 2)))),
    "outer": ((5, 3), (4,), (((), ()), ((), ()))),
}


@pytest.mark.parametrize("layout,signs", list(zip(
    LAYOUTS, ["per-step", "fixed", "none", "per-layer", "none", "fixed", "per-step"])))
def test_rotation_without_quantization_leaves_the_product_unchanged(layout, signs):
  """y, dx and dw of a rotation-only recipe == lax.dot_general, in every layout."""
  ls, rs, dims = LAYOUTS[layout]
  x, w = _normal(0, ls), _normal(1, rs)
  dy = _normal(2, jax.eval_shape(lambda a, b: lax.dot_general(a, b, dims), x, w).shape)
  want = _vjp(lambda a, b, d, key, layer_key: lax.dot_general(a, b, d, precision="highest"), x, w, dy, dims)
  got = _vjp(dot.dot_general(_rotation_only(signs)), x, w, dy, dims)
  for u, v in zip(got, want):
    assert u.shape == v.shape
    _close(u, v)


@pytest.mark.parametrize("layout", ["dense general", "reversed contraction", "kernel first"])
def test_several_contraction_axes_block_as_one_flattened_axis(layout):
  """Quantized result == the same recipe on operands flattened by hand (dot order)."""
  ls, rs, ((lc, rc), _) = LAYOUTS[layout]
  x, w = _normal(0, ls), _normal(1, rs)
  lf = [d for d in range(x.ndim) if d not in lc]
  rf = [d for d in range(w.ndim) if d not in rc]
  x2 = jnp.transpose(x, lf + list(lc)).reshape(-1, np.prod([x.shape[d] for d in lc]))
  w2 = jnp.transpose(w, list(rc) + rf).reshape(x2.shape[1], -1)
  dg = jax.jit(dot.dot_general(recipes.recipe("mxfp4-dh16")), static_argnums=2)
  y = dg(x, w, LAYOUTS[layout][2])
  y2 = dg(x2, w2, (((1,), (0,)), ((), ())))
  _close(y.reshape(y2.shape), y2)


def test_batch_dims_agree_with_vmap():
  """Attention-like einsum: batch dims == vmap of the unbatched quantized GEMM.

  (vmap's out_axes transpose the bf16 GEMM outputs: the XLA:CPU case _fence handles.)
  """
  q, k = _normal(0, (2, 32, 3, 32)), _normal(1, (2, 64, 3, 32))
  dy = _normal(2, (2, 3, 32, 64))
  dg = dot.dot_general(recipes.recipe("mxfp4-dh16"))
  got = _vjp(dg, q, k, dy, dims=(((3,), (3,)), ((0, 2), (0, 2))), key=None)
  one = lambda a, b, c: _vjp(dg, a, b, c, dims=(((1,), (1,)), ((), ())), key=None)
  want = jax.jit(jax.vmap(jax.vmap(one, (1, 1, 0), (0, 1, 1))))(q, k, dy)
  for u, v in zip(got, want):
    _close(u, v)


def test_padding_is_exact():
  """Axes that no block divides give what explicit zero padding gives (nearest rounding)."""
  x, w, dy = _normal(0, (40, 40)), _normal(1, (40, 24)), _normal(2, (40, 24))
  pad = lambda a, s: jnp.pad(a, [(0, n - m) for n, m in zip(s, a.shape)])
  dims = (((1,), (0,)), ((), ()))
  for name in ("mxfp4", "mxfp4-dh16", "mxfp4-dh32"):
    dg = dot.dot_general(recipes.recipe(name))
    y, dx, dw = _vjp(dg, x, w, dy, dims=dims)
    yp, dxp, dwp = _vjp(dg, pad(x, (64, 64)), pad(w, (64, 32)), pad(dy, (64, 32)), dims=dims)
    _close(y, yp[:40, :24])
    _close(dx, dxp[:40, :40])
    _close(dw, dwp[:40, :24])


# ----------------------------------------------- dtypes, transforms, arguments

def test_bf16_inputs_and_preferred_element_type():
  dg = dot.dot_general(recipes.recipe("mxfp4-dh16"))
  x, w = _normal(0, (64, 64), jnp.bfloat16), _normal(1, (64, 32), jnp.bfloat16)
  dims = (((1,), (0,)), ((), ()))
  y, dx, dw = _vjp(dg, x, w, jnp.ones((64, 32), jnp.bfloat16), dims, key=None)
  assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
  y32 = jax.jit(lambda a, b: dg(a, b, dims, preferred_element_type=jnp.float32))(x, w)
  assert y32.dtype == jnp.float32
  np.testing.assert_array_equal(y32.astype(jnp.bfloat16), y)


def test_remat_and_grad_of_a_loss():
  dg = dot.dot_general(recipes.recipe("mxfp4-rh16"))
  x, w = _normal(0, (64, 64)), _normal(1, (64, 32))
  loss = lambda w, key: jnp.sum(dg(x, w, (((1,), (0,)), ((), ())), key=key) ** 2)
  g = jax.jit(jax.grad(loss))(w, KEY)
  g_remat = jax.jit(jax.grad(jax.checkpoint(loss)))(w, KEY)
  np.testing.assert_array_equal(g, g_remat)
  assert np.isfinite(g).all() and g.shape == w.shape


def test_precision_is_passed_to_every_gemm():
  dg = dot.dot_general(recipes.recipe("mxfp4"))
  x, w = _normal(0, (64, 64)), _normal(1, (64, 32))
  f = lambda a, b: dg(a, b, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST)
  jaxpr = jax.make_jaxpr(lambda a, b: jax.vjp(f, a, b)[1](jnp.ones((64, 32))))(x, w)
  text = str(jaxpr)
  assert text.count("dot_general") >= 3
  assert "DEFAULT" not in text and "HIGHEST" in text


def test_out_sharding_is_honoured():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  spec = jax.sharding.PartitionSpec("data", None)
  dg = dot.dot_general(recipes.recipe("mxfp4-dh16"))
  with jax.set_mesh(mesh):
    x = jax.device_put(_normal(0, (64, 64)), jax.sharding.NamedSharding(mesh, spec))
    w = jax.device_put(_normal(1, (64, 32)), jax.sharding.NamedSharding(mesh, jax.P()))
    y = jax.jit(lambda a, b: dg(a, b, (((1,), (0,)), ((), ())), out_sharding=spec))(x, w)
  assert y.sharding.spec == spec


def test_backend_names():
  x, w = _normal(0, (32, 32)), _normal(1, (32, 32))
  dims = (((1,), (0,)), ((), ()))
  auto = dataclasses.replace(recipes.recipe("mxfp4"), backend="auto")
  run = lambda r: jax.jit(lambda a, b: dot.dot_general(r)(a, b, dims))(x, w)
  np.testing.assert_array_equal(run(auto), run(recipes.recipe("mxfp4")))
  with pytest.raises(ValueError, match="backend"):
    dataclasses.replace(recipes.recipe("mxfp4"), backend="triton")


@pytest.mark.parametrize("name", ["mxfp4-dh16", "mxfp4-sr"])
def test_pallas_backend_matches_xla(name):
  """The fused kernels (interpreted on CPU) give the XLA path's bits: y, dX, dW."""
  x, w = _normal(0, (2, 24, 64)), _normal(1, (64, 48))
  dims = (((2,), (0,)), ((), ()))
  key = jax.random.key(3)

  def value_and_grads(r):
    dg = dot.dot_general(r)
    f = lambda a, b: dg(a, b, dims, key=key)
    y, vjp = jax.vjp(f, x, w)
    return (y,) + vjp(jnp.cos(y))

  pallas_recipe = dataclasses.replace(recipes.recipe(name), backend="pallas")
  assert "pallas_call" in str(jax.make_jaxpr(lambda: value_and_grads(pallas_recipe))())
  # Compiled (op by op, the interpreted kernels take four times as long).
  xla = jax.jit(lambda: value_and_grads(recipes.recipe(name)))()
  pallas = jax.jit(lambda: value_and_grads(pallas_recipe))()
  for a, b in zip(xla, pallas):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_per_tensor_operands_on_pallas_are_xlas():
  """FP8's per-tensor operands never reach a kernel: on `pallas` they are the `xla`
  backend's, quantized before their layout changes as there, so the two programs
  are one (the GPU check's CPU run saw 20% of fp8's fwd+bwd values differ at
  float32 rounding when pallas quantized after)."""
  x, w = _normal(0, (2, 24, 64)), _normal(1, (64, 48))
  dims = (((2,), (0,)), ((), ()))

  def fwd_bwd(r):
    f = lambda a, b: dot.dot_general(r)(a, b, dims)
    return jax.make_jaxpr(lambda a, b: jax.vjp(f, a, b)[1](jnp.cos(f(a, b))))(x, w)

  pallas = dataclasses.replace(recipes.recipe("fp8"), backend="pallas")
  assert str(fwd_bwd(pallas)) == str(fwd_bwd(recipes.recipe("fp8")))


def test_bad_arguments_fail_clearly():
  with pytest.raises(TypeError, match="Recipe"):
    dot.dot_general("mxfp4")
  dg = dot.dot_general(recipes.recipe("mxfp4"))
  x, w = jax.ShapeDtypeStruct((4, 32), jnp.float32), jax.ShapeDtypeStruct((32, 8), jnp.float32)
  trace = lambda dims: jax.eval_shape(lambda a, b: dg(a, b, dims), x, w)  # errors at trace time
  with pytest.raises(ValueError, match="out of range for lhs"):
    trace((((2,), (0,)), ((), ())))
  with pytest.raises(ValueError, match="out of range for rhs"):
    trace((((1,), (-3,)), ((), ())))
  assert trace((((-1,), (-2,)), ((), ()))).shape == (4, 8)


def test_per_tensor_operands_are_quantized_once_per_array():
  """fp8 (per-tensor scales): one linear layer's forward and backward take the
  amax of X, W and dY once each, though X and dY each feed two GEMMs in two
  layouts (quantized before the layout change, so XLA merges the copies)."""
  dg = dot.dot_general(recipes.recipe("fp8"))
  x, w = _normal(0, (4, 64, 384), jnp.bfloat16), _normal(1, (384, 128), jnp.bfloat16)
  dy = _normal(2, (4, 64, 128), jnp.bfloat16)

  def fwd_bwd(a, b, g):
    y, pull = jax.vjp(lambda a, b: dg(a, b, DENSE), a, b)
    return y, *pull(g)

  hlo = jax.jit(fwd_bwd).lower(x, w, dy).compile().as_text()
  assert hlo.count(" reduce(") == 3, hlo.count(" reduce(")


@pytest.mark.parametrize("name,backend,transposed", [
    ("mxfp4", "xla", False), ("mxfp4-dh16", "xla", False),
    ("mxfp4-sr", "xla", True),  # random bits are drawn in the layout's shape
    ("mxfp8", "xla", True), ("nvfp4", "xla", True),  # E4M3 scales: sums that round
    ("mxfp4", "pallas", True)])
def test_the_wgrad_lhs_is_quantized_in_place_on_xla(name, backend, transposed):
  """The xla backend quantizes an FP4 Wgrad lhs X[M, K] (nearest rounding) along
  its token axis where it lies: no array of X's transposed shape [K, M] in the
  compiled forward and backward. Other operands and backends keep the
  transposed layout (dot._lhs_last)."""
  m, k, n = 96, 64, 32
  r = dataclasses.replace(recipes.recipe(name), backend=backend)
  dg = dot.dot_general(r)

  def step(x, w, dy):
    y, vjp = jax.vjp(lambda x, w: dg(x, w, (((1,), (0,)), ((), ())), key=KEY,
                                     layer_key=LAYER_KEY), x, w)
    return (y,) + vjp(dy)

  shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k, n), (m, n))]
  text = jax.jit(step).lower(*shapes).compile().as_text()
  assert (f"[{k},{m}]" in text) == transposed
