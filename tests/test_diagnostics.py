"""fp4jax.diagnostics on cases whose answer is known."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import flax.linen as nn
import pytest

from fp4jax import diagnostics as D
from fp4jax import dot as fp4jax_dot
from fp4jax.numerics import formats
from fp4jax.llama import model as model_lib
from fp4jax import recipes
from tests import numpy_reference as ref


def test_relative_error_and_cosine():
  e = jnp.array([3.0, 4.0])
  assert D.relative_error(e * 1.1, e) == pytest.approx(0.1, rel=1e-5)
  assert D.cosine(e, 2 * e) == pytest.approx(1.0)
  assert D.cosine(e, jnp.array([-4.0, 3.0])) == pytest.approx(0.0, abs=1e-7)
  assert np.isnan(D.cosine(e, jnp.zeros(2)))


def test_signal_to_noise_on_hand_built_errors():
  exact = jnp.array([3.0, 4.0])  # norm 5
  assert D.signal_to_noise(exact + jnp.array([0.6, 0.8]), exact) == pytest.approx(5.0)
  assert D.signal_to_noise(exact + jnp.array([-3.0, 0.0]), exact) == pytest.approx(5 / 3)
  assert D.signal_to_noise(exact, exact) == np.inf
  assert np.isnan(D.signal_to_noise(jnp.zeros(2), jnp.zeros(2)))


@pytest.mark.parametrize("name", ["mxfp4-floor", "mxfp4", "mxfp4-dh16"])
def test_fprop_snr_matches_a_numpy_reference(name):
  """||X W|| / ||q(X) q(W) - X W|| with q from the independent NumPy
  quantizer (MXFP4 blocks of 32 along K; H16 applied by hand)."""
  x, w, dy = _operands()
  recipe = recipes.recipe(name)
  spec = recipe.fprop.lhs
  xr, wr = np.asarray(x, np.float64), np.asarray(w, np.float64)
  if recipe.fprop.hadamard is not None:
    h = np.kron(np.eye(x.shape[1] // 16), _sylvester(16) / 4)
    xr, wr = xr @ h, h.T @ wr
  xq = ref.quantize(xr.astype(np.float32), "mxfp4", scale_mode=spec.scale_mode, axis=1)["y"]
  wq = ref.quantize(wr.astype(np.float32), "mxfp4", scale_mode=spec.scale_mode, axis=0)["y"]
  exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  want = np.linalg.norm(exact) / np.linalg.norm(xq.astype(np.float64) @ wq - exact)
  stats, _ = _stats(name, x, w, dy)
  assert float(stats["fprop"]["snr"]) == pytest.approx(want, rel=1e-3)
  assert float(stats["fprop"]["snr"]) == pytest.approx(1 / float(stats["fprop"]["out_err"]),
                                                       rel=1e-5)
  assert 2 < want < 100


def _sylvester(n):
  h = np.ones((1, 1))
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return h


def test_fixed_error_has_bias_one():
  e = jax.random.normal(jax.random.key(0), (64, 32))
  assert D.error_bias([e] * 8) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("k", [4, 16])
def test_random_sign_error_has_bias_one_over_sqrt_k(k):
  e = jax.random.normal(jax.random.key(0), (20000,))
  signs = jax.random.rademacher(jax.random.key(1), (k, 20000), jnp.float32)
  assert D.error_bias(signs * e) == pytest.approx(1 / np.sqrt(k), rel=0.05)


def test_error_window_reports_on_consecutive_steps():
  win = D.ErrorWindow(3)
  e = np.ones((4, 4), np.float32)
  assert win.add(10, e) == {}
  assert win.add(11, -e) == {"step_cos": pytest.approx(-1.0)}
  out = win.add(12, e)
  assert out["step_cos"] == pytest.approx(-1.0)
  assert out["bias"] == pytest.approx(1 / 3)
  assert win.add(20, e) == {}  # a gap: no predecessor, window not consecutive
  assert win.add(21, 2 * e) == {"step_cos": pytest.approx(1.0)}
  assert win.add(22, e)["bias"] == pytest.approx(1.0)
  zero = D.ErrorWindow(2)
  zero.add(0, 0 * e)
  assert zero.add(1, 0 * e) == {}  # undefined statistics are left out


def test_as_matrices_reads_dense_general_layouts():
  x, w, dy = jnp.ones((2, 8, 64)), jnp.ones((64, 4, 16)), jnp.ones((2, 8, 4, 16))
  assert [a.shape for a in D.as_matrices(x, w, dy)] == [(16, 64), (64, 64), (16, 64)]
  x, w, dy = jnp.ones((2, 8, 4, 16)), jnp.ones((4, 16, 32)), jnp.ones((2, 8, 32))
  assert [a.shape for a in D.as_matrices(x, w, dy)] == [(16, 64), (64, 32), (16, 32)]
  with pytest.raises(ValueError, match="linear layer"):
    D.as_matrices(jnp.ones((2, 8)), jnp.ones((4, 3)), jnp.ones((2, 3)))


def _stats(name, *operands):
  return jax.jit(functools.partial(D.gemm_stats, recipes.recipe(name)))(*operands)


def _operands(m=64, k=64, n=32):
  keys = jax.random.split(jax.random.key(3), 3)
  return (jax.random.normal(keys[0], (m, k)), jax.random.normal(keys[1], (k, n)) * 0.1,
          jax.random.normal(keys[2], (m, n)) * 1e-3)


def test_unquantized_recipe_has_no_error():
  stats, errors = _stats("bf16", *_operands())
  for role in recipes.ROLES:
    assert float(stats[role]["out_err"]) < 1e-6  # float32 round-off of the exact GEMM
    assert float(stats[role]["lhs_err"]) == 0.0 and float(stats[role]["rhs_err"]) == 0.0
    assert float(jnp.max(jnp.abs(errors[role]))) < 1e-6


def test_wgrad_statistics_match_a_hand_written_reference():
  x, w, dy = _operands()
  recipe = recipes.recipe("mxfp4")
  spec = recipe.wgrad.lhs
  xq, dyq = formats.fake_quantize(x, spec, axis=0), formats.fake_quantize(dy, spec, axis=0)
  dw_q, dw = xq.T @ dyq, x.T @ dy
  stats, errors = _stats("mxfp4", x, w, dy)
  np.testing.assert_allclose(errors["wgrad"], dw_q - dw, rtol=1e-4, atol=1e-7)
  assert float(stats["wgrad"]["lhs_err"]) == pytest.approx(
      float(jnp.linalg.norm(xq - x) / jnp.linalg.norm(x)), rel=1e-5)
  assert float(stats["wgrad"]["out_err"]) == pytest.approx(
      float(jnp.linalg.norm(dw_q - dw) / jnp.linalg.norm(dw)), rel=1e-4)
  assert 0.9 < float(stats["wgrad"]["out_cos"]) < 1.0


def test_rotated_operand_error_is_measured_in_the_rotated_basis():
  x, w, dy = _operands()
  stats, _ = _stats("mxfp4-dh16", x, w, dy)
  plain, _ = _stats("mxfp4", x, w, dy)
  for role in recipes.ROLES:
    assert 0.01 < float(stats[role]["lhs_err"]) < 0.5
    assert float(stats[role]["out_err"]) != float(plain[role]["out_err"])


def test_measured_operands_are_the_ones_the_gemm_used():
  """role_operands (same keys, same layout as dot.py) returns exactly the
  operands the quantized GEMM multiplied: checked on mxfp4-sr with per-step
  random H16 signs on every role (stochastic rounding and random signs; no
  per-tensor factor and no trust mask, which act outside the operands)."""
  key = jax.random.key(5)
  sr = recipes.recipe("mxfp4-sr")
  rotation = recipes.Hadamard(16, "per-step")
  recipe = dataclasses.replace(sr, name="mxfp4-sr-rh16", **{
      r: dataclasses.replace(getattr(sr, r), hadamard=rotation) for r in recipes.ROLES})
  x, w, dy = _operands()
  _, errors = jax.jit(functools.partial(D.gemm_stats, recipe))(x, w, dy, key)
  cases = {"fprop": ((x, w, 1, 0), lambda a, b: a @ b, x @ w),
           "dgrad": ((dy, w, 1, 1), lambda a, b: a @ b.T, dy @ w.T),
           "wgrad": ((x.T, dy, 1, 0), lambda a, b: a @ b, x.T @ dy)}

  @jax.jit
  def outputs(key):
    out = {}
    for i, role in enumerate(recipes.ROLES):
      operands, product, _ = cases[role]
      (a_q, _), (b_q, _) = D.role_operands(recipe, role, *operands, jax.random.fold_in(key, i))
      out[role] = product(a_q.astype(jnp.float32), b_q.astype(jnp.float32))
    return out

  for role, out in outputs(key).items():
    np.testing.assert_allclose(errors[role] + cases[role][2], out,
                               atol=1e-5 * float(jnp.abs(out).max()))


def _tiny_model(recipe):
  cfg = model_lib.model_config("tiny", n_layers=1, vocab_size=64)
  return model_lib.Llama(cfg, recipes.recipe(recipe) if isinstance(recipe, str) else recipe)


def test_capture_gives_the_layer_gradient():
  """X^T dY from the captured operands equals the kernel's gradient."""
  model = _tiny_model("bf16")
  tokens = jax.random.randint(jax.random.key(0), (2, 33), 0, 64)
  params = jax.jit(model.init)(jax.random.key(1), tokens[:, :-1])["params"]
  cap = model.clone(config=dataclasses.replace(model.config, capture_dots=True))
  ops = jax.jit(functools.partial(D.capture, cap, ("block_0/mlp/down",)))(params, tokens)
  assert ops["block_0/mlp/down"][3] is None  # no per-layer signs: no layer key
  x, w, dy = D.as_matrices(*ops["block_0/mlp/down"][:3])

  def loss(p):
    logits = model.apply({"params": p}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  grad = nn.unbox(jax.jit(jax.grad(loss))(params))["block_0"]["mlp"]["down"]["kernel"]
  np.testing.assert_allclose(x.T @ dy, grad.reshape(w.shape), rtol=1e-4, atol=1e-7)
  with pytest.raises(ValueError, match="not found"):  # raised while tracing
    jax.eval_shape(functools.partial(D.capture, cap, ("block_7/mlp/down",)), params, tokens)


def test_callback_on_fixed_weights():
  """Same weights, same reference batch: a deterministic GEMM repeats its error
  exactly (bias 1, step cosine 1), a random one does not. The recipe has
  both: plain MXFP4 in fprop, MXFP4 with fresh random Hadamard signs in dgrad
  and wgrad (cheaper to compile than stochastic rounding)."""
  mx, rh = formats.QuantSpec("mxfp4"), recipes.Hadamard(16, "per-step")
  model = _tiny_model(recipes.Recipe("test", fprop=recipes.Gemm(mx, mx),
                                     dgrad=recipes.Gemm(mx, mx, rh),
                                     wgrad=recipes.Gemm(mx, mx, rh)))
  tokens = np.asarray(jax.random.randint(jax.random.key(0), (4, 33), 0, 64))
  params = jax.jit(model.init)({"params": jax.random.key(1), "quant": jax.random.key(2)},
                               tokens[:, :-1])["params"]
  state = types.SimpleNamespace(params=params)
  cb = D.make_callback(model, tokens, layers=["block_0/attn/q"], every=4, window=3)
  rows = {step: cb(step, state, tokens) for step in range(5)}
  assert rows[3] is None
  assert "diag/train/block_0/attn/q/wgrad/out_err" in rows[0]
  assert "diag/train/block_0/attn/q/fprop/out_err" not in rows[0]
  # The SNR of every role on the training batch (here the reference batch
  # too: the deterministic fprop gives the same number on both).
  assert rows[0]["diag/train/block_0/attn/q/fprop/snr"] == pytest.approx(
      1 / rows[0]["diag/ref/block_0/attn/q/fprop/out_err"], rel=1e-5)
  assert all(1 < rows[0][f"diag/train/block_0/attn/q/{r}/snr"] < 1e3 for r in recipes.ROLES)
  ref = "diag/ref/block_0/attn/q"
  assert f"{ref}/fprop/bias" not in rows[1] and f"{ref}/fprop/step_cos" in rows[1]
  assert f"{ref}/fprop/step_cos" not in rows[4]  # step 3 was not measured
  for role in recipes.ROLES:
    assert 0 < rows[0][f"{ref}/{role}/out_err"] < 0.5
    bias, cos = rows[2][f"{ref}/{role}/bias"], rows[2][f"{ref}/{role}/step_cos"]
    if role == "fprop":
      assert bias == pytest.approx(1.0, abs=1e-6) and cos == pytest.approx(1.0, abs=1e-6)
    else:
      assert bias < 0.95 and cos < 0.9


def test_per_layer_signs_reach_the_diagnostics():
  """mxfp4-lh16: each layer sows its own key; the callback measures with it
  (needs the run's layer key), and the fprop error it reports is the one of
  the GEMM the model ran (same signs)."""
  model = _tiny_model("mxfp4-lh16")
  tokens = np.asarray(jax.random.randint(jax.random.key(0), (4, 33), 0, 64))
  run_key = jax.random.key(7)
  params = jax.jit(model.init)({"params": jax.random.key(1), "hadamard": run_key},
                               tokens[:, :-1])["params"]
  cap = model.clone(config=dataclasses.replace(model.config, capture_dots=True))
  layers = ("block_0/attn/q", "block_0/mlp/down")
  ops = jax.jit(functools.partial(D.capture, cap, layers))(params, tokens, None, run_key)
  keys = [jax.random.key_data(ops[name][3]) for name in layers]
  assert not np.array_equal(keys[0], keys[1])
  x, w, dy = D.as_matrices(*ops["block_0/attn/q"][:3])
  recipe = model.recipe
  stats, errors = jax.jit(functools.partial(D.gemm_stats, recipe))(x, w, dy, None,
                                                                   ops["block_0/attn/q"][3])
  fprop = jax.jit(lambda x, w, k: fp4jax_dot.dot_general(recipe)(
      x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32, layer_key=k))
  y_model = fprop(x, w, ops["block_0/attn/q"][3])
  np.testing.assert_allclose(errors["fprop"] + x @ w, y_model, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="layer_key"):
    D.make_callback(model, tokens, layers=["block_0/attn/q"], every=4, window=2)
  cb = D.make_callback(model, tokens, layers=["block_0/attn/q"], every=4, window=2,
                       layer_key=run_key)
  row = cb(1, types.SimpleNamespace(params=params), tokens)
  assert 1 < row["diag/train/block_0/attn/q/wgrad/snr"] < 1e3


def test_signed_error_of_e2m1_rounding_by_hand():
  """a uniform on (-5, 5), scale 1, nearest E2M1. Around each grid point c
  with left / right half-widths l, r the integral of (q - a) a is
  -c (r^2 - l^2) / 2 - (r^3 + l^3) / 3; over [0, 5] (c = 0 .. 4, the bins of
  2 and 4 asymmetric) these sum to -428/192, so E[(q - a) a] = -428/960 and,
  with E[a^2] = 25/3, the signed error is -1284/24000 = -0.0535: shrinkage."""
  from fp4jax.numerics import elements
  n = 2_000_000
  a = jnp.asarray(-5 + 10 * (np.arange(n) + 0.5) / n, jnp.float32)  # midpoint rule
  q = elements.round_element(a, elements.ELEMENTS["e2m1"])
  assert float(D.signed_error(q, a)) == pytest.approx(-0.0535, abs=2e-5)
  assert float(D.signed_error(a * 0.9, a)) == pytest.approx(-0.1)
  assert np.isnan(D.signed_error(a, jnp.zeros_like(a)))


def _wgrad_lhs_signed(x_value, **wgrad_lhs):
  """gemm_stats' wgrad lhs_signed for X = x_value everywhere [256, 64] under
  mxfp4-sr with `wgrad_lhs` fields set on its Wgrad lhs (from the config)."""
  cfg = recipes.config_template("mxfp4-sr")
  for k, v in wgrad_lhs.items():
    cfg.wgrad.lhs[k] = v
  recipe = recipes.from_config(cfg)
  x = jnp.full((256, 64), x_value, jnp.float32)
  w = jax.random.normal(jax.random.key(0), (64, 32))
  dy = jax.random.normal(jax.random.key(1), (256, 32))
  return float(jax.jit(functools.partial(D.gemm_stats, recipe))(
      x, w, dy, jax.random.key(2))[0]["wgrad"]["lhs_signed"])


def test_signed_error_shows_the_bias_of_a_biased_and_a_few_bit_sr():
  """By hand. X = 5 (scale 1, between E2M1's 4 and 6, fraction 1/2): SR
  rounds up with probability 1/2, E[q - 5] = 0; with sr_round_up_scale=0.5
  with 1/4, E[q - 5] = 1/4 - 3/4 = -1/2, so the signed error E[q - 5] * 5 / 25
  is -0.1. Per element q - 5 has standard deviation 1 (0.866 biased), over
  16384 elements the estimate 1 / (5 * 128) = 0.0016: within 5 of those.
  X = 4 + 2 * 3/1024 (fraction 3/1024 < 2^-8): 8 random bits truncate the
  fraction to 0, every element rounds to 4, signed error (4 - x) / x exactly;
  24 bits round up now and then, unbiased."""
  se = 1 / (5 * 128)
  assert abs(_wgrad_lhs_signed(5.0)) < 5 * se
  assert _wgrad_lhs_signed(5.0, sr_round_up_scale=0.5) == pytest.approx(-0.1, abs=5 * 0.866 * se)
  x = 4 + 2 * 3 / 1024
  assert _wgrad_lhs_signed(x, sr_bits=8) == pytest.approx((4 - x) / x, rel=1e-5)
  assert abs(_wgrad_lhs_signed(x)) < 5 * 2 * np.sqrt(3 / 1024) / x / 128


def _linear_model_halves(rng, reps, k=12, n=3, m=8):
  """`reps` batches of 2m rows of y = x W* + noise, x ~ N(0, I): their half-batch
  gradients by `half_gradients` (vmapped) from each batch's mean-loss dy, and
  the expected gradient E G = W - W* (of 0.5 ||x W - y||^2, mean over rows)."""
  w_true = np.linspace(-1, 1, k * n).reshape(k, n)
  w = w_true + 0.05
  x = rng.normal(size=(reps, 2 * m, k))
  y = x @ w_true + rng.normal(size=(reps, 2 * m, n))
  dy = (x @ w - y) / (2 * m)
  return jax.vmap(D.half_gradients)(jnp.asarray(x), jnp.asarray(dy)), w - w_true


def test_true_snr_is_unbiased_for_the_expected_gradient():
  (g_a, g_b), expected = _linear_model_halves(np.random.default_rng(0), 4000)
  dots = np.asarray(jnp.sum(g_a * g_b, axis=(1, 2)), np.float64)
  selfs = np.asarray(jnp.sum(g_a * g_a, axis=(1, 2)), np.float64)
  want = float(np.sum(expected ** 2))  # 36 * 0.05^2 = 0.09
  se = np.std(dots, ddof=1) / np.sqrt(dots.size)
  assert abs(dots.mean() - want) < 3 * se, (dots.mean(), want, se)
  assert selfs.mean() - want > 20 * se  # one batch with itself: its sampling noise added
  # snr_true is the square root over the error's norm.
  err = jnp.full((12, 3), 0.5)  # norm 3
  assert float(D.true_snr(g_a[0], g_b[0], err)) == pytest.approx(
      np.sqrt(max(dots[0], 0.0)) / 3, rel=1e-5)
  assert float(D.true_snr(g_a[0], -g_a[0], err)) == 0.0  # a negative estimate clips to 0


@pytest.mark.parametrize("name", ["mxfp4", "mxfp4-sr"])
def test_true_snr_equals_batch_snr_on_identical_halves(name):
  """Both halves the same rows: <G_a, G_b> = ||G||^2 and snr_true is the batch snr."""
  key = jax.random.key(3)
  x_h = jax.random.normal(jax.random.fold_in(key, 0), (64, 96))
  dy_h = jax.random.normal(jax.random.fold_in(key, 1), (64, 32))
  w = jax.random.normal(jax.random.fold_in(key, 2), (96, 32))
  fn = jax.jit(functools.partial(D.gemm_stats, recipes.recipe(name)), static_argnums=(5,))
  stats, _ = fn(jnp.concatenate([x_h, x_h]), w, jnp.concatenate([dy_h, dy_h]),
                jax.random.key(4), None, True)
  assert float(stats["wgrad"]["snr_true"]) == pytest.approx(float(stats["wgrad"]["snr"]),
                                                            rel=1e-5)


def test_kappa_is_one_for_incoherent_terms():
  """Independent Gaussian x and dy: the per-token terms of dW add incoherently,
  so the batch snr is the format's 1 / sqrt(eps_x^2 + eps_dy^2) and kappa ~ 1."""
  key = jax.random.key(5)
  x = jax.random.normal(jax.random.fold_in(key, 0), (1024, 64))
  dy = jax.random.normal(jax.random.fold_in(key, 1), (1024, 64))
  w = jax.random.normal(jax.random.fold_in(key, 2), (64, 64))
  wg = jax.jit(functools.partial(D.gemm_stats, recipes.recipe("mxfp4")))(x, w, dy)[0]["wgrad"]
  assert float(wg["kappa"]) == pytest.approx(
      float(wg["snr"] * np.hypot(wg["lhs_err"], wg["rhs_err"])), rel=1e-6)
  assert float(wg["kappa"]) == pytest.approx(1.0, abs=0.1)
  assert -0.05 < float(wg["lhs_signed"]) < 0  # nearest E2M1 on Gaussian blocks shrinks
