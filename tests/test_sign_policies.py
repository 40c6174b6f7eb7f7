"""Hadamard sign policies: per-layer signs are fixed for the run and differ per layer."""

import dataclasses
import functools

import flax.linen as nn
from flax import nnx
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp4jax
from fp4jax import dot, flax as fflax
from fp4jax.numerics import hadamard
from fp4jax.llama import model
from fp4jax.train import step as train_step

PER_LAYER = fp4jax.recipe("mxfp4-lh16")
DIMS = (((1,), (0,)), ((), ()))
CFG = model.model_config("tiny", vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1,
                         mlp_dim=32)
TOKENS = jax.random.randint(jax.random.key(0), (2, 17), 0, 64, jnp.int32)


def test_policy_signs():
  k1, k2 = jax.random.key(1), jax.random.key(2)
  assert hadamard.policy_signs("none", 16) is None
  np.testing.assert_array_equal(hadamard.policy_signs("fixed", 16, seed=3),
                                hadamard.random_signs(jax.random.key(3), 16))
  np.testing.assert_array_equal(hadamard.policy_signs("per-layer", 16, key=k1, layer_key=k2),
                                hadamard.random_signs(k2, 16))
  np.testing.assert_array_equal(hadamard.policy_signs("per-step", 16, key=k1, layer_key=k2),
                                hadamard.random_signs(k1, 16))
  with pytest.raises(ValueError, match="'per-layer' needs a layer_key"):
    hadamard.policy_signs("per-layer", 16, key=k1)
  with pytest.raises(ValueError, match="'random' is not one of none, fixed, per-layer, per-step"):
    hadamard.policy_signs("random", 16)


def test_dot_general_per_layer_signs_follow_layer_key_only():
  x, w = jax.random.normal(jax.random.key(0), (32, 64)), jax.random.normal(jax.random.key(1), (64, 32))
  dg = jax.jit(lambda k, lk: dot.dot_general(PER_LAYER)(x, w, DIMS, key=k, layer_key=lk))
  a = dg(jax.random.key(5), jax.random.key(1))
  np.testing.assert_array_equal(a, dg(jax.random.key(6), jax.random.key(1)))  # key unused
  assert not np.array_equal(a, dg(jax.random.key(5), jax.random.key(2)))
  with pytest.raises(ValueError, match="per-layer Hadamard signs and needs layer_key="):
    dot.dot_general(PER_LAYER)(x, w, DIMS)


class _TwoDense(nn.Module):
  @nn.compact
  def __call__(self, x):
    dg = fflax.DotGeneral.partial(recipe=PER_LAYER, capture=True)
    return nn.Dense(32, dot_general_cls=dg, name="b")(nn.Dense(32, dot_general_cls=dg, name="a")(x))


def test_linen_captured_layer_key_reproduces_the_layer():
  """The sown "layer_key" is what the layer passed as dot_general's layer_key."""
  x = jax.random.normal(jax.random.key(0), (16, 32))
  m = _TwoDense()
  params = jax.jit(m.init)({"params": jax.random.key(0), "hadamard": jax.random.key(9)},
                           x)["params"]
  y, inter = jax.jit(functools.partial(m.apply, mutable=["intermediates"]))(
      {"params": params}, x, rngs={"hadamard": jax.random.key(9)})
  sown = inter["intermediates"]["b"]["DotGeneral_0"]
  lhs, rhs, layer_key = sown["lhs"][0], sown["rhs"][0], sown["layer_key"][0]
  layer_b = jax.jit(lambda a, w, k: dot.dot_general(PER_LAYER)(a, w, DIMS, layer_key=k))
  again = layer_b(lhs, rhs, layer_key) + params["b"]["bias"]
  np.testing.assert_array_equal(y, again)
  other = inter["intermediates"]["a"]["DotGeneral_0"]["layer_key"][0]
  assert not np.array_equal(jax.random.key_data(other), jax.random.key_data(layer_key))
  with pytest.raises(ValueError, match="rngs=\\{'hadamard'"):
    m.apply({"params": params}, x)


