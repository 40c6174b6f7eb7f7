"""Drop-in use of the quantized dot_general in Flax linen and NNX layers."""


import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp4jax
from fp4jax import flax as fflax

X = jax.random.normal(jax.random.key(0), (64, 32))
TARGET = jnp.sin(X @ jax.random.normal(jax.random.key(1), (32, 32)) / 4)


def _train_linen(model, steps=12, rngs=("quant",)):
  """Adam on a regression loss; returns the losses."""
  params = jax.jit(model.init)(jax.random.key(2), X)["params"]  # op by op: hundreds of programs
  opt = optax.adam(1e-2)
  state = opt.init(params)

  @jax.jit
  def step(params, state, key):
    def loss(p):
      y = model.apply({"params": p}, X, rngs={r: jax.random.fold_in(key, i)
                                             for i, r in enumerate(rngs)})
      return jnp.mean((y - TARGET) ** 2)
    l, g = jax.value_and_grad(loss)(params)
    updates, state = opt.update(g, state)
    return optax.apply_updates(params, updates), state, l

  losses = []
  for i in range(steps):
    params, state, l = step(params, state, jax.random.key(100 + i))
    losses.append(float(l))
  return losses


def _assert_learns(losses):
  assert np.isfinite(losses).all()
  assert losses[-1] < 0.7 * losses[0], losses


class Mlp(nn.Module):
  recipe: fp4jax.Recipe

  @nn.compact
  def __call__(self, x):
    dg = fflax.DotGeneral.partial(recipe=self.recipe)
    h = nn.gelu(nn.Dense(64, dot_general_cls=dg)(x))
    h = nn.DenseGeneral((4, 16), dot_general_cls=dg)(h)              # [B, 4, 16]
    h = nn.DenseGeneral(32, axis=(-2, -1), dot_general_cls=dg)(nn.gelu(h))
    return h


def test_linen_dense_and_dense_general_train():
  _assert_learns(_train_linen(Mlp(fp4jax.recipe("mxfp4-dh16"))))


def test_linen_random_recipe_needs_the_quant_stream():
  model = Mlp(fp4jax.recipe("mxfp4-rh16"))
  params = jax.jit(model.init)({"params": jax.random.key(0), "quant": jax.random.key(1)}, X)
  with pytest.raises(Exception, match="quant"):
    model.apply(params, X)
  det = Mlp(fp4jax.recipe("mxfp4-dh16"))
  jax.jit(det.apply)(jax.jit(det.init)(jax.random.key(0), X), X)  # deterministic: no stream needed


def test_linen_dense_with_plain_dot_general_argument():
  dg = fp4jax.dot_general(fp4jax.recipe("mxfp4-dh16"))
  dense = nn.Dense(32, dot_general=dg)
  params = jax.jit(dense.init)(jax.random.key(0), X)
  y = jax.jit(dense.apply)(params, X)
  k = params["params"]["kernel"]
  want = jax.jit(dg, static_argnums=2)(X, k, (((1,), (0,)), ((), ())))
  np.testing.assert_allclose(y, want + params["params"]["bias"], rtol=1e-6)


class Block(nn.Module):
  recipe: fp4jax.Recipe

  @nn.compact
  def __call__(self, h, _):
    dg = fflax.DotGeneral.partial(recipe=self.recipe)
    return h + nn.Dense(32, dot_general_cls=dg)(nn.gelu(h)) / 4, None


class ScannedMlp(nn.Module):
  """Four residual blocks under nn.scan and nn.remat."""
  recipe: fp4jax.Recipe

  @nn.compact
  def __call__(self, x):
    blocks = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                     split_rngs={"params": True, "quant": True}, length=4)
    return blocks(self.recipe)(x, None)[0]


def test_linen_scan_and_remat():
  """A random recipe (keys from the "quant" stream, split across the scan)."""
  _assert_learns(_train_linen(ScannedMlp(fp4jax.recipe("quartet")), steps=15))


def test_capture_sows_operands_and_perturbs_the_output():
  r = fp4jax.recipe("mxfp4-dh16")
  dense = nn.Dense(32, use_bias=False,
                   dot_general_cls=fflax.DotGeneral.partial(recipe=r, capture=True))
  variables = jax.jit(dense.init)(jax.random.key(0), X)
  params, perturb = variables["params"], variables["perturbations"]
  c = jax.random.normal(jax.random.key(3), (64, 32))

  def loss(params, perturb):
    y, inter = dense.apply({"params": params, "perturbations": perturb}, X,
                           mutable="intermediates")
    return jnp.sum(y * c), inter

  (_, inter), dpert = jax.jit(jax.value_and_grad(loss, argnums=1, has_aux=True))(params, perturb)
  lhs, = inter["intermediates"]["DotGeneral_0"]["lhs"]
  rhs, = inter["intermediates"]["DotGeneral_0"]["rhs"]
  np.testing.assert_array_equal(lhs, X)
  np.testing.assert_array_equal(rhs, params["kernel"])
  np.testing.assert_array_equal(dpert["DotGeneral_0"]["out"], c)  # dY of the layer


class NnxMlp(nnx.Module):

  def __init__(self, dot_general, rngs):
    self.l1 = nnx.Linear(32, 64, dot_general=dot_general, rngs=rngs)
    self.l2 = nnx.Linear(64, 32, dot_general=dot_general, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.gelu(self.l1(x)))


def _train_nnx(model, steps=12):
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt):
    loss = lambda m: jnp.mean((m(X) - TARGET) ** 2)
    l, g = nnx.value_and_grad(loss)(model)
    opt.update(model, g)
    return l

  return [float(step(model, opt)) for _ in range(steps)]


def test_nnx_linear_deterministic_recipe():
  dg = fp4jax.dot_general(fp4jax.recipe("mxfp4-dh16"))
  _assert_learns(_train_nnx(NnxMlp(dg, nnx.Rngs(0))))


def test_nnx_linear_random_recipe_draws_from_the_quant_stream():
  rngs = nnx.Rngs(params=0, quant=1)
  model = NnxMlp(fflax.NNXDotGeneral(fp4jax.recipe("mxfp4-rh16"), rngs), rngs)
  forward = nnx.jit(lambda m, x: m(x))
  a, b = forward(model, X), forward(model, X)
  assert not np.array_equal(a, b)  # a fresh key each call
  _assert_learns(_train_nnx(model))


def test_nnx_einsum():
  r = fp4jax.recipe("mxfp4-dh16")
  layer = nnx.Einsum("bld,dhk->blhk", (32, 4, 8), (4, 8), einsum_op=fflax.einsum_op(r),
                     rngs=nnx.Rngs(0))
  x = X.reshape(2, 32, 32)
  y = nnx.jit(lambda m, x: m(x))(layer, x)
  k = layer.kernel[...]
  want = jax.jit(fp4jax.dot_general(r), static_argnums=2)(x, k, (((2,), (0,)), ((), ())))
  want = want + layer.bias[...]
  np.testing.assert_allclose(y, want, rtol=1e-6)
  plain = jnp.einsum("bld,dhk->blhk", x, k) + layer.bias[...]
  assert not np.allclose(y, plain, rtol=1e-3)  # quantized
