"""fp4jax recipes inside MaxText, on a tiny MaxText decoder (Python >= 3.12).

The model: MaxText's default (Llama-style) decoder, 2 layers, width 128,
4 query heads and 2 kv heads of 32, MLP 256, vocabulary 256, 64 tokens;
synthetic data. MaxText's own training loop runs in a subprocess (its start-up
changes JAX's global PRNG implementation).
"""

import dataclasses
import json
import math
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from fp4jax import errors
from fp4jax.maxtext import pretrain as maxtext_pretrain

maxtext = pytest.importorskip(
    "maxtext", reason="maxtext is not installed (pip install -e '.[maxtext]', Python >= 3.12)")

import flax.linen as nn  # pylint: disable=g-import-not-at-top,g-bad-import-order
from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from maxtext.configs import pyconfig
from maxtext.layers import linears
from maxtext.models import models
from maxtext.utils import maxtext_utils

from fp4jax import dot
from fp4jax.kernels import quantize as kernel_quantize
from fp4jax.maxtext import quantization
from fp4jax.maxtext.quantization import Fp4jaxQuantization
from fp4jax.maxtext.supported_recipes import recipe_for

pytestmark = pytest.mark.slow  # trains (see pyproject's markers)

BASE = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
TINY = ["model_name=default", "base_emb_dim=128", "base_num_query_heads=4",
        "base_num_kv_heads=2", "base_mlp_dim=256", "base_num_decoder_layers=2",
        "head_dim=32", "vocab_size=256", "max_target_length=64", "per_device_batch_size=2",
        "dataset_type=synthetic", "attention=dot_product", "hardware=cpu",
        "skip_jax_distributed_system=True", "enable_tensorboard=False"]
L = 64
# Relative RMS error of mxfp4-dh16's logits against bf16's on this model:
# 0.238 measured. MXFP4 (round to nearest, even scale) leaves a relative RMS
# error of 0.112 on a Gaussian operand (fp4jax.numerics.formats.fake_quantize,
# 4096 x 128); both operands of 7 GEMMs per layer, 2 layers, compound to a
# few times that, so the band is that value within a factor of about 2.
LOGIT_ERROR = (0.1, 0.4)


def _config(tmp, **overrides):
  extra = [f"{k}={v}" for k, v in overrides.items()]
  return pyconfig.initialize([None, BASE, "run_name=t", f"base_output_directory={tmp}"]
                             + TINY + extra)


def _mesh(config, sizes=None):
  """MaxText's mesh for `config` (8-way FSDP on the 8 test devices), or one
  with MaxText's axes of `sizes` ({mesh axis: devices}, the others 1)."""
  grid = maxtext_utils.create_device_mesh(config)
  if sizes is not None:
    shape = [sizes.get(a, 1) for a in config.mesh_axes]
    grid = grid.reshape(-1)[:math.prod(shape)].reshape(shape)
  return jax.sharding.Mesh(grid, config.mesh_axes)


def _model_fns(config, quant):
  """(init(), loss_and_logits(params)) of MaxText's model with `quant`."""
  mesh = _mesh(config)
  model = models.transformer_as_linen(config, mesh, quant=quant)
  B = config.global_batch_size_to_train_on  # pylint: disable=invalid-name
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (B, L + 1)), jnp.int32)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
  seg = jnp.ones((B, L), jnp.int32)

  def init():
    with mesh, nn.logical_axis_rules(config.logical_axis_rules):
      return model.init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)},
                        inputs, pos, seg, enable_dropout=False)["params"]

  def loss_and_logits(params):
    with mesh, nn.logical_axis_rules(config.logical_axis_rules):
      logits = model.apply({"params": params}, inputs, pos, seg, enable_dropout=False)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.take_along_axis(logp, targets[..., None], -1).mean(), logits

  return init, loss_and_logits


def _logits_and_grads(config, quant, params):
  _, loss_and_logits = _model_fns(config, quant)
  (_, logits), grads = jax.value_and_grad(loss_and_logits, has_aux=True)(params)
  return logits, grads


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """(config, parameters, bf16 logits and gradients) of the unquantized scanned model."""
  config = _config(str(tmp_path_factory.mktemp("maxtext")))
  init, _ = _model_fns(config, None)
  params = init()
  return config, params, _logits_and_grads(config, None, params)