def _layer_keys_fn(cfg):
  """(params, hadamard key, quant key) -> {module path: key data [2] or [n_layers, 2]}
  of every DotGeneral of a Llama."""
  m = model.Llama(dataclasses.replace(cfg, capture_dots=True), PER_LAYER)

  @jax.jit
  def captured(params, hadamard_key, quant_key):
    _, inter = m.apply({"params": params}, TOKENS[:, :-1], mutable=["intermediates"],
                       rngs={"quant": quant_key, "hadamard": hadamard_key})
    return inter["intermediates"]

  def layer_keys(params, hadamard_key, quant_key):
    flat = traverse_util.flatten_dict(captured(params, hadamard_key, quant_key), sep="/")
    return {k.rsplit("/", 1)[0]: np.asarray(jax.random.key_data(v[0]))
            for k, v in flat.items() if k.endswith("/layer_key")}
  return layer_keys


@pytest.mark.parametrize("scan_layers,remat", [(False, "none"), (True, "full")])
def test_llama_per_layer_keys_are_stable_across_calls_and_differ_across_layers(scan_layers, remat):
  cfg = dataclasses.replace(CFG, scan_layers=scan_layers, remat=remat)
  m = model.Llama(cfg, PER_LAYER)
  params = nn.unbox(jax.jit(m.init)({"params": jax.random.key(0), "hadamard": jax.random.key(0)},
                                    TOKENS[:, :-1])["params"])
  layer_keys = _layer_keys_fn(cfg)
  first = layer_keys(params, jax.random.key(4), jax.random.key(0))
  again = layer_keys(params, jax.random.key(4), jax.random.key(1))  # next step's quant key
  other_run = layer_keys(params, jax.random.key(5), jax.random.key(0))
  assert len(first) == 7 * (1 if scan_layers else CFG.n_layers)  # q k v o gate up down
  rows = np.concatenate([k.reshape(-1, 2) for k in first.values()])
  assert len(rows) == 7 * CFG.n_layers
  assert len({tuple(r) for r in rows}) == len(rows)  # every layer its own key
  for path in first:
    np.testing.assert_array_equal(first[path], again[path])
    assert not np.array_equal(first[path], other_run[path])


def test_train_and_eval_steps_use_the_same_per_layer_signs_every_step():
  """mxfp4-lh16 is deterministic given the run's layer key: the loss of the same
  params is the same at step 0 and step 5, in evaluation, and equals loss_fn with
  layer_key(seed_key) (and not with another run's). One block (its seven
  linears have their own keys) keeps the three compiles small."""
  m = model.Llama(dataclasses.replace(CFG, n_layers=1), PER_LAYER)
  tx = optax.sgd(0.0)
  seed_key = jax.random.key(3)
  init = jax.jit(lambda key: train_step.init_state(m, tx, key, TOKENS.shape[1] - 1))
  state = nn.unbox(init(jax.random.key(0)))
  step = jax.jit(train_step.make_train_step(m, tx, lambda s: 0.0, seed_key=seed_key, n_micro=1))
  loss0 = step(state, TOKENS)[1]["loss"]
  loss5 = step(state.replace(step=jnp.int32(5)), TOKENS)[1]["loss"]
  np.testing.assert_array_equal(loss0, loss5)
  evaluate = jax.jit(train_step.make_eval_step(m, jax.random.key(8), train_step.layer_key(seed_key)))
  np.testing.assert_allclose(evaluate(state.params, TOKENS, 0), loss0, rtol=1e-6)
  loss = jax.jit(lambda p, lk: train_step.loss_fn(m, p, TOKENS, jax.random.key(1), lk))
  np.testing.assert_allclose(loss(state.params, train_step.layer_key(seed_key)), loss0, rtol=1e-6)
  assert abs(float(loss(state.params, jax.random.key(4))) - float(loss0)) > 1e-6


def test_nnx_per_layer_key_is_drawn_once_per_module():
  x = jax.random.normal(jax.random.key(0), (16, 32))
  w = jax.random.normal(jax.random.key(1), (32, 32))
  rngs = nnx.Rngs(quant=0, hadamard=1)
  a, b = fflax.NNXDotGeneral(PER_LAYER, rngs), fflax.NNXDotGeneral(PER_LAYER, rngs)
  np.testing.assert_array_equal(a(x, w, DIMS), a(x, w, DIMS))
  assert not np.array_equal(a(x, w, DIMS), b(x, w, DIMS))
  np.testing.assert_array_equal(
      a(x, w, DIMS), dot.dot_general(PER_LAYER)(x, w, DIMS, layer_key=a.layer_key[...]))
