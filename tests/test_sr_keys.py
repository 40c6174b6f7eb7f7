"""Where stochastic rounding's random bits come from (fp4jax.dot, module docstring
"Randomness"): distinct bits for every role, operand and orientation of one
array, for every layer and step; the same bits on every data-parallel shard
and in a resumed run; the same Hadamard signs on every tensor-parallel shard
of a contraction axis (the 8 virtual CPU devices of tests/conftest.py).

The quantized operands are read off dot_general's own outputs: with identity
matrices as the other operands (quantized exactly: 1 and 0 lie on the grid),
each GEMM's output is one quantized operand. A = 5 everywhere sits halfway
between E2M1's 4 and 6, so each element of each quantization rounds up with
probability 1/2: two quantizations drawing the same bits agree everywhere,
element for element or transposed; independent ones agree on half.
"""

import itertools
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fp4jax
from fp4jax import dot, flax as fflax
from fp4jax.numerics.formats import QuantSpec
from fp4jax.recipes import Gemm, Recipe
from tests.helpers import final_state, tiny_config
from tests.helpers import binomial_two_sided_p

N = 64
A = jnp.full((N, N), 5.0, jnp.float32)
EYE = jnp.eye(N, dtype=jnp.float32)
DIMS = (((1,), (0,)), ((), ()))
_SR = QuantSpec("mxfp4", rounding="stochastic")
SR_EVERYWHERE = Recipe("sr-everywhere", fprop=Gemm(_SR, _SR), dgrad=Gemm(_SR, _SR),
                       wgrad=Gemm(_SR, _SR))
ALPHA = 1e-6
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUANTIZATIONS = ("fprop.lhs", "fprop.rhs", "dgrad.lhs", "dgrad.rhs", "wgrad.lhs", "wgrad.rhs")


def _gemms(recipe, x, w, dy, key):
  """(Y, dX, dW) of dot_general(recipe) on x [M, K], w [K, N] and output gradient dy."""
  y, vjp = jax.vjp(lambda a, b: dot.dot_general(recipe)(a, b, DIMS, key=key), x, w)
  return (y, *vjp(dy))


def six_quantizations(recipe, a, key):
  """{role.operand: that GEMM's quantization of `a` [N, N], in a's coordinates}."""
  y_x, _, dw_x = _gemms(recipe, a, EYE, EYE, key)    # X = a: Y = q(a), dW = q(a)^T
  _, dx_dy, dw_dy = _gemms(recipe, EYE, EYE, a, key)  # dY = a: dX = q(a), dW = q(a)
  y_w, dx_w, _ = _gemms(recipe, EYE, a, EYE, key)     # W = a: Y = q(a), dX = q(a)^T
  return {"fprop.lhs": y_x, "fprop.rhs": y_w, "dgrad.lhs": dx_dy, "dgrad.rhs": dx_w.T,
          "wgrad.lhs": dw_x.T, "wgrad.rhs": dw_dy}


def _rounded_up(q):
  q = np.asarray(q, np.float32)
  assert set(np.unique(q)) <= {4.0, 6.0}, "the read-out is a quantized 5: 4 or 6"
  return q == 6.0


def assert_independent(named, what):
  """Every pair of the {name: rounded-up [N, N]} decisions agrees on about
  half of the elements, element for element and transposed (two-sided
  binomial p-values, Bonferroni over the comparisons at level ALPHA); each
  rounds up about half the time."""
  names = sorted(named)
  counts = [int(np.sum(named[a] == named[b])) for a, b in itertools.combinations(names, 2)]
  counts += [int(np.sum(named[a] == named[b].T)) for a, b in itertools.combinations(names, 2)]
  counts += [int(np.sum(named[a])) for a in names]
  pv = binomial_two_sided_p(np.array(counts), N * N, np.full(len(counts), 0.5))
  labels = ([f"{a} = {b}" for a, b in itertools.combinations(names, 2)]
            + [f"{a} = {b}^T" for a, b in itertools.combinations(names, 2)]
            + [f"{a} rounds up" for a in names])
  bad = [f"{l}: {c}/{N * N}" for l, c, p in zip(labels, counts, pv) if p < ALPHA / len(pv)]
  assert not bad, f"{what}: correlated roundings: {bad}"


def test_every_role_operand_and_orientation_draws_its_own_bits():
  """One array quantized by all six operands of the three GEMMs: row-wise
  and column-wise (X in Fprop and Wgrad, dY in Dgrad and Wgrad, W in Fprop
  and Dgrad), pairwise independent."""
  qs = jax.jit(lambda k: six_quantizations(SR_EVERYWHERE, A, k))(jax.random.key(0))
  assert_independent({n: _rounded_up(q) for n, q in qs.items()}, "six quantizations of A")


def test_the_same_key_gives_the_same_bits_and_another_key_others():
  """The same key (the forward and backward of one step) repeats every
  rounding; another key (another step) is independent of it."""
  run = jax.jit(lambda k: six_quantizations(SR_EVERYWHERE, A, k))
  a, b, c = run(jax.random.key(1)), run(jax.random.key(1)), run(jax.random.key(2))
  for name in QUANTIZATIONS:
    np.testing.assert_array_equal(a[name], b[name])
  assert_independent({f"step1.{n}": _rounded_up(a[n]) for n in QUANTIZATIONS}
                     | {f"step2.{n}": _rounded_up(c[n]) for n in QUANTIZATIONS}, "two steps")