def test_bf16_recipe_is_bitwise_maxtexts_unquantized_model(tiny):
  config, params, (logits, grads) = tiny
  quant = Fp4jaxQuantization(recipe=recipe_for("bf16", "bfloat16"))
  q_logits, q_grads = _logits_and_grads(config, quant, params)
  np.testing.assert_array_equal(np.asarray(q_logits), np.asarray(logits))
  assert jax.tree.structure(q_grads) == jax.tree.structure(grads)
  for a, b in zip(jax.tree.leaves(q_grads), jax.tree.leaves(grads)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mxfp4_dh16_sends_every_projection_through_fp4jax(tiny, monkeypatch, tmp_path):
  config, params, (logits, _) = tiny
  unscanned = _config(str(tmp_path), scan_layers=False)
  quant = Fp4jaxQuantization(recipe=recipe_for("mxfp4-dh16", "bfloat16"))
  init, loss_and_logits = _model_fns(unscanned, quant)
  unscanned_params = init()
  kernels = []
  real = dot.dot_general

  def counting(recipe, *args):
    fn = real(recipe, *args)

    def call(lhs, rhs, *a, **k):
      kernels.append((recipe.name, tuple(lhs.shape[:2]), tuple(rhs.shape)))
      return fn(lhs, rhs, *a, **k)
    return call

  monkeypatch.setattr(dot, "dot_general", counting)
  _, q_logits = loss_and_logits(unscanned_params)
  # MaxText builds its NNX modules inside apply, each running a dummy forward
  # on 32 tokens; the model's own calls are those on the batch.
  batch = (unscanned.global_batch_size_to_train_on, L)
  on_batch = [rhs for name, lhs, rhs in kernels if lhs == batch]
  per_layer = [(128, 4, 32), (128, 2, 32), (128, 2, 32), (4, 32, 128),  # q k v out
               (128, 256), (128, 256), (256, 128)]                     # wi_0 wi_1 wo
  assert sorted(on_batch) == sorted(per_layer * 2)  # 2 layers
  assert {name for name, _, _ in kernels} == {"mxfp4-dh16"}
  # The same weights unscanned and bf16 give the reference logits of this model.
  _, bf16_logits = _model_fns(unscanned, None)[1](unscanned_params)
  err = float(jnp.sqrt(jnp.mean((q_logits - bf16_logits) ** 2) / jnp.mean(bf16_logits ** 2)))
  assert LOGIT_ERROR[0] < err < LOGIT_ERROR[1]
  del logits, params


def test_config_that_cannot_take_the_recipe_is_one_line():
  config = types.SimpleNamespace(quantization="", per_device_batch_size=1,
                                 max_target_length=48, dtype="bfloat16")
  with pytest.raises(errors.UserError, match=r"1 x 48 = 48 must be a multiple of 32"):
    maxtext_pretrain.quantization_for("mxfp4-dh16", config)
  config.quantization = "int8"
  with pytest.raises(errors.UserError, match="drop quantization='int8'"):
    maxtext_pretrain.quantization_for("mxfp4-dh16", config)
  config.quantization, config.max_target_length = "", 64
  assert maxtext_pretrain.quantization_for("mxfp4-dh16", config).get_block_size() == 32


@pytest.mark.parametrize("arg, message", [
    ("fp4jax_recipe=mxfp4-nope", "unknown recipe 'mxfp4-nope'"),
    ("fp4jax_recipe=mxfp4-sr", "recipe 'mxfp4-sr' uses stochastic rounding"),
    ("run_name=x", "give fp4jax_recipe=NAME once"),
])
def test_bad_command_line_is_one_line_and_exit_2(arg, message):
  out = subprocess.run([sys.executable, "-m", "fp4jax.maxtext.pretrain", BASE, arg],
                       capture_output=True, text=True, timeout=120, check=False)
  assert out.returncode == 2, out.stderr
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and message in lines[0], out.stderr


def _train(tmp, steps):
  """MaxText's loop on the tiny model with mxfp4-dh16: (its log, its metrics rows)."""
  metrics = os.path.join(tmp, f"metrics_{steps}.txt")
  args = [sys.executable, "-m", "fp4jax.maxtext.pretrain", BASE, "run_name=loop",
          f"base_output_directory={tmp}", *TINY, f"steps={steps}", "checkpoint_period=10",
          "async_checkpointing=False", "learning_rate=1e-2", f"metrics_file={metrics}",
          "fp4jax_recipe=mxfp4-dh16"]
  out = subprocess.run(args, capture_output=True, text=True, timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  with open(metrics) as f:
    return out.stdout + out.stderr, [json.loads(line) for line in f]


def test_maxtexts_loop_trains_20_steps_then_restores_its_checkpoint(tmp_path):
  log, rows = _train(str(tmp_path), 20)
  assert "fp4jax.maxtext: MaxText's projections run recipe mxfp4-dh16" in log
  losses = [r["learning/loss"] for r in rows]
  assert [r["step"] for r in rows] == list(range(20))
  assert losses[-1] < losses[0] / 10, losses
  assert sorted(os.listdir(os.path.join(tmp_path, "loop", "checkpoints"))) == ["0", "10", "19"]
  log, rows = _train(str(tmp_path), 22)
  assert "restoring from this run's directory step 19" in log
  assert [r["step"] for r in rows] == [20, 21]


def _recipe(name, backend):
  return dataclasses.replace(recipe_for(name, "bfloat16"), backend=backend)


def _quantize_kernel_shapes(monkeypatch):
  """The shapes of the arrays the pallas backend's quantize kernel is called on."""
  seen = []
  real = kernel_quantize.fake_quantize

  def recording(x, *args, **kwargs):
    seen.append(tuple(x.shape))
    return real(x, *args, **kwargs)
  monkeypatch.setattr(kernel_quantize, "fake_quantize", recording)
  return seen


def test_maxtexts_projections_run_the_kernels_on_each_devices_tokens(tiny, monkeypatch):
  """The tiny model's forward and backward under MaxText's mesh (8-way FSDP, set
  as its trainer does with jax.set_mesh) and logical rules, on the pallas
  backend: each projection hands DotGeneral its operands' logical names, so
  every quantize kernel reads one device's 2 of the 16 sequences, none the
  global batch (fp4jax.shard_local; without names every kernel on activations
  would read all 1,024 tokens)."""
  config, params, _ = tiny
  model = models.transformer_as_linen(config, _mesh(config),
                                      quant=Fp4jaxQuantization(recipe=_recipe("mxfp4-dh16",
                                                                              "pallas")))
  B = config.global_batch_size_to_train_on  # pylint: disable=invalid-name
  inputs = jnp.asarray(np.random.default_rng(0).integers(0, 256, (B, L)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
  seg = jnp.ones((B, L), jnp.int32)

  def loss(p):
    logits = model.apply({"params": p}, inputs, pos, seg, enable_dropout=False)
    return jnp.mean(logits.astype(jnp.float32) ** 2)

  seen = _quantize_kernel_shapes(monkeypatch)
  with jax.set_mesh(_mesh(config)), nn.logical_axis_rules(config.logical_axis_rules):
    value, grads = jax.jit(jax.value_and_grad(loss))(params)
  per_device = B // 8
  assert (per_device, L, 128) in seen and (per_device * L, 128) in seen, seen  # Fprop, Wgrad
  assert not [s for s in seen if B in s[:1] or B * L in s or (L, B) == s[:2]], seen
  assert np.isfinite(value) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_the_input_names_are_in_maxtexts_logical_rules(tiny):
  """A name the rules lack would leave that dim whole without a word."""
  ruled = {name for name, _ in tiny[0].logical_axis_rules}
  for kernel_names, input_names in quantization.INPUT_AXES.items():
    assert set(kernel_names) | set(input_names) <= ruled, (kernel_names, input_names)
  dims = (((2, 3), (0, 1)), ((), ()))
  assert quantization.input_axes(4, dims, ("heads", "kv", "embed_attn")) == (
      "activation_batch_attn", "activation_length_attn", "activation_heads", "activation_kv")
  # MaxText's dummy forward at construction: [tokens, features], left whole.
  assert quantization.input_axes(2, (((1,), (0,)), ((), ())), ("embed", "mlp")) == (None, None)


# MaxText's projections: (kernel's logical axes, input shape [batch, length,
# features...], kernel shape) of the attention query, attention out, MLP wo.
PROJECTIONS = {
    "query": (("embed_attn", "q_heads", "kv"), (16, 64, 128), (128, 4, 32)),
    "out": (("heads", "kv", "embed_attn"), (16, 64, 4, 32), (4, 32, 128)),
    "wo": (("mlp", "embed"), (16, 64, 256), (256, 128)),
}


def _exact(rng, shape):
  """bf16 multiples of 1/16 in [-6/16, 6/16] and one 7/16: every float32 sum of
  the GEMMs is exact, so a split sum's order cannot hide a difference."""
  a = rng.integers(-6, 7, shape).astype(np.float32)
  a.flat[rng.integers(a.size)] = 7
  return jnp.asarray(a / 16, jnp.bfloat16)


def _dense_general(config, sizes, backend, projection):
  """(y, dx, dw) of MaxText's DenseGeneral with recipe mxfp4-dh16 on `backend`,
  on MaxText's mesh of `sizes` (_mesh), as float32 numpy arrays."""
  kernel_axes, x_shape, w_shape = PROJECTIONS[projection]
  n_in = len(x_shape) - 2
  layer = linears.DenseGeneral(
      in_features_shape=x_shape[2:], out_features_shape=w_shape[n_in:],
      axis=tuple(range(-n_in, 0)), kernel_axes=kernel_axes, dtype=jnp.bfloat16,
      weight_dtype=jnp.bfloat16, quant=Fp4jaxQuantization(recipe=_recipe("mxfp4-dh16", backend)),
      rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  x, layer.kernel.value = _exact(rng, x_shape), _exact(rng, w_shape)
  dy = _exact(rng, x_shape[:2] + w_shape[n_in:])
  graph, params = nnx.split(layer)

  def fwd_bwd(x, params, dy):
    y, vjp = jax.vjp(lambda x, params: nnx.merge(graph, params)(x), x, params)
    dx, dparams = vjp(dy)
    return y, dx, dparams["kernel"][...]

  mesh = _mesh(config, sizes)
  with jax.set_mesh(mesh), nn.logical_axis_rules(config.logical_axis_rules):
    tokens = NamedSharding(mesh, nn.logical_to_mesh_axes(("activation_batch",)))
    x, dy = jax.device_put(x, tokens), jax.device_put(dy, tokens)
    params["kernel"] = nnx.Param(jax.device_put(
        params["kernel"][...], NamedSharding(mesh, nn.logical_to_mesh_axes(kernel_axes))))
    out = jax.jit(fwd_bwd)(x, params, dy)
  return [np.asarray(o.astype(jnp.float32)) for o in out]


# fsdp: MaxText's default; fsdp x tensor: the query's heads, the out
# projection's and wo's contractions split 4 ways (summed across devices).
MESHES = {"fsdp": {"fsdp": 8}, "fsdp x tensor": {"fsdp": 2, "tensor": 4}}


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("projection", list(PROJECTIONS))
@pytest.mark.parametrize("backend", ["xla", "pallas", "mosaic"])
def test_a_sharded_dense_general_equals_one_device_bit_for_bit(tiny, backend, projection, mesh):
  """MaxText's DenseGeneral on 8 devices gives the outputs and gradients of one
  device bit for bit: xla partitioned by XLA, pallas's quantize kernels and
  mosaic's quantize kernels and GEMMs (their CPU twins) per shard, mosaic's
  split sums reduced across devices (fp4jax.shard_local)."""
  config = tiny[0]
  one = _dense_general(config, {}, backend, projection)
  eight = _dense_general(config, MESHES[mesh], backend, projection)
  for name, a, b in zip(("y", "dx", "dw"), eight, one):
    np.testing.assert_array_equal(a, b, err_msg=f"{name} of {projection} on {backend}, {mesh}")
  assert np.abs(one[2]).max() > 0