class _TwoLayers(nn.Module):
  """Two Dense layers (identity kernels) on one input: outputs q1(x), q2(x)."""

  @nn.compact
  def __call__(self, x):
    dg = fflax.DotGeneral.partial(recipe=SR_EVERYWHERE)
    dense = lambda name: nn.Dense(N, use_bias=False, dot_general_cls=dg, name=name,
                                  kernel_init=lambda *_: EYE)
    return dense("a")(x), dense("b")(x)


def test_layers_draw_their_own_bits():
  model = _TwoLayers()
  params = model.init({"params": jax.random.key(0), "quant": jax.random.key(0)}, A)
  run = jax.jit(lambda k: model.apply(params, A, rngs={"quant": k}))
  (a1, b1), (a2, b2) = run(jax.random.key(3)), run(jax.random.key(4))
  assert_independent({"layer_a.step1": _rounded_up(a1), "layer_b.step1": _rounded_up(b1),
                      "layer_a.step2": _rounded_up(a2), "layer_b.step2": _rounded_up(b2)},
                     "two layers, two steps")


def _mesh(shape, names):
  return jax.sharding.Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


def test_data_parallel_shards_draw_the_bits_of_the_whole_array():
  """Rows of A spread over 8 devices (the token axis of X and dY, K of W):
  every quantization equals the one-device result bit for bit. Control: a
  quantization that draws on each shard from the same key repeats its bits
  on every shard, which this comparison catches."""
  mesh = _mesh((8,), ("data",))
  key = jax.random.key(5)
  one_device = jax.jit(lambda a: six_quantizations(SR_EVERYWHERE, a, key))(A)
  rows = NamedSharding(mesh, P("data", None))
  sharded = jax.jit(lambda a: six_quantizations(SR_EVERYWHERE, a, key),
                    in_shardings=rows)(jax.device_put(A, rows))
  for name in QUANTIZATIONS:
    np.testing.assert_array_equal(sharded[name], one_device[name], err_msg=name)
  local = jax.jit(jax.shard_map(
      lambda a: fp4jax.fake_quantize(a, _SR, -1, key), mesh=mesh, in_specs=P("data", None),
      out_specs=P("data", None)))(A)
  shards = np.asarray(local).reshape(8, N // 8, N)
  assert all(np.array_equal(shards[0], s) for s in shards)  # the bug the test guards against
  assert not np.array_equal(local, fp4jax.fake_quantize(A, _SR, -1, key))


def test_tensor_parallel_shards_of_a_contraction_axis_share_the_hadamard_signs():
  """mxfp4-rh16 (fresh signs every step) with K split over 8 devices (32
  columns each: two Hadamard blocks per shard): forward and both gradients
  equal the one-device run up to float32 summation order, i.e. every shard
  rotated with the same signs; signs differing per shard are caught (control)."""
  recipe = fp4jax.recipe("mxfp4-rh16")
  key = jax.random.key(6)
  x = jax.random.normal(jax.random.key(7), (16, 256), jnp.float32)
  w = jax.random.normal(jax.random.key(8), (256, 48), jnp.float32)
  dy = jax.random.normal(jax.random.key(9), (16, 48), jnp.float32)
  gemms = lambda x, w: _gemms(recipe, x, w, dy, key)
  want = jax.jit(gemms)(x, w)
  mesh = _mesh((8,), ("model",))
  xs, ws = NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P("model", None))
  got = jax.jit(gemms, in_shardings=(xs, ws))(jax.device_put(x, xs), jax.device_put(w, ws))
  for name, g, r in zip(("Y", "dX", "dW"), got, want):
    np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(r))),
                               err_msg=name)
  # Control: other signs (another key) move Y by the quantization noise, far
  # outside the tolerance, so a shard rotating with its own signs would fail.
  other = jax.jit(lambda x, w: _gemms(recipe, x, w, dy, jax.random.fold_in(key, 1)))(x, w)
  assert float(jnp.max(jnp.abs(other[0] - want[0]))) > 100 * 2e-5 * float(jnp.max(jnp.abs(want[0])))


_STOPPED_CHILD = """
import json, sys
import ml_collections
from fp4jax.train import trainer
class Stop(Exception):
  pass
def stop(step, state, batch):
  if step == 2:
    raise Stop
try:
  trainer.train(ml_collections.ConfigDict(json.loads(sys.argv[1])), sys.argv[2], callbacks=[stop])
except Stop:
  sys.exit(0)
sys.exit(1)
"""


@pytest.mark.slow
def test_a_resumed_sr_run_draws_the_bits_of_an_uninterrupted_one(tmp_path):
  """mxfp4-sr, 4 steps. A first process stops in step 2's callback (the
  trainer saves step 2 on the way out); this process resumes it for steps 3
  and 4 after an uninterrupted run of its own: the final states are equal
  bit for bit, so the random bits of every step follow from the checkpoint
  and the seed alone, not from the process that draws them."""
  from fp4jax.train import trainer  # pylint: disable=g-import-not-at-top
  config = tiny_config(steps=4, checkpoint_every=2, eval_every=4, async_checkpointing=False)
  config.quant.name = "mxfp4-sr"
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  trainer.train(config, straight)
  child = subprocess.run([sys.executable, "-c", _STOPPED_CHILD, config.to_json(), resumed],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert child.returncode == 0, child.stderr[-3000:]
  summary = trainer.train(config, resumed)
  assert summary["resumed_from_step"] == 2
  (step_a, state_a), (step_b, state_b) = final_state(straight), final_state(resumed)
  assert step_a == step_b == 4
  for a, b in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b)):
    np.testing.assert_array_equal(a, b)
